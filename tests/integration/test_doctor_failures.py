"""`launcher doctor` on real failures, provoked on CPU: each is classified with its fix.

Local runs (2 gloo processes, gpt_tiny): an exception, out of memory at start-up and in the step (an
address-space limit derived from a probe run's measured peak, not a constant), a rendezvous port held
by the test, a SIGKILLed rank, a hang, a collective timeout, a restart that then completes. On the local
Slurm cluster: a time limit (cluster.time_min=1, one rank asleep) and a rank killed under srun; both
are submitted when the module starts and checked last, so they run while the local tests do.
"""
from __future__ import annotations

import json
import os
import resource
import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Dict, List, Optional

import pytest

from helpers import BIN, launch, listed, run_cmd, runs_json, wait_final
from launcher.doctor import FIXES
from launcher.run.rundir import RunDir

pytestmark = [pytest.mark.timeout(240), pytest.mark.dist]

# no restart: each drill's failure is the outcome doctor explains
BASE = ["model=gpt_tiny", "train.max_restarts=0", "train.log_interval=0",
        "optim.warmup_steps=0", "cluster.gpus_per_node=2"]
MB = 1024 * 1024


def doctor(run: dict, root: Path, extra_env: Optional[Dict[str, str]] = None) -> dict:
    res = run_cmd([str(BIN / "launcher"), "doctor", run["run_id"], "--json", "--root", str(root)], root, timeout=120,
                  extra_env=extra_env)
    assert res.returncode == 0, res.stdout + res.stderr
    return json.loads(res.stdout)


def failed_run(overrides: List[str], root: Path, limit: Optional[int] = None) -> dict:
    """A local run that fails; ``limit``: the address-space limit (RLIMIT_AS, bytes) of the launch and so
    of every process it starts."""
    if limit is None:
        res = launch([*BASE, *overrides], root, timeout=200)
    else:
        env = dict(os.environ, LAUNCHER_RUNS=str(root), PYTHONUNBUFFERED="1")
        res = subprocess.run([str(BIN / "launch"), *BASE, *overrides], capture_output=True, text=True, timeout=200,
                             env=env, cwd=str(root.parent),
                             preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (limit, limit)))
    assert res.returncode != 0, res.stdout[-2000:]
    runs = listed(root)  # read in this process: `launcher runs --json` is checked once, in the exception test
    assert len(runs) == 1, res.stdout[-3000:] + res.stderr[-3000:]  # (a launch that failed before its run)
    (run,) = runs
    assert run["status"] == "failed", run
    return run


def expect(d: dict, kind: str, rank: Optional[int] = None, *words: str) -> None:
    text = d["summary"] + "\n" + "\n".join(d["detail"])
    assert d["kind"] == kind, json.dumps(d, indent=1)
    assert d["fix"] == FIXES[kind]
    if rank is not None:
        assert d["rank"] == rank, json.dumps(d, indent=1)
    for w in words:
        assert w in text, (w, text)


# ---- Slurm jobs that take a while: submitted first, checked last --------------------------------------
def _slurm_env() -> Optional[Dict[str, str]]:
    conf = os.environ.get("SLURM_CONF")
    if not conf or shutil.which("sinfo") is None:
        return None
    res = subprocess.run(["sinfo", "-h", "-o", "%N %t"], capture_output=True, text=True, timeout=30)
    return {"SLURM_CONF": conf} if res.returncode == 0 and "node" in res.stdout else None


SLURM = ["cluster=local_slurm", "cluster.nodes=1", *BASE]
SLURM_JOBS = {
    # one minute of time; rank 1 sleeps in step 1 (no hang watchdog), so no step boundary ever comes and
    # the job meets its limit (Slurm may send the warning signal up to a minute early: with a boundary
    # after step 1 the ranks could stop there cleanly, and the drill would not be a time limit)
    "time_limit": ["cluster.time_min=1", "cluster.signal_delay_s=30", "train.steps=20", "train.fail_mode=sleep",
                   "train.fail_at_step=1", "train.fail_rank=1"],
    "killed": ["train.steps=6", "train.fail_mode=kill", "train.fail_at_step=2", "train.fail_rank=1"],
}


@pytest.fixture(scope="module", autouse=True)
def slurm_jobs(request, tmp_path_factory):
    """Submit the Slurm drills (when the cluster is up and a Slurm test is selected); cancel what is left."""
    wanted = any("slurm" in item.name for item in request.session.items if item.module is request.module)
    env = _slurm_env() if wanted else None
    jobs: Dict[str, Path] = {}
    if env is not None:
        for name, overrides in SLURM_JOBS.items():
            root = tmp_path_factory.mktemp(f"slurm_{name}") / "runs"
            res = launch([*SLURM, *overrides], root, timeout=120, extra_env=env)
            assert res.returncode == 0, res.stdout + res.stderr
            jobs[name] = root
    yield {"env": env, "roots": jobs}
    for root in jobs.values():
        for run in runs_json(root):
            if run["status"] not in ("completed", "failed", "cancelled", "timeout"):
                run_cmd([str(BIN / "launcher"), "cancel", run["run_id"], "--root", str(root)], root, timeout=120,
                        extra_env=env)


