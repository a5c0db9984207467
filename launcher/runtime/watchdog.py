"""A rank whose peer died must not wait in a collective until the process-group timeout.

Every failing rank writes ranks/rank_<r>.error in the run dir (shared by all ranks). The watchdog,
a daemon thread in each rank, ends its own process as soon as another rank's error file appears.
Slurm does the same through srun --kill-on-bad-exit; this also covers local runs."""
from __future__ import annotations

import os
import sys
import threading
from pathlib import Path


def start(run_dir: Path, rank: int, interval_s: float = 1.0) -> threading.Event:
    """Watch `run_dir` for another rank's failure; returns an event that stops the watch."""
    stop = threading.Event()
    own = f"rank_{rank}.error"

    def watch() -> None:
        ranks = Path(run_dir) / "ranks"
        while not stop.wait(interval_s):
            failed = sorted(p.name for p in ranks.glob("rank_*.error") if p.name != own)
            if failed:
                print(f"[watchdog] rank {rank}: {failed[0].split('.')[0]} failed; ending this rank too",
                      file=sys.stderr, flush=True)
                os._exit(1)

    threading.Thread(target=watch, name="rank-watchdog", daemon=True).start()
    return stop
