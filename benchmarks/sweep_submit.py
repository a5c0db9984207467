"""Time from the command to every job of an N-point sweep queued, side by side on the same local
Slurm cluster (scripts/slurm-local.sh up), in one run, for each N of --points:

    .venv/bin/python benchmarks/sweep_submit.py [--points 100,1000,10000] [--only launch,hydra_submitit,raw]
                                                [--hydra-max 1000] [--profile 1000 [--before REV]]

  launch          `launch -m seed=range(N) cluster=local_slurm`: every point composed, validated,
                  planned and archived (run dir, code snapshot, registry), then one array per
                  MaxArraySize; timed until the command returns (it returns once queued)
  hydra_submitit  Hydra's own submitit launcher (hydra-submitit-launcher, `hydra/launcher=submitit_slurm`)
                  on benchmarks/trivial_hydra_app.py; that launcher blocks until the jobs end, so it is
                  timed until squeue lists the array (only for N <= --hydra-max: minutes a point past it)
  raw             `sbatch --array` of a trivial script, one per 1,000 tasks (the cluster's MaxArraySize);
                  timed until the last sbatch returns
  generic         this project's launcher for any Hydra app (`hydra/launcher=launcher_slurm
                  hydra.launcher.wait=false`) on the same trivial app, archive included; timed until
                  the command returns

Every job is held (`--begin=now+10hours`) so that nothing runs, and cancelled (scancel) right after
its measurement. Prints each time and the ratios launch/hydra_submitit and launch/raw (the issue's
targets: launch at least 20x faster than Hydra's submitit launcher at 1,000 points, i.e. a ratio
<= 0.05, and 10,000 points in <= 20 s).

--profile N: where launch's time goes, per point, for an N-point sweep (benchmarks/launch_profile.py:
the pipeline's phases timed in-process; without --points, no sweep size is timed besides); --before REV:
the same on a clean checkout of revision REV (git worktree, its code first on PYTHONPATH), side by side
with this checkout's.
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
APP = Path(__file__).resolve().parent / "trivial_hydra_app.py"
HOLD = "now+10hours"  # queued, never started: the benchmark measures submission only


def _env(runs_root: Path) -> Dict[str, str]:
    return dict(os.environ, LAUNCHER_RUNS=str(runs_root), PYTHONUNBUFFERED="1")


def queued_tasks(name: str) -> int:
    """Array tasks (and jobs) squeue lists under this job name."""
    out = subprocess.run(["squeue", "-h", "-r", "-n", name, "-o", "%i"], capture_output=True, text=True,
                         timeout=60).stdout
    return len([line for line in out.splitlines() if line.strip()])


def cancel(name: str) -> None:
    deadline = time.time() + 120
    while True:  # again while any is left: a sweep's wave job may queue its next wave meanwhile
        subprocess.run(["scancel", "-n", name], check=False, timeout=120)
        if not queued_tasks(name) or time.time() > deadline:
            return
        time.sleep(0.5)


def wait_for_room(n: int, timeout: float = 300.0) -> None:
    """Until the controller holds room for n more jobs: the jobs an earlier measurement cancelled count
    against MaxJobCount until the controller purges them (MinJobAge), and sbatch would be refused."""
    conf = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True, timeout=60).stdout
    limit = next((int(line.split("=")[1]) for line in conf.splitlines() if line.split("=")[0].strip() == "MaxJobCount"),
                 10000)
    deadline = time.time() + timeout
    while time.time() < deadline:
        held = subprocess.run(["squeue", "-h", "-r", "-t", "all", "-o", "%i"], capture_output=True, text=True,
                              timeout=60).stdout.split()
        if len(held) + n <= limit:
            return
        time.sleep(1.0)


def timed_command(cmd: List[str], env: Dict[str, str], cwd: Path, timeout: float) -> float:
    t0 = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=str(cwd), timeout=timeout)
    dt = time.perf_counter() - t0
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:6])} ... failed ({res.returncode}):\n"
                           f"{res.stdout[-2000:]}\n{res.stderr[-3000:]}")
    return dt


LAUNCH_POINT = ["cluster=local_slurm", "cluster.nodes=1"]


def bench_launch(n: int, work: Path, name: str, timeout: float) -> float:
    cmd = [str(BIN / "launch"), "-m", f"seed=range({n})", *LAUNCH_POINT,
           f"submit.job_name={name}", f"+cluster.sbatch_extra.begin={HOLD}"]
    return timed_command(cmd, _env(work / f"runs-launch-{name}"), REPO, timeout)


def bench_hydra_submitit(n: int, work: Path, name: str, timeout: float) -> float:
    """Hydra's submitit launcher waits for its jobs: time until squeue lists all N of them, then cancel
    (the launcher then exits with the cancelled jobs' error, which is expected here)."""
    cmd = [sys.executable, str(APP), "-m", f"+seed=range({n})", "hydra/launcher=submitit_slurm",
           "hydra.launcher.partition=debug", f"hydra.launcher.name={name}", "hydra.launcher.timeout_min=10",
           f"hydra.launcher.array_parallelism={n}", f"+hydra.launcher.additional_parameters.begin={HOLD}",
           f"hydra.sweep.dir={work / 'hydra-submitit'}"]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(work),
                            cwd=str(work))
    try:
        while True:
            if queued_tasks(name) >= n:
                return time.perf_counter() - t0
            if proc.poll() is not None:
                raise RuntimeError(f"Hydra's submitit launcher exited ({proc.returncode}) before queuing:\n"
                                   f"{(proc.stdout.read() if proc.stdout else '')[-3000:]}")
            if time.perf_counter() - t0 > timeout:
                raise RuntimeError(f"Hydra's submitit launcher did not queue {n} jobs in {timeout}s")
            time.sleep(0.05)
    finally:
        cancel(name)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def bench_raw(n: int, work: Path, name: str, timeout: float) -> float:
    script = work / "trivial.sh"
    script.write_text("#!/bin/bash\necho $SLURM_ARRAY_TASK_ID\n")
    t0 = time.perf_counter()
    for start in range(0, n, RAW_ARRAY):  # task ids below the cluster's MaxArraySize (1,001): 0-999 each
        size = min(n, start + RAW_ARRAY) - start
        cmd = ["sbatch", "--parsable", f"--array=0-{size - 1}", "-p", "debug", "-J", name, f"--begin={HOLD}",
               "-o", str(work / "raw-%A_%a.out"), str(script)]
        timed_command(cmd, _env(work), work, timeout)
    return time.perf_counter() - t0


