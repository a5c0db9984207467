"""Test helpers: run the real `launch`/`launcher` commands and wait on real jobs."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
FINAL = ("completed", "failed", "cancelled", "timeout", "pruned")


def run_cmd(args: List[str], runs_root: Path, timeout: float = 300, extra_env: Optional[Dict[str, str]] = None,
            cwd: Optional[Path] = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, LAUNCHER_RUNS=str(runs_root), PYTHONUNBUFFERED="1")
    env.update(extra_env or {})
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=str(cwd or runs_root.parent))


def launch(overrides: List[str], runs_root: Path, timeout: float = 300, **kw) -> subprocess.CompletedProcess:
    return run_cmd([str(BIN / "launch"), *overrides], runs_root, timeout=timeout, **kw)


def runs_json(runs_root: Path) -> List[dict]:
    """What `launcher runs --json --root RUNS_ROOT` prints, read in this process as the command reads it
    (launches killed mid-way settled, then the index): a test finding the runs it made would otherwise
    start an interpreter each time (~0.4 s of CPU, ~240 times a suite). The command itself runs as a
    process in test_archive.py, test_backends_real.py, test_login_path.py and the README's tests."""
    from launcher.submit.interrupted import repair

    root = Path(runs_root).expanduser().resolve()
    for line in repair(root):
        print(f"launcher runs: {line}", file=sys.stderr)
    return listed(root)


def seal_pending(rdir: Path) -> bool:
    """A final run whose job left its seal due and whatever seals it has not yet (RunDir.seal_due)."""
    from launcher.run.rundir import RunDir

    return RunDir(rdir).seal_due()


def listed(runs_root: Path) -> List[dict]:
    """What `launcher runs --json` lists, read in this process: a poll once a second through the command
    would start an interpreter each time, taking CPU from the jobs the test waits for."""
    from launcher.archive import registry

    return json.loads(json.dumps(registry.list_runs(Path(runs_root))))


def wait_final(runs_root: Path, n: int, timeout: float = 300) -> List[dict]:
    """Poll the runs (``listed``) until n runs exist and all are final and sealed, then return what
    `launcher runs --json` says of them. A run whose job ended without recording its outcome, or whose
    seal is still due, is settled by `launcher status SWEEP` (listing runs never records or seals one)."""
    deadline = time.time() + timeout
    runs: List[dict] = []
    while time.time() < deadline:
        runs = listed(runs_root)
        # final, and sealed unless its seal is still due (a job's end seals it: docs/archive.md)
        if len(runs) >= n and all(r["status"] in FINAL and not seal_pending(Path(r["dir"])) for r in runs):
            return runs_json(runs_root)
        # settled, and sealed where the job's end could not (a batch script killed at its time limit):
        # the login side's refresh does both (launcher.run.outcome)
        for sweep in sorted({r["sweep_id"] for r in runs if (r.get("job_ended") and r["status"] not in FINAL)
                             or (r["status"] in FINAL and seal_pending(Path(r["dir"])))}):
            run_cmd([str(BIN / "launcher"), "status", sweep, "--json", "--root", str(runs_root)], runs_root,
                    timeout=120)
        time.sleep(1.0)
    raise AssertionError(f"runs not final after {timeout}s: {json.dumps(runs, indent=1)}")


def explain(run: dict, lines: int = 30) -> str:
    """A run's record and the end of each rank's stderr: what a failed assertion on its status shows
    (pytest cuts a dict's repr, and CI keeps nothing of the run dir)."""
    from launcher import backends
    from launcher.run.rundir import RunDir

    out = [json.dumps({k: v for k, v in run.items() if k not in ("summary", "config")}, default=str)]
    rd = RunDir(run["dir"])
    job = rd.job()
    if job:
        for rank in range(int(rd.status().world_size or 1)):
            path = backends.get(job.backend).log_path(job, rank, err=True)
            if path.exists():
                tail = path.read_text(errors="replace").splitlines()[-lines:]
                out += [f"--- rank {rank}: {path}", *tail]
    return "\n".join(out)


def read_metrics(run_dir: str) -> List[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]




# The reference for engine equivalence: gpt_tiny in fp32, no dropout, 8 micro-batches of 2 per
# step in one process, so every layout up to 8 ranks (and pp=2 with >= 4 micro-batches) divides it.
EQUIV_BASE = ["model=gpt_tiny", "precision=fp32", "train.steps=10", "train.global_batch_size=16",
              "train.micro_batch_size=2", "optim.lr=3e-3", "optim.warmup_steps=2", "seed=11",
              "train.log_interval=0", "cluster=local"]


