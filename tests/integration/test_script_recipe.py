"""recipe=script: an unchanged torchrun-style script (it reads torchrun's variables, makes and
destroys its own process group, saves to and resumes from the checkpoint dir it is given) runs on
cluster=local and on 2 Slurm nodes, resumes after a USR2 requeue, fails with its own exit code, and
gives the losses plain `torchrun --nproc_per_node=2` gives. Also the checks and the signal forwarding
that need a process of their own."""
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from test_fault_tolerance import last_step, only_run, restarts, status, wait_for

from helpers import BIN, launch, read_metrics, run_cmd, runs_json
from launcher import script_recipe
from launcher.rundir import RunDir
from launcher.runtime.script import Forwarder

STEPS = 30
# the script as a user writes it for torchrun: nothing in it knows the launcher (the LAUNCHER_* paths
# are read where set, as a script reads any optional environment)
SCRIPT = r'''"""An ordinary torchrun-style training script: it knows nothing of the launcher."""
import argparse
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=12)
parser.add_argument("--ckpt-dir", default="ckpt")
parser.add_argument("--metrics", default="metrics.jsonl")
parser.add_argument("--exit-code", type=int, default=0)
parser.add_argument("--step-sleep", type=float, default=0.0)  # seconds after each step of the first attempt
parser.add_argument("--save-every", type=int, default=0)
parser.add_argument("--kill-step", type=int, default=0)  # rank 1 dies (SIGKILL) there, in its first attempt
args = parser.parse_args()

rank, world, local_rank = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) + 1
names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
         "TORCHELASTIC_RESTART_COUNT", "LAUNCHER_ATTEMPT", "LAUNCHER_RUN_DIR", "LAUNCHER_CHECKPOINT_DIR",
         "LAUNCHER_METRICS_FILE")
with open(f"env_rank{rank}_attempt{attempt}.json", "w") as f:
    json.dump({"env": {k: os.environ.get(k) for k in names}, "cwd": os.getcwd(), "argv": sys.argv}, f)

stop = {"flag": 0}
signal.signal(signal.SIGUSR2, lambda *a: stop.update(flag=1))
signal.signal(signal.SIGTERM, lambda *a: stop.update(flag=1))

dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
ddp = DDP(model)
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
ckpt_dir = os.environ.get("LAUNCHER_CHECKPOINT_DIR") or args.ckpt_dir
metrics = os.environ.get("LAUNCHER_METRICS_FILE") or args.metrics
os.makedirs(ckpt_dir, exist_ok=True)
path = os.path.join(ckpt_dir, "ckpt.pt")
start = 0
if os.path.exists(path):
    state = torch.load(path)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    start = state["step"]
    print(f"rank {rank}: resumed from step {start}", flush=True)


def save(step):
    if rank == 0:
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, path + ".tmp")
        os.replace(path + ".tmp", path)
    dist.barrier()


for step in range(start + 1, args.steps + 1):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(16, 8, generator=g)
    loss = F.mse_loss(ddp(x), x.sum(1, keepdim=True).sin())
    opt.zero_grad()
    loss.backward()
    opt.step()
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    if rank == 0:
        with open(metrics, "a") as f:
            f.write(json.dumps({"step": step, "loss": mean.item() / world}) + "\n")
    if attempt == 1:
        time.sleep(args.step_sleep)
    if args.save_every and step % args.save_every == 0:
        save(step)
    if step == args.kill_step and rank == 1 and attempt == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    flag = torch.tensor([stop["flag"]])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item():
        save(step)
        print(f"rank {rank}: signalled, saved at step {step}", flush=True)
        dist.destroy_process_group()
        sys.exit(0)
save(args.steps)
dist.destroy_process_group()
sys.exit(args.exit_code)
'''
RUN = ["recipe=script", "recipe.script=train.py", "wandb.enabled=false", "train.log_interval=0"]



@pytest.fixture(scope="module")
def code(tmp_path_factory) -> Path:
    """The user's project: one script, not in git (the snapshot is the launch dir)."""
    d = tmp_path_factory.mktemp("project")
    (d / "train.py").write_text(SCRIPT)
    (d / "mypkg").mkdir()
    (d / "mypkg" / "__init__.py").write_text("")
    (d / "mypkg" / "train.py").write_text(SCRIPT)  # the same script, for `python -m mypkg.train`
    return d


def args(*extra: str) -> str:
    return "recipe.args=[" + ",".join(["--steps", str(STEPS), *extra]) + "]"


def envs(run: Path, attempt: int):
    """What each rank's script saw (it writes it to its working dir)."""
    return [json.loads((run / "work" / f"env_rank{r}_attempt{attempt}.json").read_text()) for r in range(2)]


def losses(rows):
    return [(r["step"], r["loss"]) for r in rows]