RAW_ARRAY = 1000


def bench_generic(n: int, work: Path, name: str, timeout: float) -> float:
    cmd = [sys.executable, str(APP), "-m", f"+seed=range({n})", "hydra/launcher=launcher_slurm",
           "hydra.launcher.partition=debug", f"hydra.launcher.name={name}", "hydra.launcher.wait=false",
           f"hydra.launcher.array_parallelism={n}", f"+hydra.launcher.additional_parameters.begin={HOLD}",
           f"hydra.sweep.dir={work / 'generic'}"]
    return timed_command(cmd, _env(work / "runs-generic"), work, timeout)


BENCHES = {"launch": bench_launch, "hydra_submitit": bench_hydra_submitit, "raw": bench_raw,
           "generic": bench_generic}


def run(n: int, only: List[str], timeout: float, work: Path) -> Dict[str, float]:
    tag = secrets.token_hex(3)
    times: Dict[str, float] = {}
    for what in only:
        name = f"bench_{what}_{n}_{tag}"
        wait_for_room(n)
        print(f"{what:15s} {n:>6} points ...", end=" ", flush=True)
        try:
            times[what] = BENCHES[what](n, work, name, timeout)
        finally:
            cancel(name)
        print(f"{times[what]:8.3f} s  ({n / times[what]:9.1f} points/s)", flush=True)
    return times


def ratio(a: Optional[float], b: Optional[float]) -> str:
    return f"{a / b:.3f}" if a is not None and b else "n/a"


