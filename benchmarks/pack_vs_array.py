"""The same N single-process gpt_tiny points as ONE pack (cluster.pack=true, cluster.pack_nodes=K)
and as one Slurm array, side by side on the local Slurm cluster (scripts/slurm-local.sh up), in one run:

    SLURM_CONF=.slurm-local/slurm.conf .venv/bin/python benchmarks/pack_vs_array.py [--points 32] [--nodes 4]
        [--steps 3] [--only pack,array]

For each: the wall time from the `launch -m` command to every run final and sealed, the scheduler's
jobs (sacct: allocations, each array task one; and job steps), and the run dirs: each sealed, the
same file layout (relative paths, per point), the same final loss per seed. Prints a ratio line
(pack / array). Every job of the benchmark is cancelled at the end if still queued.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Set, Tuple

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
sys.path.insert(0, str(REPO))

from launcher.run.rundir import RunDir  # noqa: E402  (no torch: the run dir's records)

FINAL = ("completed", "failed", "cancelled", "timeout")
# files whose names carry the attempt's job (ids differ between the two ways by construction)
VARIABLE = ("ranks/", "topology/", "env/", "work/", "errors/")


def run_dirs(root: Path) -> List[Path]:
    return sorted((p for p in root.glob("*/[0-9]*") if p.is_dir()), key=lambda p: int(p.name))


def wait_all(root: Path, n: int, timeout: float) -> float:
    """Seconds until n runs under ``root`` are final and sealed (`launcher status` settles a lost one)."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        dirs = run_dirs(root)
        if len(dirs) >= n and all(RunDir(d).status().state.value in FINAL and RunDir(d).is_sealed() for d in dirs):
            return time.time()
        time.sleep(0.5)
    raise SystemExit(f"not all {n} runs under {root} ended within {timeout}s")


def layout(d: Path) -> Set[str]:
    return {str(p.relative_to(d)) for p in d.rglob("*") if p.is_file()
            and not str(p.relative_to(d)).startswith(VARIABLE)}


def sacct_rows(job_ids: Set[str]) -> List[Tuple[str, str, str]]:
    """(JobID, Submit, Start) of every allocation, array task and step of the jobs."""
    out = subprocess.run(["sacct", "-n", "-P", "-j", ",".join(sorted(job_ids)), "--format=JobID,Submit,Start"],
                         capture_output=True, text=True, timeout=60).stdout
    return [tuple(line.strip().split("|")) for line in out.splitlines() if line.strip()]  # type: ignore[misc]


def seconds(stamp: str) -> float:
    return time.mktime(time.strptime(stamp, "%Y-%m-%dT%H:%M:%S"))


def one(kind: str, args: argparse.Namespace, root: Path) -> Dict[str, object]:
    over = ["cluster=local_slurm", "cluster.nodes=1", "cluster.gpus_per_node=1", "model=gpt_tiny",
            f"train.steps={args.steps}", "wandb.enabled=false", "train.log_interval=0", "cluster.time_min=30",
            f"seed=range({args.points})", f"submit.runs_root={root}"]
    if kind == "pack":
        over += ["cluster.pack=true", f"cluster.pack_nodes={args.nodes}"]
    env = dict(os.environ, LAUNCHER_RUNS=str(root))
    t0 = time.time()
    res = subprocess.run([str(BIN / "launch"), "-m", *over], capture_output=True, text=True, env=env, timeout=600)
    if res.returncode:
        raise SystemExit(f"{kind}: launch failed:\n{res.stdout}\n{res.stderr}")
    queued = time.time() - t0
    t1 = wait_all(root, args.points, args.timeout)
    dirs = run_dirs(root)
    jobs = {json.loads((d / "job.json").read_text())["job_id"] for d in dirs}
    owners = {j.partition("_")[0] for j in jobs}
    rows = sacct_rows(owners)
    allocations = [r for r in rows if "." not in r[0]]  # an array task is a job of its own; a step has a dot
    steps = [r for r in rows if "." in r[0] and not r[0].endswith((".batch", ".extern"))]
    # the wait for the scheduler: the longest from submission to start of an allocation (a shared cluster)
    waits = [seconds(r[2]) - seconds(r[1]) for r in allocations if r[1][:1].isdigit() and r[2][:1].isdigit()]
    losses: Dict[int, float] = {}
    for d in dirs:
        st = RunDir(d).status()
        seed = int(json.loads((d / "run.json").read_text()).get("seed", -1))
        losses[seed] = float((st.summary or {}).get("final_loss", float("nan")))
    return {"kind": kind, "wall_s": t1 - t0, "queued_s": queued, "max_wait_s": max(waits, default=0.0),
            "jobs": len(allocations), "steps": len(steps),
            "runs": len(dirs), "completed": sum(RunDir(d).status().state.value == "completed" for d in dirs),
            "sealed": sum(RunDir(d).is_sealed() for d in dirs), "losses": losses,
            "layout": {int(d.name): layout(d) for d in dirs}, "owners": sorted(owners)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--points", type=int, default=32)
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--only", default="pack,array")
    ap.add_argument("--keep", action="store_true", help="keep the runs roots")
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="pack-bench-", dir=os.environ.get("LAUNCHER_BENCH_DIR") or None))
    got: Dict[str, Dict[str, object]] = {}
    try:
        for kind in args.only.split(","):
            got[kind] = one(kind, args, base / kind)
            r = got[kind]
            print(f"{kind:5s}: {r['runs']} runs, {r['completed']} completed, {r['sealed']} sealed; scheduler jobs "
                  f"{r['jobs']} (sacct; job steps {r['steps']}); launch returned after {r['queued_s']:.1f} s; longest "
                  f"wait in the queue {r['max_wait_s']:.0f} s; "
                  f"all final and sealed after {r['wall_s']:.1f} s", flush=True)
    finally:
        for r in got.values():
            subprocess.run(["scancel", *r["owners"]], capture_output=True, timeout=60)  # type: ignore[misc]
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)
    if "pack" in got and "array" in got:
        p, a = got["pack"], got["array"]
        same_layout = all(p["layout"][i] == a["layout"][i] for i in p["layout"])  # type: ignore[index]
        diff = sorted(set().union(*(p["layout"][i] ^ a["layout"][i] for i in p["layout"])))  # type: ignore[index]
        same_loss = p["losses"] == a["losses"]
        print(f"run dirs: same file layout per point: {same_layout}{'' if same_layout else ' ' + str(diff[:6])}; "
              f"same final loss per seed: {same_loss}")
        print(f"ratio pack/array: scheduler jobs {p['jobs']}/{a['jobs']}, wall time to all completed "
              f"{p['wall_s']:.1f}/{a['wall_s']:.1f} s = {float(p['wall_s']) / float(a['wall_s']):.2f}")  # type: ignore[arg-type]
    return 0


if __name__ == "__main__":
    sys.exit(main())