@pytest.fixture(scope="module")
def local_run(code, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("local") / "runs"
    res = launch([*RUN, args(), "cluster=local", "cluster.gpus_per_node=2"], root, timeout=400, cwd=code)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return only_run(root)


@pytest.mark.timeout(600)
def test_an_unchanged_script_runs_on_cluster_local(local_run):
    st = status(local_run)
    assert st["status"] == "completed" and st["exit_code"] == 0 and st["attempt"] == 1, st
    rows = read_metrics(local_run)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert st["summary"]["final_loss"] == rows[-1]["loss"] and st["summary"]["steps"] == STEPS
    seen = envs(local_run, 1)
    for r, e in enumerate(seen):
        env = e["env"]
        assert {k: env[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                                    "TORCHELASTIC_RESTART_COUNT", "LAUNCHER_ATTEMPT")} == {
            "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0",
            "TORCHELASTIC_RESTART_COUNT": "0", "LAUNCHER_ATTEMPT": "1"}
        assert env["MASTER_ADDR"] and env["MASTER_PORT"].isdigit()
        assert Path(e["cwd"]) == local_run / "work"  # the run's own working dir
        assert Path(e["argv"][0]) == local_run.parent / "code" / "train.py"  # the code snapshot's copy
        assert env["LAUNCHER_CHECKPOINT_DIR"] == str(local_run / "checkpoints" / "script")
    assert seen[0]["env"]["MASTER_PORT"] == seen[1]["env"]["MASTER_PORT"]
    assert (local_run / "checkpoints" / "script" / "ckpt.pt").is_file()


@pytest.mark.timeout(600)
def test_the_scripts_exit_code_fails_the_run_with_it(code, runs_root):
    res = launch([*RUN, "recipe.args=[--steps,3,--exit-code,3]", "cluster=local", "cluster.gpus_per_node=2",
                  "train.max_restarts=2"], runs_root, timeout=400, cwd=code)
    assert res.returncode != 0, res.stdout[-2000:]
    run = only_run(runs_root)
    st = status(run)
    assert (st["status"], st["exit_code"], st["error"], st["attempt"]) == ("failed", 3, "script exited 3", 1), st
    assert restarts(run) == []  # the script said so: not retried, although the budget allows 2
    assert "script exited 3" in res.stdout + res.stderr
    doctor = run_cmd([str(BIN / "launcher"), "doctor", str(run)], runs_root, timeout=120)
    assert "script exited 3" in doctor.stdout and "launcher logs RUN --rank" in doctor.stdout, doctor.stdout


@pytest.mark.timeout(600)
def test_a_reproduction_runs_the_snapshots_script_from_any_dir(local_run, tmp_path):
    root = local_run.parent.parent
    res = run_cmd([str(BIN / "launcher"), "reproduce", RunDir(local_run).run_id, "--root", str(root)], root,
                  timeout=400, cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    (copy,) = [Path(r["dir"]) for r in runs_json(root) if Path(r["dir"]) != local_run]
    assert status(copy)["status"] == "completed", status(copy)
    assert losses(read_metrics(copy)) == losses(read_metrics(local_run))


@pytest.mark.timeout(600)
def test_a_killed_script_is_requeued_and_resumes_in_the_module_form(code, local_run, runs_root):
    """`python -m mypkg.train` (recipe.module: the snapshot's copy of the package) with rank 1 SIGKILLed at
    step 8 of its first attempt: requeued, it resumes from the script's own checkpoint (step 5), and
    both attempts give the losses of the uninterrupted recipe.script run. (One run for the module form
    and the kill: each made its own.)"""
    res = launch(["recipe=script", "recipe.module=mypkg.train", args("--save-every", "5", "--kill-step", "8"),
                  "wandb.enabled=false", "train.log_interval=0", "cluster=local", "cluster.gpus_per_node=2",
                  "train.max_restarts=1"], runs_root, timeout=400, cwd=code)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    run = only_run(runs_root)
    for attempt in (1, 2):  # the module from the code snapshot, not from the launch dir
        assert Path(envs(run, attempt)[0]["argv"][0]) == run.parent / "code" / "mypkg" / "train.py"
    st = status(run)
    assert st["status"] == "completed" and st["attempt"] == 2, st
    (row,) = restarts(run)
    assert row["reason"] == "failure" and "killed by SIGKILL" in row["detail"], row
    rows = read_metrics(run)
    last = {r["step"]: r for r in rows}  # steps 6..8 ran twice: before the kill and after the resume
    assert [r["step"] for r in rows if r["step"] <= 8] == [1, 2, 3, 4, 5, 6, 7, 8, 6, 7, 8]
    reference = losses(read_metrics(local_run))
    assert losses(rows[:8]) == reference[:8]  # the first attempt, up to the kill
    assert losses(last.values()) == reference  # the second from step 6 on


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(600)
def test_plain_torchrun_gives_the_same_losses(code, local_run, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("LAUNCHER_")}
    env.update(OMP_NUM_THREADS="1")
    res = subprocess.run([str(BIN / "torchrun"), "--nproc_per_node=2", f"--master_port={_free_port()}",
                          str(code / "train.py"), "--steps", str(STEPS), "--metrics", str(tmp_path / "m.jsonl"),
                          "--ckpt-dir", str(tmp_path / "ckpt")], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=400)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert losses(rows) == losses(read_metrics(local_run))


@pytest.mark.slurm
@pytest.mark.timeout(900)
def test_a_usr2_drill_on_two_slurm_nodes_requeues_and_resumes(slurm, code, local_run, runs_root):
    res = launch([*RUN, args("--step-sleep", "0.4"), "cluster=local_slurm", "cluster.nodes=2",
                  "cluster.gpus_per_node=1"], runs_root, timeout=300, cwd=code, extra_env=slurm)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    run = only_run(runs_root)
    job_id = json.loads((run / "job.json").read_text())["job_id"]
    wait_for("step 4", lambda: last_step(run) >= 4, 400)
    subprocess.run(["scancel", "--signal=USR2", job_id], check=True, env={**os.environ, **slurm}, timeout=60)
    wait_for("the end", lambda: status(run)["status"] in ("completed", "failed", "timeout", "cancelled"), 600,
             poll=1)
    st = status(run)
    assert st["status"] == "completed" and st["attempt"] == 2, st
    (row,) = restarts(run)
    assert row["reason"] == "time_limit" and row["attempt"] == 2 and row["job_id"] == job_id, row
    saved = row["failed_step"]
    assert 4 <= saved < STEPS, row
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))  # resumed after the step it saved, once
    assert losses(rows) == losses(read_metrics(local_run))  # from its own checkpoint: the same losses
    first, second = envs(run, 1), envs(run, 2)
    assert {e["env"]["GROUP_RANK"] for e in first} == {"0", "1"}  # one rank on each node
    assert [e["env"]["TORCHELASTIC_RESTART_COUNT"] for e in second] == ["1", "1"]
    assert [e["env"]["LAUNCHER_ATTEMPT"] for e in second] == ["2", "2"]


