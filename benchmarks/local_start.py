"""cluster=local's processes forked from a warm controller vs each started as a new interpreter
(launcher.runtime.warm_start): the same local launches, alternated, with LAUNCHER_LOCAL_FORK=1 (the
default) and =0, timed end to end (the `launch` command returns once the run ended).

  .venv/bin/python benchmarks/local_start.py [--procs 2 4] [--steps 5] [--rounds 3]

Prints, per process count, the median wall time of each mode over the rounds, their ratio, and each
run's final loss (equal in both modes: the same training, started another way). Run it on a quiet
machine: the launches share its cores.
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Tuple

REPO = Path(__file__).resolve().parent.parent
LAUNCH = REPO / ".venv" / "bin" / "launch"


def one(procs: int, steps: int, fork: bool, root: Path) -> Tuple[float, str]:
    env = dict(os.environ, LAUNCHER_LOCAL_FORK="1" if fork else "0")
    t0 = time.monotonic()
    res = subprocess.run([str(LAUNCH), f"train.steps={steps}", f"cluster.gpus_per_node={procs}",
                          f"submit.runs_root={root}"], env=env, capture_output=True, text=True, timeout=900)
    wall = time.monotonic() - t0
    if res.returncode != 0:
        mode = "forked" if fork else "new interpreters"
        sys.exit(f"launch failed ({mode}, {procs} procs):\n{res.stdout[-2000:]}{res.stderr[-2000:]}")
    loss = re.search(r"loss \S+ -> (\S+)", res.stdout)
    return wall, loss.group(1) if loss else "?"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--procs", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    rows: List[str] = []
    with tempfile.TemporaryDirectory(prefix="local-start-") as tmp:
        os.chdir(tmp)  # a launch dir outside the repo: its code snapshot is the launcher's own
        for procs in args.procs:
            walls: Dict[bool, List[float]] = {True: [], False: []}
            losses: Dict[bool, set] = {True: set(), False: set()}
            for r in range(args.rounds):
                for fork in ((True, False) if r % 2 == 0 else (False, True)):  # alternated: drift hits both
                    wall, loss = one(procs, args.steps, fork, Path(tmp) / "runs")
                    walls[fork].append(wall)
                    losses[fork].add(loss)
            fork_s, exec_s = statistics.median(walls[True]), statistics.median(walls[False])
            rows.append(f"| {procs} | {args.steps} | {exec_s:.1f} | {fork_s:.1f} | {fork_s / exec_s:.2f} | "
                        f"{', '.join(sorted(losses[False]))} | {', '.join(sorted(losses[True]))} |")
    print(f"local launches, gpt_tiny, {args.rounds} round(s) each, median wall seconds (launch to its end)\n")
    print("| processes | steps | new interpreters (s) | forked (s) | forked / new | final loss (new) "
          "| final loss (forked) |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
