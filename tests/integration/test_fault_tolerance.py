"""Runs survive the cluster: interrupted runs end bit for bit where an uninterrupted run of the same
config ends (losses and every tensor of the final checkpoint), for each engine, on real Slurm
(scontrol requeue, the time-limit signal) and locally (a SIGKILLed rank, a kill while a checkpoint is
written, a hang, a resume)."""
import json
import os
import random
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

import pytest

from helpers import BIN, assert_one_wandb_run, launch, read_metrics, run_cmd, runs_json, tensors

QUICK = ["train.log_interval=0"]


def final_state(run_dir: Path) -> Dict[str, "object"]:
    """Every tensor of the run's latest checkpoint (weights, optimizer, loss scaler, RNG states)."""
    import torch

    ckpt = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip()
    out = {}
    for f in sorted(ckpt.rglob("*.pt")):
        for k, t in tensors(torch.load(f, map_location="cpu", weights_only=False)):
            out[f"{f.relative_to(ckpt)}{k}"] = t
    return out


def assert_identical(run: Path, reference: Path) -> None:
    import torch

    losses = [r["loss"] for r in read_metrics(run)]
    ref_losses = [r["loss"] for r in read_metrics(reference)]
    assert [r["step"] for r in read_metrics(run)] == list(range(1, len(ref_losses) + 1))
    assert losses == ref_losses  # bitwise: float equality of every step's loss
    a, b = final_state(run), final_state(reference)
    assert a.keys() == b.keys() and len(a) > 10
    different = [k for k in a if a[k].shape != b[k].shape or not torch.equal(a[k], b[k])]
    assert not different, different[:5]


def status(run_dir: Path) -> dict:
    """The run's status record; a run whose job has not started yet has none (pending)."""
    from launcher.run.rundir import RunDir

    return RunDir(run_dir).status().to_json()


def restarts(run_dir: Path) -> List[dict]:
    p = run_dir / "restarts.jsonl"
    return [json.loads(x) for x in p.read_text().splitlines()] if p.exists() else []


def last_step(run_dir: Path) -> int:
    try:
        rows = read_metrics(run_dir)
    except (FileNotFoundError, json.JSONDecodeError):
        return 0
    return rows[-1]["step"] if rows else 0


def wait_for(what, cond, timeout: float, poll: float = 0.5):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"timed out waiting for {what}")


def only_run(runs_root: Path) -> Path:
    (run,) = runs_json(runs_root)
    return Path(run["dir"])


def _proc_status(pid: int) -> Dict[str, str]:
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return {}
    return dict(line.split(":\t", 1) for line in text.splitlines() if ":\t" in line)


def stopped_rank(run: Path, rank: int = 1) -> Optional[int]:
    """The pid of the run's rank ``rank`` (this attempt's record) while it is stopped (train.fail_mode=stop
    has SIGSTOPped it: the local cluster's nodes are processes of this host), else None."""
    from launcher.run.rundir import RunDir

    for row in RunDir(run).ranks():
        if row.get("rank") == rank and _proc_status(int(row["pid"])).get("State", "").startswith("T"):
            return int(row["pid"])
    return None


def signal_pending(pid: int, signum: int) -> bool:
    """``signum`` waits for the (stopped) process: delivered once it continues."""
    st = _proc_status(pid)
    mask = int(st.get("ShdPnd", "0"), 16) | int(st.get("SigPnd", "0"), 16)
    return bool(mask >> (signum - 1) & 1)


class Hold:
    """A stop hold of rank 1 (train.fail_mode=stop, or a train.faults entry): ``held(run)`` is whether
    this attempt's rank 1 is stopped, and notes its pid; ``release(run)`` continues that process once
    ``signum`` waits for it. Slurm's requeue and cancel send SIGCONT before their TERM, so by then the
    rank may be running already: nothing to release (the pid noted while it was held, never read again
    from a rank record that the next attempt may have replaced)."""

    def __init__(self, signum: int = signal.SIGUSR2) -> None:
        self.signum, self.pid = signum, None

    def held(self, run: Path) -> bool:
        self.pid = stopped_rank(run)
        return self.pid is not None

    def release(self, run: Path) -> None:
        pid, name = self.pid, signal.Signals(self.signum).name
        assert pid is not None, f"rank 1 of {run} was never seen held"
        wait_for(f"{name} pending on the stopped rank 1 (pid {pid}), or the rank continued",
                 lambda: signal_pending(pid, self.signum) or not _proc_status(pid).get("State", "").startswith("T"),
                 60, poll=0.1)
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:  # ended with its job
            pass


