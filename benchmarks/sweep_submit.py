"""Time from the command to every job of an N-point sweep queued, side by side on the same local
Slurm cluster (scripts/slurm-local.sh up), in one run:

    .venv/bin/python benchmarks/sweep_submit.py [--points 1000] [--only launch,hydra_submitit,raw,generic]

  launch          `launch -m seed=range(N) cluster=local_slurm`: every point composed, validated,
                  planned and archived (run dir, code snapshot, registry), then ONE array; timed until
                  the command returns (it returns once queued)
  hydra_submitit  Hydra's own submitit launcher (hydra-submitit-launcher, `hydra/launcher=submitit_slurm`)
                  on benchmarks/trivial_hydra_app.py; that launcher blocks until the jobs end, so it is
                  timed until squeue lists the array
  raw             `sbatch --array=0-(N-1)` of a trivial script; timed until sbatch returns
  generic         this project's launcher for any Hydra app (`hydra/launcher=launcher_slurm
                  hydra.launcher.wait=false`) on the same trivial app, archive included; timed until
                  the command returns

Every job is held (`--begin=now+10hours`) so that nothing runs, and cancelled (scancel) right after
its measurement. Prints each time and the ratios launch/hydra_submitit and launch/raw (the issue's
target: launch at least 10x faster than Hydra's submitit launcher, i.e. a ratio <= 0.1).
"""
from __future__ import annotations

import argparse
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
    subprocess.run(["scancel", "-n", name], check=False, timeout=120)
    deadline = time.time() + 120
    while queued_tasks(name) and time.time() < deadline:
        time.sleep(0.5)


def timed_command(cmd: List[str], env: Dict[str, str], cwd: Path, timeout: float) -> float:
    t0 = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=str(cwd), timeout=timeout)
    dt = time.perf_counter() - t0
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:6])} ... failed ({res.returncode}):\n"
                           f"{res.stdout[-2000:]}\n{res.stderr[-3000:]}")
    return dt


def bench_launch(n: int, work: Path, name: str, timeout: float) -> float:
    cmd = [str(BIN / "launch"), "-m", f"seed=range({n})", "cluster=local_slurm", "cluster.nodes=1",
           f"submit.job_name={name}", f"+cluster.sbatch_extra.begin={HOLD}"]
    return timed_command(cmd, _env(work / "runs-launch"), REPO, timeout)


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
    cmd = ["sbatch", "--parsable", f"--array=0-{n - 1}", "-p", "debug", "-J", name, f"--begin={HOLD}",
           "-o", str(work / "raw-%A_%a.out"), str(script)]
    return timed_command(cmd, _env(work), work, timeout)


def bench_generic(n: int, work: Path, name: str, timeout: float) -> float:
    cmd = [sys.executable, str(APP), "-m", f"+seed=range({n})", "hydra/launcher=launcher_slurm",
           "hydra.launcher.partition=debug", f"hydra.launcher.name={name}", "hydra.launcher.wait=false",
           f"hydra.launcher.array_parallelism={n}", f"+hydra.launcher.additional_parameters.begin={HOLD}",
           f"hydra.sweep.dir={work / 'generic'}"]
    return timed_command(cmd, _env(work / "runs-generic"), work, timeout)


BENCHES = {"launch": bench_launch, "hydra_submitit": bench_hydra_submitit, "raw": bench_raw,
           "generic": bench_generic}


def run(n: int, only: List[str], timeout: float, keep: bool) -> Dict[str, float]:
    if shutil.which("sbatch") is None or not os.environ.get("SLURM_CONF"):
        sys.exit("needs the local Slurm cluster: scripts/slurm-local.sh up; eval \"$(scripts/slurm-local.sh env)\"")
    work = Path(tempfile.mkdtemp(prefix="sweep-submit-"))
    tag = secrets.token_hex(3)
    times: Dict[str, float] = {}
    try:
        for what in only:
            name = f"bench_{what}_{tag}"
            print(f"{what:15s} {n} points ...", end=" ", flush=True)
            try:
                times[what] = BENCHES[what](n, work, name, timeout)
            finally:
                cancel(name)
            print(f"{times[what]:8.3f} s  ({n / times[what]:9.1f} points/s)", flush=True)
    finally:
        if keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    return times


def ratio(a: Optional[float], b: Optional[float]) -> str:
    return f"{a / b:.3f}" if a is not None and b else "n/a"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--points", type=int, default=1000, help="sweep size N (default 1000)")
    ap.add_argument("--only", default="launch,hydra_submitit,raw,generic",
                    help="comma-separated subset of " + ",".join(BENCHES))
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds allowed per command")
    ap.add_argument("--keep", action="store_true", help="keep the scratch dir (runs roots, Hydra sweep dirs)")
    args = ap.parse_args()
    only = [w.strip() for w in args.only.split(",") if w.strip()]
    bad = [w for w in only if w not in BENCHES]
    if bad:
        ap.error(f"unknown: {', '.join(bad)}")
    times = run(args.points, only, args.timeout, args.keep)
    t = times.get
    print(f"\n{args.points} points, time from the command to all queued:")
    for what, dt in times.items():
        print(f"  {what:15s} {dt:8.3f} s")
    print(f"launch / hydra_submitit = {ratio(t('launch'), t('hydra_submitit'))}   (target <= 0.1: 10x faster)")
    print(f"launch / raw sbatch     = {ratio(t('launch'), t('raw'))}")
    if "generic" in times:
        print(f"generic / hydra_submitit = {ratio(t('generic'), t('hydra_submitit'))}")


if __name__ == "__main__":
    main()
