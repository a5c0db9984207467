"""How long the login-side commands take to answer, against Hydra's own on a trivial app (same run).

    .venv/bin/python benchmarks/help_speed.py [--repeat N]

Each command is a new process, timed wall-clock, N times in turn (interleaved, so a busy moment of the
machine falls on all of them alike); the median of each and its ratio to the baseline:
  - baseline:      `python benchmarks/trivial_hydra_app.py --help` (Hydra's help, one key, no schema)
  - launch --help: the product's help (every config group and its options, the schema's defaults)
  - dry run:       `launch submit.dry_run=true` (composed, checked, planned; nothing submitted)
  - grid refused:  `launch -m seed=range(0,1000) optim.lr=range(0,1000)` (refused by submit.max_points)
  - launcher runs: `launcher runs` on an empty runs root
Target: launch --help within 1.5x of the baseline.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
TARGET = 1.5


def commands(root: str):
    return {
        "baseline": [sys.executable, str(REPO / "benchmarks" / "trivial_hydra_app.py"), "--help"],
        "launch --help": [str(BIN / "launch"), "--help"],
        "dry run": [str(BIN / "launch"), "submit.dry_run=true"],
        "grid refused": [str(BIN / "launch"), "-m", "seed=range(0,1000)", "optim.lr=range(0,1000)"],
        "launcher runs": [str(BIN / "launcher"), "runs", "--root", root],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, LAUNCHER_RUNS=str(Path(tmp) / "runs"))
        cmds = commands(str(Path(tmp) / "runs"))
        times = {name: [] for name in cmds}
        for _ in range(args.repeat):
            for name, argv in cmds.items():
                t0 = time.perf_counter()
                subprocess.run(argv, cwd=tmp, env=env, capture_output=True, timeout=300)
                times[name].append(time.perf_counter() - t0)
    base = statistics.median(times["baseline"])
    print(f"{'command':<16}{'median s':>10}{'min s':>8}{'x baseline':>12}")
    for name, ts in times.items():
        print(f"{name:<16}{statistics.median(ts):>10.2f}{min(ts):>8.2f}{statistics.median(ts) / base:>12.2f}")
    ratio = statistics.median(times["launch --help"]) / base
    verdict = "met" if ratio <= TARGET else "NOT met"
    print(f"launch --help / Hydra's help: {ratio:.2f}x (target <= {TARGET}x): {verdict}")
    return 0 if ratio <= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