# ---- real Slurm: requeue and time-limit signal, every engine -------------------------------------

# DDP on 2 nodes preempted twice: test_user_recipe.py's drill (the same public step loop, a user's DDP);
# FSDP2, ZeRO-2 and ZeRO-3 requeued mid-step on 2 nodes: test_any_model_slurm.py; here the engine whose
# state is split most ways (tensor and pipeline parallel, 4 processes), through both stops
ENGINES = {
    "megatron_tp2_pp2": ["cluster.nodes=1", "cluster.gpus_per_node=4", "parallelism.tp=2", "parallelism.pp=2"],
}


@pytest.mark.slurm
@pytest.mark.timeout(600)
@pytest.mark.parametrize("engine", list(ENGINES))
def test_preempted_twice_on_slurm_ends_bitwise_identical(slurm, tmp_path, engine):
    seed = int(os.environ.get("FT_SEED", time.time_ns() % 10_000))
    rng = random.Random(seed)
    print(f"FT_SEED={seed}")
    # the requeue once attempt 1 logged a random step k1, the time-limit signal once attempt 2 logged k2:
    # each attempt held in the step after (rank 1 stopped there: a train.faults entry of mode stop on
    # each attempt) until its signal reaches it, so every signal finds the job running however fast the
    # machine. A periodic checkpoint every 10 steps (each signal saves at its own step boundary; the
    # periodic ones only serve a TERM the requeue's KillWait cut short): half the sharded saves of every 5
    k1 = rng.randint(3, 8)
    k2 = rng.randint(12, 26)
    cfg = ["cluster=local_slurm", *ENGINES[engine], "train.steps=30", "train.checkpoint.every=10", *QUICK]
    hold = [f"train.faults=[{{at_step:{k1 + 1},rank:1,mode:stop,attempt:1}},"
            f"{{at_step:{k2 + 1},rank:1,mode:stop,attempt:2}}]"]
    roots = {k: tmp_path / k for k in ("interrupted", "reference")}
    for name, root in roots.items():  # both jobs queue at once; Slurm runs them side by side
        res = launch([*cfg, *(hold if name == "interrupted" else [])], root, extra_env=slurm)
        assert res.returncode == 0, res.stdout + res.stderr
    run, ref = only_run(roots["interrupted"]), only_run(roots["reference"])
    first, second = Hold(signal.SIGTERM), Hold(signal.SIGUSR2)
    try:
        preempt_twice_and_check(run, ref, slurm, k1, k2, held=second.held, release=second.release,
                                held_first=first.held, release_first=first.release)
    except BaseException:  # a held rank is never left stopped in the queue: it would hold its node
        cancel_jobs([run, ref], slurm)
        raise
    assert_identical(run, ref)


def cancel_jobs(runs: List[Path], slurm: Dict[str, str]) -> None:
    """scancel the runs' jobs (a drill that failed): a stopped rank ends with its job, not at its time limit."""
    ids = [json.loads((r / "job.json").read_text())["job_id"] for r in runs if (r / "job.json").exists()]
    if ids:
        subprocess.run(["scancel", *ids], check=False, env={**os.environ, **slurm}, timeout=60)