def train_losses(overrides: List[str], runs_root: Path, procs: int, timeout: float = 300) -> List[float]:
    """Run a real local launch with `procs` processes; return the per-step loss trajectory."""
    res = launch([*EQUIV_BASE, f"cluster.gpus_per_node={procs}", *overrides], runs_root, timeout=timeout)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    run = runs_json(runs_root)[-1]
    assert run["status"] == "completed", run
    return [r["loss"] for r in read_metrics(run["dir"])]


def clone_worktree(dest: Path) -> Path:
    """A scratch clone of this repo with the working tree's current files (committed or not): a
    tree tests may change, or run `launch` from, as a user would."""
    import shutil

    subprocess.run(["git", "clone", "-q", str(REPO), str(dest)], check=True, timeout=120)
    for rel in subprocess.run(["git", "-C", str(REPO), "ls-files", "-m", "-o", "--exclude-standard"],
                              capture_output=True, text=True, check=True).stdout.split():
        src = REPO / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    return dest


def tensors(obj, prefix=""):
    """(key path, tensor) for every tensor in a loaded checkpoint object (dicts and lists walked)."""
    import torch

    if torch.is_tensor(obj):
        yield prefix, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from tensors(v, f"{prefix}/{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from tensors(v, f"{prefix}/{i}")


def assert_state_bytes_exact(rdir: Path, procs: int) -> None:
    """The planner's model-state bytes per rank (recipes.gpt.plan.memory) equal what each rank of the run
    really held (ranks/state_<r>.json: parameters, gradients, optimizer states)."""
    import yaml

    from launcher.config.schema import typed
    from recipes.gpt.plan.memory import model_state_bytes_per_rank

    rdir = Path(rdir)
    cfg = typed(yaml.safe_load((rdir / "config.yaml").read_text()))
    for rank in range(procs):
        held = json.loads((rdir / "ranks" / f"state_{rank}.json").read_text())
        # megatron's ZeRO-1 (torch ZeroRedundancyOptimizer) shards whole tensors greedily, so each
        # data-parallel rank holds a different share: the planner models that partition exactly
        want = model_state_bytes_per_rank(cfg, stage=held["pp_stage"], dp_rank=held["dp_rank"])
        got = {k: held[k] for k in ("params", "grads", "optimizer")}
        assert got == {k: want[k] for k in got}, (rdir, rank, got, want)


def wandb_offline_steps(run_dir: Path) -> Dict[str, List[int]]:
    """The history steps each offline wandb run of a run dir holds, by its dir name. Read from wandb's
    own ``.wandb`` files (a LevelDB-style log of ``Record`` protobufs, after a 7-byte header)."""
    import struct

    from wandb.proto import wandb_internal_pb2 as pb

    out: Dict[str, List[int]] = {}
    for f in sorted(Path(run_dir).glob("wandb/offline-run-*/*.wandb")):
        data, pos, block, buf, steps = f.read_bytes(), 7, 32768, b"", []
        while pos + 7 <= len(data):
            left = block - pos % block
            if left < 7:
                pos += left
                continue
            _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
            chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
            if kind == 0 and length == 0:
                break
            buf += chunk
            if kind in (1, 4):  # a whole record, or the last part of one
                rec = pb.Record()
                rec.ParseFromString(buf)
                buf = b""
                if rec.WhichOneof("record_type") == "history":
                    steps += [int(i.value_json) for i in rec.history.item
                              if i.key == "_step" or list(i.nested_key) == ["_step"]]
        out[f.parent.name] = steps
    return out


def assert_one_wandb_run(run_dir: Path, steps: int) -> None:
    """wandb on (the default) through every attempt: one wandb id (the run's), its offline dirs in the
    run dir, every step 1..steps logged in them."""
    run_dir = Path(run_dir)
    record = json.loads((run_dir / "wandb" / "stream.json").read_text())
    held = wandb_offline_steps(run_dir)
    assert held, f"no offline wandb run in {run_dir}/wandb"
    assert all(name.endswith("-" + record["id"]) for name in held), (record, list(held))
    assert sorted(set(s for got in held.values() for s in got)) == list(range(1, steps + 1)), held
    assert record["durable_through"] == steps, record