# ---- local failures ----------------------------------------------------------------------------------
def test_exception_names_rank_frame_and_message(runs_root):
    run = failed_run(["train.steps=5", "train.fail_at_step=2", "train.fail_rank=1"], runs_root)
    d = doctor(run, runs_root)
    expect(d, "exception", 1, "RuntimeError: injected failure at step 2 on rank 1", "recipes/common/faults.py:")
    # the human view, and the class column of `launcher runs`
    res = run_cmd([str(BIN / "launcher"), "doctor", run["run_id"], "--root", str(runs_root)], runs_root, timeout=120)
    assert res.returncode == 0 and "exception" in res.stdout and "launcher reproduce" in res.stdout, res.stdout
    res = run_cmd([str(BIN / "launcher"), "runs", "--root", str(runs_root)], runs_root, timeout=120)
    assert "class" in res.stdout and "exception" in res.stdout, res.stdout
    assert runs_json(runs_root)[0]["class"] == "exception"


def _vm_peak_kb(pid: int) -> Optional[int]:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmPeak:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


@pytest.fixture(scope="module")
def rank_peak_bytes(tmp_path_factory) -> int:
    """The peak address space of a rank of a healthy gpt_tiny run on this machine (VmPeak, polled while
    it runs): the limits below add a margin to it, so they fit whatever torch and libc this host has."""
    root = tmp_path_factory.mktemp("probe") / "runs"
    env = dict(os.environ, LAUNCHER_RUNS=str(root))
    proc = subprocess.Popen([str(BIN / "launch"), *BASE, "train.steps=40"], env=env, cwd=str(root.parent),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peak: Dict[int, int] = {}
    while proc.poll() is None:
        for rd in [RunDir(p) for p in root.glob("*/*") if RunDir(p).exists()]:
            for row in rd.ranks():
                kb = _vm_peak_kb(int(row["pid"]))
                if kb:
                    peak[row["rank"]] = max(peak.get(row["rank"], 0), kb)
        time.sleep(0.05)
    out = proc.stdout.read()
    assert proc.returncode == 0, out[-3000:]
    assert len(peak) == 2, (peak, out[-2000:])
    return max(peak.values()) * 1024


def test_oom_at_startup_with_a_bigger_model(runs_root, rank_peak_bytes):
    # ~300M parameters: 1.2 GB of fp32 weights alone, allocated while the engine is built, far beyond a
    # 128 MB margin over the tiny run's peak (which holds its own training-time allocations: a model of
    # 400 MB could fit there and fail later, in an import, where it reads as a plain exception)
    big = ["model.hidden_size=2048", "model.num_layers=6", "model.ffn_hidden_size=8192", "model.num_heads=16"]
    limit = rank_peak_bytes + 128 * MB
    run = failed_run(["train.steps=3", *big], runs_root, limit=limit)
    d = doctor(run, runs_root)
    expect(d, "oom_startup", None, "ran out of memory", "build_engine")
    assert "launcher plan --search" in d["fix"] and "zero=1|2|3" in d["fix"]


def test_oom_in_the_step_with_a_big_micro_batch(runs_root, rank_peak_bytes):
    # the same tiny model (its start-up fits), but one attention score tensor is 64 x 4 x 1024^2 x 4 B = 1 GB
    # (the probe's peak holds its final save's writer thread, whose allocator arenas reserve ~0.3 GB of
    # address space: the step must need more than that and the margin together)
    limit = rank_peak_bytes + 256 * MB
    run = failed_run(["train.steps=3", "train.micro_batch_size=64", "train.global_batch_size=128",
                      "model.seq_len=1024"], runs_root, limit=limit)
    d = doctor(run, runs_root)
    expect(d, "oom_step", None, "ran out of memory", "train_step", "train.micro_batch_size=64")
    assert "train.recompute" in d["fix"] and "train.micro_batch_size" in d["fix"]


def test_port_in_use_is_rendezvous(runs_root):
    with socket.socket() as held:
        held.bind(("", 0))
        held.listen(1)
        port = held.getsockname()[1]
        run = failed_run(["train.steps=3", f"cluster.master_port={port}"], runs_root)
    d = doctor(run, runs_root)
    expect(d, "rendezvous", 0, "EADDRINUSE", f":{port}", f"cluster.master_port={port}")
    assert "cluster.master_port" in d["fix"]


def test_killed_rank_is_named(runs_root):
    run = failed_run(["train.steps=6", "train.fail_mode=kill", "train.fail_at_step=2", "train.fail_rank=1"],
                     runs_root)
    d = doctor(run, runs_root)
    expect(d, "killed_rank", 1, "rank 1 died", "peer")
    assert "dmesg" in d["fix"]


def test_hang_names_the_stuck_rank_and_where(runs_root):
    # the hang watchdog is armed by a rank's first step (launcher/runtime/watchdog.py), so the start-up does
    # not count: 5 s is dozens of gpt_tiny's steps
    run = failed_run(["train.steps=6", "train.fail_mode=sleep", "train.fail_at_step=2", "train.fail_rank=1",
                      "train.hang_timeout_s=5"], runs_root)
    d = doctor(run, runs_root)
    expect(d, "hang", 1, "rank 1 stuck in recipes/common/faults.py:", "inject_fault", "after step 1")
    assert "train.hang_timeout_s" in d["fix"]


SLOW_START = """import time

import torch
from torch.nn.parallel import DistributedDataParallel

from launcher.training import Checkpoint, StepLoop


def main(cfg, ctx):
    if ctx.rank == 1:
        time.sleep(600)  # stuck before its first step: rank 0 waits for it in DDP's first broadcast
    model = DistributedDataParallel(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in StepLoop(cfg, ctx, Checkpoint(cfg, ctx, {"model": model, "optimizer": opt})):
        loss = model(torch.ones(2, 4)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        ctx.log(step, loss=loss.item())
"""


def test_a_rank_stuck_before_its_first_step_is_a_start_up_hang(tmp_path):
    """The start-up watch (train.startup_timeout_s): no step has finished, so the hang watch is not armed;
    a rank stuck before its first step is found in seconds, not at the collective's timeout (600 s) or
    never (a rank outside any collective), and named with its frame."""
    (tmp_path / "proj" / "slowstart").mkdir(parents=True)
    (tmp_path / "proj" / "slowstart" / "__init__.py").write_text("")
    (tmp_path / "proj" / "slowstart" / "slow.py").write_text(SLOW_START)
    root = tmp_path / "runs"
    res = launch(["recipe._target_=slowstart.slow.main", "cluster.gpus_per_node=2", "train.steps=3",
                  "train.max_restarts=0",  # no restart: the hang is the outcome doctor explains
                  "train.startup_timeout_s=4"], root, timeout=200, cwd=tmp_path / "proj")
    assert res.returncode != 0, res.stdout[-2000:]
    (run,) = listed(root)
    hang = json.loads((Path(run["dir"]) / "hang.json").read_text())
    assert hang["phase"] == "startup" and hang["stuck_ranks"] == [1] and 0 in map(int, hang["waiting"]), hang
    d = doctor(run, root)
    expect(d, "hang", 1, "hang in start-up: no progress for 4 s before the first step", "rank 1 stuck in",
           "slow.py")


def test_collective_timeout_names_the_rank_waited_for(runs_root):
    # no hang watchdog: rank 0 waits in the gradient all-reduce until train.dist_timeout_s
    run = failed_run(["train.steps=6", "train.fail_mode=sleep", "train.fail_at_step=2", "train.fail_rank=1",
                      "train.dist_timeout_s=10"], runs_root)
    d = doctor(run, runs_root)
    expect(d, "collective_timeout", 1, "rank 0 timed out", "waiting for rank 1")
    assert "train.dist_timeout_s" in d["fix"]


def test_restarted_then_completed_says_why(runs_root):
    res = launch([*BASE, "train.steps=6", "train.fail_at_step=3", "train.fail_rank=1", "train.fail_attempt=1",
                  # one restart: the run restarted once, then completed
                  "train.max_restarts=1", "train.checkpoint.every=2"], runs_root, timeout=200)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    (run,) = runs_json(runs_root)
    assert run["status"] == "completed" and run["class"] is None
    d = doctor(run, runs_root)
    expect(d, "completed", None, "completed 6 steps after 1 restart: failure",
           "injected failure at step 3 on rank 1")


# ---- Slurm (submitted when the module started) ---------------------------------------------------------
def _slurm_run(slurm_jobs, name: str) -> dict:
    # the tests ask for the `slurm` fixture: a cluster that is down skips them, or fails them under
    # LAUNCHER_REQUIRE_SLURM=1; here it is up, so the drills were submitted
    assert slurm_jobs["env"] is not None, "the Slurm drills were not submitted"
    (run,) = wait_final(slurm_jobs["roots"][name], 1, timeout=200)
    return run


@pytest.mark.slurm
@pytest.mark.timeout(600)  # a 1-minute limit, then its accounting: 87 s measured, the module's 240 under 3x
def test_slurm_time_limit(slurm, slurm_jobs):
    run = _slurm_run(slurm_jobs, "time_limit")
    assert run["status"] == "timeout", run
    d = doctor(run, slurm_jobs["roots"]["time_limit"], extra_env=slurm_jobs["env"])
    expect(d, "time_limit", None, "cluster.time_min=1", "TIME")
    assert "cluster.time_min" in d["fix"]


@pytest.mark.slurm
def test_slurm_killed_rank(slurm, slurm_jobs):
    run = _slurm_run(slurm_jobs, "killed")
    assert run["status"] == "failed", run
    d = doctor(run, slurm_jobs["roots"]["killed"], extra_env=slurm_jobs["env"])
    expect(d, "killed_rank", 1, "task 1: Killed")