def preempt_twice_and_check(run: Path, ref: Path, slurm: Dict[str, str], k1: int, k2: int,
                            held: Callable[[Path], bool] = lambda run: True,
                            release: Callable[[Path], None] = lambda run: None,
                            held_first: Callable[[Path], bool] = lambda run: True,
                            release_first: Callable[[Path], None] = lambda run: None) -> None:
    """``scontrol requeue`` once attempt 1 logged step k1 and is held in the next, the time-limit signal
    (USR2) once attempt 2, resumed before k2, logged step k2 and is held in the next (``held_first``,
    ``held``: each hold is in place; ``release_first``, ``release``: what each hold needs after its
    signal); both runs completed, the restarts recorded."""
    job_id = json.loads((run / "job.json").read_text())["job_id"]
    wait_for(f"attempt 1 held in step {k1 + 1}", lambda: last_step(run) >= k1 and held_first(run), 300)
    subprocess.run(["scontrol", "requeue", job_id], check=True, env={**os.environ, **slurm})
    release_first(run)
    wait_for("attempt 2", lambda: status(run).get("attempt") == 2 and status(run)["status"] == "running", 240)
    resumed = restarts(run)[0]["from_step"]
    assert resumed <= k2, f"attempt 2 resumed after step {resumed}, past its hold in step {k2 + 1}: {restarts(run)}"
    wait_for(f"attempt 2 held in step {k2 + 1}", lambda: last_step(run) >= k2 and held(run), 300)
    subprocess.run(["scancel", "--signal=USR2", job_id], check=True, env={**os.environ, **slurm})
    release(run)
    wait_for("the end", lambda: status(run)["status"] in ("completed", "failed", "timeout"), 400, poll=1)
    wait_for("the reference", lambda: status(ref)["status"] in ("completed", "failed"), 300, poll=1)

    assert status(run)["status"] == "completed", status(run)
    assert status(ref)["status"] == "completed", status(ref)
    rows = restarts(run)
    assert [r["attempt"] for r in rows] == [2, 3]
    # TERM from `scontrol requeue` is caught and saved at a step boundary when Slurm's KillWait allows
    assert rows[0]["reason"] in ("preempted", "scheduler") and rows[1]["reason"] == "time_limit", rows
    assert rows[1]["from_step"] == rows[1]["failed_step"] >= k2  # saved at the boundary after the signal
    assert all(r["nodes"] and r["job_id"] == job_id for r in rows)
    # wandb on (the default) through both stops: one wandb run, every step in its offline files
    assert_one_wandb_run(run, len(read_metrics(ref)))


def slurm_job(job_id: str, env: Dict[str, str]) -> Dict[str, str]:
    """slurmctld's record of a job (``scontrol show job -o``), as fields; {}: it has none."""
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True,
                         env={**os.environ, **env}).stdout
    return dict(f.split("=", 1) for f in out.split() if "=" in f)


@pytest.mark.slurm
@pytest.mark.timeout(420)
def test_a_cancel_ends_the_run_cancelled_and_requeues_nothing(slurm, tmp_path):
    """``scancel JOB`` of a running GPT on 2 nodes, and ``launcher cancel RUN`` of another, with the
    defaults on (wandb included): a cancel is not a preemption. Each run ends ``cancelled`` at attempt 1
    with nothing restarted, and slurmctld holds its job CANCELLED (final: Slurm never starts it again),
    none of it in the queue."""
    cfg = ["cluster=local_slurm", "cluster.nodes=2", "cluster.gpus_per_node=1", "train.steps=100000",
           "train.checkpoint.every=5", *QUICK]
    roots = {k: tmp_path / k for k in ("scancel", "launcher_cancel")}
    for root in roots.values():  # both queue at once and run side by side (2 + 2 nodes)
        res = launch(cfg, root, extra_env=slurm)
        assert res.returncode == 0, res.stdout + res.stderr
    runs = {k: only_run(root) for k, root in roots.items()}
    for run in runs.values():
        wait_for(f"step 3 of {run}", lambda run=run: last_step(run) >= 3, 300)
    jobs = {k: json.loads((run / "job.json").read_text())["job_id"] for k, run in runs.items()}
    subprocess.run(["scancel", jobs["scancel"]], check=True, env={**os.environ, **slurm})
    mine = runs["launcher_cancel"]
    res = run_cmd([str(BIN / "launcher"), "cancel", f"{mine.parent.name}-{mine.name}", "--root",
                   str(roots["launcher_cancel"])], roots["launcher_cancel"], extra_env=slurm)
    assert res.returncode == 0 and "cancelled 1 run(s)" in res.stdout, res.stdout + res.stderr
    for k, run in runs.items():
        wait_for(f"{k}'s end", lambda run=run: status(run)["status"] in ("completed", "failed", "cancelled"), 240)
        st = status(run)
        assert st["status"] == "cancelled" and st["attempt"] == 1, st
        assert restarts(run) == [], restarts(run)
        # the job has ended in slurmctld's own record, as CANCELLED, and nothing of it is queued
        wait_for(f"{k}'s job ended", lambda k=k: slurm_job(jobs[k], slurm).get("JobState") in ("CANCELLED", None)
                 or not slurm_job(jobs[k], slurm), 120)
        job = slurm_job(jobs[k], slurm)
        assert not job or (job["JobState"] == "CANCELLED" and job["Restarts"] == "0"), job
        queued = subprocess.run(["squeue", "-h", "-j", jobs[k]], capture_output=True, text=True,
                                env={**os.environ, **slurm}).stdout
        assert queued.strip() == "", queued
    st = status(runs["scancel"])  # the rank's word, asked of the scheduler: a cancel, after a saved step
    assert st["stop"]["scheduler"] == "cancelled" and "scancel" in st["error"], st