def profile(n: int, work: Path, code: Optional[Path], timeout: float) -> Dict[str, float]:
    """benchmarks/launch_profile.py's phases of an n-point launch, in seconds (``code``: a checkout
    whose launcher is imported instead of this one's)."""
    name = f"bench_profile_{secrets.token_hex(3)}"
    env = _env(work / f"runs-{name}")
    if code is not None:
        env["PYTHONPATH"] = f"{code}{os.pathsep}{env.get('PYTHONPATH', '')}"
    cmd = [sys.executable, str(Path(__file__).resolve().parent / "launch_profile.py"), "-m", f"seed=range({n})",
           *LAUNCH_POINT, f"submit.job_name={name}", f"+cluster.sbatch_extra.begin={HOLD}"]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=str(code or REPO), timeout=timeout)
    finally:
        cancel(name)
    if res.returncode != 0:
        raise RuntimeError(f"the profiled launch failed ({res.returncode}):\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def checkout(rev: str, work: Path) -> Path:
    """A clean checkout of ``rev`` of this repository (git worktree, removed with the scratch dir)."""
    dest = work / f"before-{rev}"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(dest), rev], check=True,
                   capture_output=True, timeout=120)
    return dest


def print_profile(n: int, columns: Dict[str, Dict[str, float]]) -> None:
    print(f"\nper point, {n} points (ms a point; launch_profile.py's phases, nested: a phase includes those "
          "indented under it in the pipeline)")
    keys = list(dict.fromkeys(k for col in columns.values() for k in col))
    print(f"  {'phase':34s}" + "".join(f"{label:>14s}" for label in columns))
    for k in keys:
        print(f"  {k:34s}" + "".join(f"{col[k] / n * 1e3:14.3f}" if k in col else f"{'-':>14s}"
                                      for col in columns.values()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--points", default=None,
                    help="sweep sizes N, comma-separated (default 100,1000,10000; with --profile alone: none)")
    ap.add_argument("--only", default="launch,hydra_submitit,raw",
                    help="comma-separated subset of " + ",".join(BENCHES))
    ap.add_argument("--hydra-max", type=int, default=1000, help="Hydra's submitit launcher only up to this N")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds allowed per command")
    ap.add_argument("--profile", type=int, metavar="N", help="launch's time per point and phase at N points")
    ap.add_argument("--before", metavar="REV", help="with --profile: the same on a checkout of REV, side by side")
    ap.add_argument("--keep", action="store_true", help="keep the scratch dir (runs roots, Hydra sweep dirs)")
    args = ap.parse_args()
    only = [w.strip() for w in args.only.split(",") if w.strip()]
    bad = [w for w in only if w not in BENCHES]
    if bad:
        ap.error(f"unknown: {', '.join(bad)}")
    if shutil.which("sbatch") is None or not os.environ.get("SLURM_CONF"):
        sys.exit("needs the local Slurm cluster: scripts/slurm-local.sh up; eval \"$(scripts/slurm-local.sh env)\"")
    points = args.points if args.points is not None else ("" if args.profile else "100,1000,10000")
    sizes = [int(x) for x in points.split(",") if x.strip()]
    work = Path(tempfile.mkdtemp(prefix="sweep-submit-"))
    results: Dict[int, Dict[str, float]] = {}
    try:
        for n in sizes:
            results[n] = run(n, [w for w in only if w != "hydra_submitit" or n <= args.hydra_max], args.timeout, work)
        print("\ntime from the command to all queued (s), and launch's ratios:")
        print(f"  {'points':>7s}" + "".join(f"{w:>16s}" for w in only) + f"{'launch/hydra':>14s}{'launch/raw':>12s}")
        for n, t in results.items():
            cells = "".join(f"{t[w]:16.3f}" if w in t else f"{'-':>16s}" for w in only)
            hydra, raw = ratio(t.get("launch"), t.get("hydra_submitit")), ratio(t.get("launch"), t.get("raw"))
            print(f"  {n:>7d}{cells}{hydra:>14s}{raw:>12s}")
        print("targets: launch/hydra <= 0.05 at 1,000 points (20x faster); launch of 10,000 points <= 20 s")
        if args.profile:
            columns = {"this checkout": profile(args.profile, work, None, args.timeout)}
            if args.before:
                columns = {f"before {args.before}": profile(args.profile, work, checkout(args.before, work),
                                                            args.timeout), **columns}
            print_profile(args.profile, columns)
    finally:
        if args.before:
            subprocess.run(["git", "-C", str(REPO), "worktree", "prune"], capture_output=True, timeout=60)
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
            subprocess.run(["git", "-C", str(REPO), "worktree", "prune"], capture_output=True, timeout=60)


if __name__ == "__main__":
    main()
