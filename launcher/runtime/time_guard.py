"""The time limit's margin, from the saves this run measured. Slurm warns a job `cluster.signal_delay_s`
before its time limit (USR2), and the run then saves and requeues; a save that takes longer than that
margin is killed half-written, and the run loses everything since its previous checkpoint. Rank 0
watches the job's end (asked of the scheduler once per attempt) and, where the last save took longer
than the margin leaves, stops the run itself that much earlier, as if the warning had come (the other
ranks follow through the step's stop vote), and says so once.
"""
from __future__ import annotations

import sys
import threading
import time
from typing import Any, Optional, TextIO

# cluster=local: when the job's time limit ends it (epoch seconds), set by its controller at each start
JOB_END_ENV = "LAUNCHER_JOB_END"
SAFETY = 1.5  # a save is taken to need this times what the last one took ...
SLACK_S = 15.0  # ... plus this (the step in flight, the requeue)


def stop_margin_s(signal_delay_s: float, save_s: Optional[float]) -> Optional[float]:
    """Seconds before the job's end at which to stop, where the warning's margin would not hold a save
    like the last one (pure). None: the warning's own margin is enough, or no save was measured."""
    if save_s is None:
        return None
    need = float(save_s) * SAFETY + SLACK_S
    return need if need > float(signal_delay_s) else None


class TimeGuard:
    """Rank 0's watch of the job's end: ``saved(seconds)`` after each save; sets ``stop_flag.reason`` to
    "time_limit" when the margin ``stop_margin_s`` asks for is reached."""

    def __init__(self, end: float, signal_delay_s: float, stop_flag: Any, out: TextIO = sys.stdout,
                 clock: Any = time.time) -> None:
        self.end, self.signal_delay_s, self.stop_flag, self.out, self.clock = end, signal_delay_s, stop_flag, out, clock
        self.save_s: Optional[float] = None
        self.fired = False
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="time-guard", daemon=True)

    def start(self) -> TimeGuard:
        self._thread.start()
        return self

    def saved(self, seconds: float) -> None:
        with self._cond:
            self.save_s = float(seconds)
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()

    def due_in(self) -> Optional[float]:
        """Seconds until the guard stops the run (None: it will not, as things stand)."""
        margin = stop_margin_s(self.signal_delay_s, self.save_s)
        return None if margin is None else self.end - margin - self.clock()

    def _run(self) -> None:
        with self._cond:
            while not self._closed:
                left = self.due_in()
                if left is None or left > 0:
                    self._cond.wait(left)
                    continue
                if self.stop_flag.reason is None:
                    self.stop_flag.reason = "time_limit"
                    self.fired = True
                    need = stop_margin_s(self.signal_delay_s, self.save_s)
                    print(f"launcher: the last checkpoint took {self.save_s:.0f} s, more than the "
                          f"{self.signal_delay_s:.0f} s the time-limit warning leaves (cluster.signal_delay_s): "
                          f"stopping {need:.0f} s before the time limit to save and requeue; set "
                          f"cluster.signal_delay_s={int(need) + 1} or more", file=self.out, flush=True)
                return


def start(backend: Any, job_id: Optional[str], signal_delay_s: float, stop_flag: Any) -> Optional[TimeGuard]:
    """Rank 0's guard, where the scheduler says when the job ends (None elsewhere: no end known)."""
    end = backend.job_end(job_id) if job_id else None
    return TimeGuard(end, signal_delay_s, stop_flag).start() if end is not None else None