# ---- real Slurm: failures the way NCCL makes them, decided outside the ranks ---------------------
# Two ranks on two nodes; all five jobs queue at once and run side by side. Each drill's fault fires on
# attempt 1 only; the run must requeue and end bitwise equal to the uninterrupted reference.
DRILL = ["cluster=local_slurm", "cluster.nodes=2", "cluster.gpus_per_node=1", "train.steps=20",
         "train.checkpoint.every=4", "train.dist_timeout_s=60", *QUICK]
# the checkpoint after step 4 written before step 5 (an async one may still be in flight at step 6 on a
# loaded machine, and the restart would rightly begin at 0): the drills resume from step 4 every time
FAULT = ["train.fail_at_step=6", "train.fail_rank=1", "train.fail_attempt=1", "train.checkpoint.async_save=false"]
DRILLS = {
    # a node Slurm loses (set DOWN under the job): its own nodes (exclusive), so no other drill is hit;
    # held in step 6 on attempt 1 (rank 1 sleeps there, its peer waits in the collective), so the node goes
    # DOWN under a training job however fast the machine (its 20 steps took 2 s on one: it had ended before)
    "down": ["cluster.exclusive=true", *FAULT, "train.fail_mode=sleep"],
    # a wedged rank: stopped, its sockets open, its peer blocked in the collective; no setting but the
    # multi-node default hang watch (half of train.dist_timeout_s) ends it
    "stop": [*FAULT, "train.fail_mode=stop"],
    # a rank SIGKILLed and its peer aborting in C++ as ProcessGroupNCCL does: no rank says a word
    "kill_abort": [*FAULT, "train.fail_mode=kill", "train.fail_peers=abort"],
    # a failure no restart fixes, the peer aborting: fails at once, nothing requeued
    "deterministic": ["train.fail_at_step=3", "train.fail_rank=1", "train.fail_mode=config_error",
                      "train.fail_peers=abort"],
    "reference": [],
}


def slurm_nodes(job_id: str, env: Dict[str, str]) -> List[str]:
    node = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%N"], capture_output=True, text=True,
                          env=env).stdout.strip()
    return subprocess.run(["scontrol", "show", "hostnames", node], capture_output=True, text=True,
                          env=env).stdout.split() if node else []


def job_state(job_id: str, env: Dict[str, str]) -> str:
    return subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True,
                          env=env).stdout.strip()


