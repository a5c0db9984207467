"""Two watches in each rank, so that no rank waits in a collective until the process-group timeout.

- Peer failure: every failing rank records its error in the run dir (RunDir.write_rank_error). The
  watch ends its own process as soon as another rank's error file appears, or the run is recorded
  cancelled (a rank blocked in a collective would otherwise wait for the process-group timeout). Slurm does the same
  through srun --kill-on-bad-exit; this also covers local runs.
- Hang (``train.hang_timeout_s``): when this rank has finished no step for that long, it dumps every
  thread's Python stack (faulthandler) into the run dir, waits briefly for the other ranks' dumps,
  writes hang.json (which rank is stuck where, which collective the others wait in) and calls
  ``on_hang`` (which records the failure and asks for a requeue) before ending the process.

The hang watch looks at this rank's own clock every second; the peer watch reads the (shared) run
dir every second, or less often for large jobs (``fs_poll_interval``: ~128 reads/s per job at most).
"""
from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
from typing import Any, Callable, Optional

from launcher.rundir import RunDir
from launcher.runtime import stacks
from launcher.status import Status

# the run dir's shared filesystem sees at most about this many watchdog reads per second from a job
# (every rank lists the rank errors and reads the status): 1,024 ranks poll every 8 s, not every 1 s
FS_READS_PER_S = 128.0


def fs_poll_interval(world: int, interval_s: float = 1.0) -> float:
    """Seconds between one rank's reads of the run dir: ``interval_s``, longer for large jobs."""
    return max(float(interval_s), float(world) / FS_READS_PER_S)


class Watch:
    def __init__(self, rd: RunDir, rank: int, world: int, hang_timeout_s: float = 0.0,
                 on_hang: Optional[Callable[[str], int]] = None, interval_s: float = 1.0) -> None:
        self.rd, self.rank, self.world = rd, rank, world
        self.hang_timeout_s = float(hang_timeout_s)
        self.on_hang = on_hang
        self.interval_s = interval_s
        self.step: Optional[int] = None
        self._last: Optional[float] = None  # armed by the first beat (start-up may take long)
        self._born = time.time()  # errors recorded before this process started are an earlier attempt's
        self.stop_event = threading.Event()

    def beat(self, step: Optional[int] = None) -> None:
        """The rank made progress (finished a step, or a long save/load)."""
        if step is not None:
            self.step = step
        self._last = time.monotonic()

    def set(self) -> None:  # (the old stop-event interface)
        self.stop_event.set()

    def start(self) -> Watch:
        threading.Thread(target=self._run, name="rank-watchdog", daemon=True).start()
        return self

    def _run(self) -> None:
        every = fs_poll_interval(self.world, self.interval_s)
        next_fs = time.monotonic() + every
        while not self.stop_event.wait(self.interval_s):
            if self.hang_timeout_s > 0 and self._last is not None and \
                    time.monotonic() - self._last > self.hang_timeout_s:
                os._exit(self._hang())
            if time.monotonic() < next_fs:
                continue
            next_fs = time.monotonic() + every
            failed = self.rd.failed_ranks(except_rank=self.rank, since=self._born)
            if failed:
                print(f"[watchdog] rank {self.rank}: {failed[0]} failed; ending this rank too",
                      file=sys.stderr, flush=True)
                os._exit(1)
            if self.rd.status().state is Status.cancelled:
                # cancelled (launcher cancel, submit.wait_timeout_s): the outcome is recorded, and a rank
                # blocked in a collective would not see the interrupt until the process-group timeout
                print(f"[watchdog] rank {self.rank}: the run was cancelled; ending this rank",
                      file=sys.stderr, flush=True)
                os._exit(1)

    def _hang(self) -> int:
        path = self.rd.stack_path(self.rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w") as f:
            f.write(f"# rank {self.rank}, no step finished for {self.hang_timeout_s:.0f} s "
                    f"(last finished step: {self.step})\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
        deadline = time.monotonic() + min(15.0, max(3.0, self.hang_timeout_s))
        while len(self.rd.stacks()) < self.world and time.monotonic() < deadline:
            time.sleep(0.2)
        finding = stacks.finding(self.rd.stacks(), self.world, self.step, self.hang_timeout_s)
        if self.rd.hang() is None and not self.rd.is_final():  # the first rank to get here records it
            self.rd.write_hang(finding)
        message = f"hang: no step finished for {self.hang_timeout_s:.0f} s after step {self.step}: " + \
            stacks.describe(finding)
        print(f"[watchdog] rank {self.rank}: {message}", file=sys.stderr, flush=True)
        return self.on_hang(message) if self.on_hang is not None else 1


def start(rundir: Any, rank: int, interval_s: float = 1.0, world: int = 1, hang_timeout_s: float = 0.0,
          on_hang: Optional[Callable[[str], int]] = None) -> Watch:
    """Start both watches for ``rank``; ``.set()`` on the result stops them, ``.beat(step)`` feeds the
    hang watch."""
    rd = rundir if isinstance(rundir, RunDir) else RunDir(rundir)
    return Watch(rd, rank, world, hang_timeout_s, on_hang, interval_s).start()
