"""A sweep far past the user's submit limit run to the end in waves, on the real local Slurm cluster
(scripts/slurm-local.sh up: it enforces association limits, AccountingStorageEnforce=associations,limits,qos).
The user's association in an account of the drill's own is limited (`sacctmgr ... MaxSubmitJobs=M`,
removed after); N points of a script that ends at once (`recipe=script`, train.steps=2); the launch is
sent SIGTERM the moment its first array is queued. Prints each wave, whether every point completed
exactly once (one job, one attempt), the most jobs of the account squeue ever listed (sampled every
0.5 s) against the limit, whether squeue is empty after, and the times.

    .venv/bin/python benchmarks/waves_drill.py [--points 1000] [--limit 200] [--array 100]

``--array``: cluster.max_array_size, so that the first wave is several arrays (a SIGTERM between them).
"""
from __future__ import annotations

import argparse
import getpass
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

BIN = Path(sys.executable).parent
ACCOUNT = "wavesbench"


def sacctmgr(*args: str) -> None:
    subprocess.run(["sacctmgr", "-i", *args], capture_output=True, text=True, timeout=120)


def queued() -> int:
    out = subprocess.run(["squeue", "-h", "-r", "-A", ACCOUNT, "-o", "%i"], capture_output=True, text=True,
                         timeout=120).stdout
    return len(out.split())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--points", type=int, default=1000)
    ap.add_argument("--limit", type=int, default=200)
    ap.add_argument("--array", type=int, default=100)
    ap.add_argument("--timeout", type=float, default=3600)
    args = ap.parse_args()
    user = getpass.getuser()
    sacctmgr("add", "account", ACCOUNT, "description=waves drill", "organization=bench")
    sacctmgr("add", "user", user, f"account={ACCOUNT}", f"maxsubmitjobs={args.limit}")
    peak, stop = [0], threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], queued())
            stop.wait(0.5)

    try:
        with tempfile.TemporaryDirectory(prefix="waves-drill-") as d:
            work = Path(d)
            (work / "point.py").write_text("print('done')\n")
            root = work / "runs"
            env = dict(os.environ, LAUNCHER_RUNS=str(root), XDG_CACHE_HOME=str(work / "cache"))
            threading.Thread(target=sample, daemon=True).start()
            t0 = time.perf_counter()
            proc = subprocess.Popen([str(BIN / "launch"), "-m", "recipe=script", "recipe.script=point.py",
                                     "cluster=local_slurm", "cluster.nodes=1", "cluster.gpus_per_node=1",
                                     "train.steps=2", f"cluster.account={ACCOUNT}",
                                     f"cluster.max_array_size={args.array}",
                                     f"seed=range(0,{args.points})"], cwd=str(work), env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            while proc.poll() is None:
                journals = list(root.glob("*/.launch.json")) if root.is_dir() else []
                try:
                    if journals and json.loads(journals[0].read_text()).get("arrays"):
                        break
                except (OSError, ValueError):
                    pass
                time.sleep(0.01)
            proc.send_signal(signal.SIGTERM)
            out, err = proc.communicate(timeout=600)
            launched = time.perf_counter() - t0
            print(f"launch: exit {proc.returncode} after {launched:.1f} s; {err.strip().splitlines()[-1:]}")
            sweep = next(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
            deadline = time.time() + args.timeout
            while time.time() < deadline:
                res = subprocess.run([str(BIN / "launcher"), "status", sweep.name, "--json"], capture_output=True,
                                     text=True, env=env, cwd=str(work), timeout=600)
                counts = json.loads(res.stdout)["counts"] if res.returncode == 0 else {}
                if counts and set(counts) <= {"completed", "failed", "cancelled", "timeout"}:
                    break
                time.sleep(10)
            total = time.perf_counter() - t0
            stop.set()
            plan = json.loads((sweep / "waves.json").read_text())
            for i, w in enumerate(plan["waves"]):
                print(f"wave {i + 1}: {len(w['runs'])} run(s) in {len(w['job_ids'])} array(s), by {w['by']}")
            runs = [json.loads((sweep / str(i) / "status.json").read_text()) for i in range(args.points)]
            jobs = [json.loads((sweep / str(i) / "job.json").read_text()) for i in range(args.points)]
            once = sorted(i for w in plan["waves"] for i in w["runs"]) == list(range(args.points))
            single = all(not j.get("earlier_job_ids") for j in jobs) and \
                all(r.get("attempt") in (None, 1) for r in runs)
            print(f"statuses: {counts}; every point in exactly one wave: {once}; "
                  f"one job and one attempt each: {single}")
            print(f"most jobs of the account queued at once (sampled): {peak[0]} (limit {args.limit})")
            time.sleep(5)
            print(f"squeue after: {queued()} job(s); {args.points} points in {total:.0f} s")
    finally:
        stop.set()
        subprocess.run(["scancel", "-A", ACCOUNT], capture_output=True, timeout=120)
        time.sleep(3)
        sacctmgr("delete", "user", "where", f"name={user}", f"account={ACCOUNT}")
        sacctmgr("delete", "account", ACCOUNT)


if __name__ == "__main__":
    main()