@pytest.mark.slurm
@pytest.mark.slurm_whole
@pytest.mark.timeout(900)
def test_failures_as_nccl_makes_them_requeue_from_outside_the_ranks(slurm, tmp_path):
    """A node set DOWN, a SIGSTOPped rank, a SIGKILLed rank whose peer aborts (no Python handler runs):
    each requeued (by Slurm, the hang watch, the batch script's teardown) and bitwise equal to the
    reference; a deterministic failure fails at once."""
    env = {**os.environ, **slurm}
    t0 = {name: time.time() for name in DRILLS}
    launched: Dict[str, subprocess.CompletedProcess] = {}

    def submit(name: str) -> None:
        launched[name] = launch([*DRILL, *DRILLS[name]], tmp_path / name, extra_env=slurm)

    # "down" first and alone, so that it is watched from its first step (its 20 steps take seconds on a
    # fast machine: launched among the others it could end before anyone looked); the others side by
    # side (a launch takes seconds of CPU), watched while they are launched
    submit("down")
    threads = [threading.Thread(target=submit, args=(name,)) for name in DRILLS if name != "down"]
    for t in threads:
        t.start()
    runs: Dict[str, Path] = {}
    jobs: Dict[str, str] = {}
    took: Dict[str, float] = {}
    lost, resumed = None, False
    deadline = time.time() + 840
    try:
        while len(took) < len(DRILLS) and time.time() < deadline:
            for name, res in list(launched.items()):
                if name not in runs:
                    assert res.returncode == 0, res.stdout + res.stderr
                    runs[name] = only_run(tmp_path / name)
                    jobs[name] = json.loads((runs[name] / "job.json").read_text())["job_id"]
            for name, run in runs.items():
                if name not in took and status(run).get("status") in ("completed", "failed", "cancelled", "timeout"):
                    took[name] = round(time.time() - t0[name], 1)
            down = runs.get("down")
            # down once it is held in step 6 (its checkpoint after step 4 committed): it restarts from there
            # and must end bitwise the same; the hang watch (30 s) would come long after
            nodes = (slurm_nodes(jobs["down"], env) if down and lost is None and status(down).get("attempt") == 1
                     and last_step(down) >= 5 else [])
            if nodes:  # (squeue may list no node for a moment: asked again next round)
                lost = nodes[-1]
                subprocess.run(["scontrol", "update", f"nodename={lost}", "state=down",
                                "reason=fault-tolerance-test"], check=True, env=env)
            if lost and not resumed and job_state(jobs["down"], env) != "RUNNING":  # requeued off it
                subprocess.run(["scontrol", "update", f"nodename={lost}", "state=resume"], check=False, env=env)
                resumed = True
            time.sleep(0.5)
    finally:
        if lost and not resumed:
            subprocess.run(["scontrol", "update", f"nodename={lost}", "state=resume"], check=False, env=env)
        for t in threads:
            t.join(timeout=120)
    print("drill seconds (launch to outcome):", took)
    assert set(took) == set(DRILLS), (took, {k: status(r) for k, r in runs.items()})
    for name in ("reference", "down", "stop", "kill_abort"):
        assert status(runs[name])["status"] == "completed", (name, status(runs[name]))

    (row,) = restarts(runs["down"])  # Slurm requeued the job itself (NODE_FAIL; its TERM may be caught)
    assert row["reason"] in ("preempted", "scheduler") and lost in row["nodes"] and row["from_step"] == 4, row
    # the node Slurm lost under it, from Slurm's own records (the NODE_FAIL run, the node's down event),
    # in the ledger against the attempt that ran on it
    seen = [json.loads(p.read_text()) for p in (tmp_path / "down" / "nodes" / "events").glob("*.json")]
    assert [(e["node"], e["attempt"]) for e in seen if e["kind"] == "lost"] == [(lost, 1)], seen
    assert "fault-tolerance-test" in next(e["detail"] for e in seen if e["kind"] == "lost"), seen
    (row,) = restarts(runs["stop"])  # the multi-node default hang watch of the rank still running
    assert row["reason"] == "hang" and row["from_step"] == 4 and "rank 1 stuck" in row["detail"], row
    # the collective the stopped rank never joined, by the sequence number the waiting rank recorded
    assert "rank(s) 1 never joined collective #" in row["detail"] and "of process group world" in row["detail"], row
    # the node ledger (its runs root's): the stopped rank's node, the collective the others waited in; the
    # requeue left that node out, and doctor names it
    (ev,) = [json.loads(p.read_text()) for p in (tmp_path / "stop" / "nodes" / "events").glob("*.json")]
    assert (ev["kind"], ev["rank"]) == ("hang", 1) and ev["step"] >= 4 and "left no stack" in ev["detail"], ev
    assert "the others waited in collective #" in ev["detail"] and row["excluded"] == [ev["node"]], (ev, row)
    doc = subprocess.run([str(BIN / "launcher"), "doctor", str(runs["stop"]), "--json"], capture_output=True,
                         text=True, env={**env, "LAUNCHER_RUNS": str(tmp_path / "stop")}, timeout=120)
    assert f"node {ev['node']}: hang in this run" in doc.stdout, doc.stdout + doc.stderr
    assert "waited in collective #" in doc.stdout, doc.stdout  # the collective it never joined, by number
    (row,) = restarts(runs["kill_abort"])  # nobody recorded a word: the batch script's teardown decided
    assert row["reason"] == "failure" and row["from_step"] == 4, row
    assert row["detail"].startswith("a rank died without a word: srun exit "), row
    assert row["failure"]["kind"] == "rank_lost" and row["job_id"] == jobs["kill_abort"], row
    # srun's word on the killed rank (not on its peer, which aborted as NCCL's teardown does): its node in
    # the ledger, left out of the requeue
    (crash,) = [json.loads(p.read_text()) for p in (tmp_path / "kill_abort" / "nodes" / "events").glob("*.json")]
    assert (crash["kind"], crash["rank"]) == ("crashed", 1) and "Killed" in crash["detail"], crash
    assert row["excluded"] == [crash["node"]], (row, crash)
    # no rank's word anywhere (errors/, or attempt 1's moved aside to attempts/1/)
    assert not list(runs["kill_abort"].rglob("rank_*.error")), list(runs["kill_abort"].rglob("rank_*.error"))
    for name in ("down", "stop", "kill_abort"):
        assert_identical(runs[name], runs["reference"])

    st = status(runs["deterministic"])  # failed at once: attempt 1, nothing requeued
    assert st["status"] == "failed" and st["attempt"] == 1 and restarts(runs["deterministic"]) == [], st
    assert "injected config error" in st["error"] and st["no_restart"]["kind"] == "config", st


