"""The archive at scale: what the commands cost on a runs root that holds a large sweep, on the real
local Slurm cluster, in one run:

  0. (--fill M) M more runs in the root first, in sweeps of N points queued held and cancelled from
     outside (a root after months of sweeps: 100,000 runs with --points 10000 --fill 90000);
  1. a BIG sweep of N points queued held (`launch -m seed=range(N) +cluster.sbatch_extra.begin=now+10hours`),
     then cancelled from outside the product (`scancel` of its arrays: an admin's, a purge), and a
     SMALL 2-point sweep queued held beside it;
  2. timed, each a fresh `launcher` process: `launcher status SMALL` (only its 2 runs refreshed),
     `launcher runs` (the table: the newest 50, from the index), `launcher runs --json` (every run),
     `launcher status BIG` (the N runs cancelled while pending settle `cancelled`, sealed), `launcher runs`
     again;
  3. a second BIG sweep queued held, and `launcher cancel` of it timed (one scancel, the records and
     seals written).

    LAUNCHER_SLURM_MAX_JOBS=30000 scripts/slurm-local.sh up   # Slurm's default MaxJobCount holds 10,000
    .venv/bin/python benchmarks/root_scale.py [--points 10000] [--fill 0]

Targets (the issue "The archive at scale", 10,000 points): status SMALL <= 1 s, runs <= 3 s,
cancel BIG <= 30 s; a root of 100,000 runs answers `launcher runs` from its index. MaxJobCount counts
every job the controller holds, ended ones too until MinJobAge (30 s): each sweep past the first waits
until the cancelled jobs before it have left (--points <= MaxJobCount/2 - 2).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import List

BIN = Path(sys.executable).parent
HOLD = "+cluster.sbatch_extra.begin=now+10hours"
POINT = ["cluster=local_slurm", "cluster.nodes=1", "cluster.gpus_per_node=1", "model=gpt_tiny", "train.steps=2"]


def run(cmd: List[str], root: Path, timeout: float = 1800) -> tuple[float, subprocess.CompletedProcess]:
    t0 = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=str(root.parent),
                         env=dict(os.environ, LAUNCHER_RUNS=str(root)))
    took = time.perf_counter() - t0
    if res.returncode != 0:
        sys.exit(f"{' '.join(cmd[:4])} ... failed ({res.returncode}):\n{res.stdout[-2000:]}\n{res.stderr[-2000:]}")
    return took, res


def held_jobs() -> int:
    out = subprocess.run(["squeue", "-h", "-r", "-t", "all", "-o", "%i"], capture_output=True, text=True,
                         timeout=120).stdout
    return len(out.split())


def wait_for_room(n: int) -> None:
    """Until the controller holds room for n more jobs: cancelled ones leave after MinJobAge."""
    limit = int(next((line.split("=")[1] for line in subprocess.run(
        ["scontrol", "show", "config"], capture_output=True, text=True, timeout=60).stdout.splitlines()
        if line.startswith("MaxJobCount")), "10000"))
    deadline = time.time() + 600
    while held_jobs() + n + 4 > limit and time.time() < deadline:
        time.sleep(2)


def sweep_of(stdout: str) -> str:
    line = next(ln for ln in stdout.splitlines() if ln.startswith("sweep "))
    return line.split()[1].rstrip(":")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--points", type=int, default=10000)
    ap.add_argument("--fill", type=int, default=0, help="runs put in the root first (sweeps of --points)")
    args = ap.parse_args()
    n = args.points
    rows = []
    with tempfile.TemporaryDirectory(prefix="root-scale-") as d:
        root = Path(d) / "runs"
        root.mkdir()
        launch, launcher = str(BIN / "launch"), str(BIN / "launcher")
        left = args.fill
        while left > 0:
            wait_for_room(n)
            took, res = run([launch, "-m", *POINT, f"seed=range(0,{min(n, left)})", HOLD], root)
            ids = json.loads((root / sweep_of(res.stdout) / "sweep.json").read_text())["job_ids"]
            subprocess.run(["scancel", *ids], check=True, timeout=120)
            print(f"fill: {min(n, left)} runs queued and cancelled ({took:.1f} s)", flush=True)
            left -= n
        wait_for_room(n)
        took, res = run([launch, "-m", *POINT, f"seed=range(0,{n})", HOLD], root)
        big = sweep_of(res.stdout)
        rows.append((f"launch -m: {n} points queued held", took))
        ids = json.loads((root / big / "sweep.json").read_text())["job_ids"]
        subprocess.run(["scancel", *ids], check=True, timeout=120)  # from outside the product
        _, res = run([launch, "-m", *POINT, "seed=range(0,2)", HOLD], root)
        small = sweep_of(res.stdout)
        took, res = run([launcher, "status", small, "--json"], root)
        rows.append(("launcher status SMALL (2 runs)", took))
        took, res = run([launcher, "runs"], root)
        rows.append((f"launcher runs (the table: {res.stderr.strip().splitlines()[-1]})", took))
        took, res = run([launcher, "runs", "--json"], root)
        listed = json.loads(res.stdout)
        rows.append((f"launcher runs --json ({len(listed)} runs)", took))
        took, res = run([launcher, "status", big, "--json"], root)
        counts = json.loads(res.stdout)["counts"]
        rows.append((f"launcher status BIG: {counts}", took))
        took, res = run([launcher, "runs"], root)
        rows.append(("launcher runs again (the table)", took))
        took, res = run([launcher, "runs", "--json"], root)
        rows.append((f"launcher runs --json again ({len(json.loads(res.stdout))} runs)", took))
        wait_for_room(n)
        took, res = run([launch, "-m", *POINT, f"seed=range(0,{n})", HOLD], root)
        big2 = sweep_of(res.stdout)
        rows.append((f"launch -m: {n} points queued held (again)", took))
        took, res = run([launcher, "cancel", big2], root)
        rows.append((f"launcher cancel BIG: {res.stdout.strip()}", took))
        _, res = run([launcher, "status", small, "--json"], root)
        subprocess.run(["scancel", *json.loads((root / small / "sweep.json").read_text())["job_ids"]],
                       check=False, timeout=120)
    width = max(len(r[0]) for r in rows)
    for what, took in rows:
        print(f"{what:<{width}}  {took:8.2f} s")


if __name__ == "__main__":
    main()
