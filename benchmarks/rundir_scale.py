"""What each rank of a 4,096-rank job asks of the shared run dir: tests/rank_sim.py's simulation (every
rank's node-side start-up, peer watch, a peer's failure, a checkpoint and a hang, one rank after
another in this process, against a counting file-system layer) at N = 8, 64, 512 and 4,096 ranks.
Prints a table of operations and directory entries per rank and in total (docs/performance.md).
The pure test (tests/unit/test_rundir_scale.py) holds the same counts flat up to 512 ranks.

    .venv/bin/python benchmarks/rundir_scale.py [--sizes 8,64,512,4096] [--tree /path/to/checkout]

``--tree``: the launcher of another checkout (its launcher/ package), e.g. an older commit's, to
count what it did (an older watch's look and hang wait are replayed at their cheapest). The ranks are
placed through a Slurm task's environment, read by the launcher's backends: a launcher that read
submitit's JobEnvironment instead (before the backends owned the node side) cannot be counted.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="8,64,512,4096")
    ap.add_argument("--tree", default=str(ROOT), help="the checkout whose launcher/ is counted")
    args = ap.parse_args()
    sys.path[:0] = [str(Path(args.tree).resolve()), str(ROOT / "tests")]
    import launcher
    import rank_sim

    print(f"launcher from {Path(launcher.__file__).parent}", file=sys.stderr)
    results = {}
    for world in (int(s) for s in args.sizes.split(",")):
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory() as d:
            results[world] = rank_sim.simulate(Path(d) / "runs", world)
        print(f"N={world}: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    print(rank_sim.table(results))


if __name__ == "__main__":
    main()