@pytest.mark.timeout(300)
def test_a_multi_node_launch_without_periodic_checkpoints_is_warned(tmp_path):
    # a dry run submits nothing: it needs no share of the cluster (it reads its limits where one is up)
    res = launch([*DRILL, "train.checkpoint.every=0", "submit.dry_run=true"], tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "launch: warning: cluster.nodes=2 with train.checkpoint.every=0" in res.stderr, res.stderr


# ---- local: a killed rank, a kill while saving, a hang, the budget, resume -----------------------

LOCAL = ["cluster.gpus_per_node=2", "train.steps=12", "train.checkpoint.every=3", *QUICK]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("reference")
    res = launch(LOCAL, root, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    return only_run(root)


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_killed_rank_whose_peer_aborts_requeues_and_finishes_identical(runs_root, reference):
    """A SIGKILLed rank, its peer aborting as ProcessGroupNCCL does: no rank says a word, and the job's
    controller (not a rank) starts them again."""
    res = launch([*LOCAL, "train.fail_at_step=8", "train.fail_rank=1", "train.fail_mode=kill",
                  "train.fail_attempt=1", "train.fail_peers=abort",
                  # step 6's checkpoint committed before step 8's kill (async, it may still be in flight)
                  "train.checkpoint.async_save=false"], runs_root, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    run = only_run(runs_root)
    (row,) = restarts(run)
    assert row["attempt"] == 2 and row["reason"] == "failure" and row["from_step"] == 6, row
    assert row["detail"] == "a rank died without a word: the processes' exit 137 (SIGKILL)", row
    assert row["nodes"] and row["time"] and row["failure"]["kind"] == "rank_lost"
    assert not list((run / "attempts" / "1" / "ranks").glob("rank_*.error"))  # no rank's word
    assert status(run)["attempt"] == 2 and status(run)["summary"]["resumed_from"] == 6
    assert_identical(run, reference)


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_restart_budget_ends_a_run_that_always_fails(runs_root):
    # one process: the budget is counted by the job's controller per attempt, whatever the world size
    # (a peer's part in a failure: the killed-rank and hang drills above and below). The process is
    # killed in step 2 of every attempt: a death, not an exception, is restarted however often it
    # repeats (an exception repeated in the same step ends the run at once: tests/unit/test_restart_policy.py)
    res = launch([*LOCAL, "cluster.gpus_per_node=1", "train.fail_at_step=2", "train.fail_rank=0",
                  "train.fail_mode=kill", "train.max_restarts=2"], runs_root, timeout=300)  # a budget of 2, spent
    assert res.returncode == 1
    run = only_run(runs_root)
    st = status(run)
    assert st["status"] == "failed" and "SIGKILL" in st["error"], st
    assert [r["attempt"] for r in restarts(run)] == [2, 3]  # two restarts, then the budget is spent
    assert st["attempt"] == 3


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_hang_watchdog_names_the_sleeping_rank(runs_root):
    t0 = time.time()
    res = launch([*LOCAL, "train.fail_at_step=5", "train.fail_rank=1", "train.fail_mode=sleep",
                  # no restart: the hang's report is the outcome
                  "train.hang_timeout_s=6", "train.dist_timeout_s=120", "train.max_restarts=0"], runs_root,
                 timeout=300)
    elapsed = time.time() - t0
    assert res.returncode == 1
    run = only_run(runs_root)
    hang = json.loads((run / "hang.json").read_text())
    assert hang["stuck_ranks"] == [1] and hang["step"] == 4
    assert set(hang["waiting"]) == {"0"}, hang  # rank 0 waits for it inside a collective
    assert "faults.py" in hang["frames"]["1"] and "inject_fault" in hang["frames"]["1"]
    assert "inject_fault" in (run / "stacks" / "rank_1.txt").read_text()
    st = status(run)
    assert st["status"] == "failed" and "hang" in st["error"] and "rank 1 stuck" in st["error"]
    assert elapsed < 120  # fired within the timeout, long before the collective timeout (120 s)
    res = run_cmd([str(BIN / "launcher"), "doctor", str(run), "--json"], runs_root, timeout=120)
    diagnosis = json.loads(res.stdout)
    assert diagnosis["kind"] == "hang" and diagnosis["rank"] == 1, diagnosis
    assert "hang_timeout_s" in diagnosis["fix"] or "stack" in diagnosis["fix"], diagnosis


@pytest.mark.dist
@pytest.mark.timeout(400)
def test_resume_continues_a_failed_run_identically(runs_root, reference):
    """A rank killed while it writes step 9's checkpoint (no restart allowed: the run fails), then
    `launcher resume`: the half-written checkpoint is never used (from step 6, the one before) and is
    cleared, and the run ends bitwise where the uninterrupted one does. (The killed-rank drill above
    restarts inside the job; here the next attempt is the user's.)"""
    res = launch([*LOCAL, "train.fail_at_step=9", "train.fail_rank=1", "train.fail_mode=kill_in_save",
                  # no restart: the next attempt is the user's launcher resume
                  "train.max_restarts=0", "train.fail_attempt=1"], runs_root, timeout=300)
    assert res.returncode == 1, res.stdout + res.stderr
    run = only_run(runs_root)
    assert status(run)["status"] == "failed" and (run / "manifest.json").exists()
    assert list((run / "checkpoints").glob(".*partial"))  # step 9's, half-written when its rank died
    assert (run / "checkpoints" / "latest").read_text().strip().endswith("6")
    res = run_cmd([str(BIN / "launcher"), "resume", str(run)], runs_root, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "from step 6" in res.stdout  # step 9's checkpoint was never completed
    assert not list((run / "checkpoints").glob(".*partial"))  # the next attempt cleared the half-written one
    st = status(run)
    assert st["status"] == "completed" and st["attempt"] == 2
    assert st["earlier"][0]["status"] == "failed"
    (row,) = restarts(run)
    assert row["reason"] == "resume" and row["from_step"] == 6
    assert (run / "attempts" / "1" / "manifest.json").exists()  # the first attempt's seal, kept
    assert run_cmd([str(BIN / "launcher"), "show", str(run)], runs_root).returncode == 0
    assert_identical(run, reference)

    # a reproduction of the interrupted run gives the same losses
    res = run_cmd([str(BIN / "launcher"), "reproduce", str(run), "train.fail_at_step=null"], runs_root, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    repro = [Path(r["dir"]) for r in runs_json(runs_root) if Path(r["dir"]) != run]
    assert [r["loss"] for r in read_metrics(repro[0])] == [r["loss"] for r in read_metrics(reference)]

    # a completed run resumes only to train further
    res = run_cmd([str(BIN / "launcher"), "resume", str(run)], runs_root, timeout=60)
    assert res.returncode == 2 and "--steps" in res.stderr
    res = run_cmd([str(BIN / "launcher"), "resume", str(run), "--steps", "15"], runs_root, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert [r["step"] for r in read_metrics(run)] == list(range(1, 16))
    assert restarts(run)[-1]["detail"].endswith("train.steps 12 -> 15")
