"""A rank whose peer died must not wait in a collective until the process-group timeout.

Every failing rank records its error in the run dir (RunDir.write_rank_error) (shared by all ranks). The watchdog,
a daemon thread in each rank, ends its own process as soon as another rank's error file appears.
Slurm does the same through srun --kill-on-bad-exit; this also covers local runs."""
from __future__ import annotations

import os
import sys
import threading
from typing import Any

from launcher.rundir import RunDir


def start(rundir: Any, rank: int, interval_s: float = 1.0) -> threading.Event:
    """Watch the run dir (a RunDir or its path) for another rank's failure; returns an event that
    stops the watch."""
    rd = rundir if isinstance(rundir, RunDir) else RunDir(rundir)
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(interval_s):
            failed = rd.failed_ranks(except_rank=rank)
            if failed:
                print(f"[watchdog] rank {rank}: {failed[0]} failed; ending this rank too",
                      file=sys.stderr, flush=True)
                os._exit(1)

    threading.Thread(target=watch, name="rank-watchdog", daemon=True).start()
    return stop