# ---- the parts that need a process of their own ---------------------------------------------------

TARGET = script_recipe.SCRIPT_TARGET


def problem(recipe):
    t = {"recipe": {"_target_": TARGET, "script": None, "module": None, "args": [], **recipe}}
    found = script_recipe.problems(t)
    return (found[0][0], found[0][1], script_recipe.fix(t)) if found else None


@pytest.mark.timeout(120)
def _git(root, *args):
    subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True, timeout=60)


def test_paths_are_relative_to_the_repo_root_the_snapshot_is_taken_from(tmp_path, monkeypatch):
    _git(tmp_path, "init", "-q")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "train.py").write_text("print('hi')\n")
    (tmp_path / ".gitignore").write_text("ignored.py\n")
    (tmp_path / "ignored.py").write_text("print('hi')\n")
    monkeypatch.chdir(tmp_path / "sub")
    found = problem(dict(script="train.py"))  # from sub/: the job finds it as sub/train.py
    assert found[0] == "recipe.script" and "recipe.script=sub/train.py" in found[2], found
    assert problem(dict(script="sub/train.py")) is None
    found = problem(dict(script="ignored.py"))
    assert "not in the code snapshot" in found[1], found
    found = problem(dict(script=str(tmp_path / "sub" / "train.py")))
    assert "absolute" in found[1] and "recipe.script=sub/train.py" in found[2], found



@pytest.mark.timeout(120)
def test_stop_signals_are_forwarded_to_the_script():
    child = subprocess.Popen([sys.executable, "-c", "import signal, sys, time\n"
                              "signal.signal(signal.SIGUSR2, lambda *a: sys.exit(7))\n"
                              "print('ready', flush=True)\ntime.sleep(60)\n"], stdout=subprocess.PIPE, text=True)
    seen = []
    prev = signal.signal(signal.SIGUSR2, lambda *a: seen.append("recorded"))
    try:
        assert child.stdout.readline().strip() == "ready"
        fwd = Forwarder(child).install(None)
        try:
            os.kill(os.getpid(), signal.SIGUSR2)
            assert child.wait(timeout=30) == 7
        finally:
            fwd.restore()
        assert fwd.reason == "time_limit" and seen == ["recorded"]  # the handler before it ran too
    finally:
        signal.signal(signal.SIGUSR2, prev)
        if child.poll() is None:
            child.kill()
