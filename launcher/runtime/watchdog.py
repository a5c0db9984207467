"""Two watches in each rank, so that no rank waits in a collective until the process-group timeout.

- Peer failure: every failing rank records its error in the run dir's errors/ (RunDir.write_rank_error),
  a directory of its own that holds only the ranks that failed (and the cancel mark). The watch ends
  its own process as soon as another rank's error appears there, or the run is recorded cancelled
  (a rank blocked in a collective would otherwise wait for the process-group timeout). Slurm does the
  same through srun --kill-on-bad-exit; this also covers local runs. One look is one listing of that
  small directory (RunDir.alarm): its cost does not grow with the job; status.json is read only every
  STATUS_EVERY-th look (a cancel recorded without its mark, by an older launcher).
- Start-up (``train.startup_timeout_s``): before the first beat, when this rank has made no start-up
  progress (its process group up, its checkpoint verified) for that long, stuck in NCCL's init, a
  first collective or the resume (a hang there waited for the process group's timeout, or for ever
  outside a collective), it does what a hang does, below.
- Hang (``train.hang_timeout_s``): when this rank has finished no step for that long, it dumps every
  thread's Python stack (faulthandler) into stacks/. The first rank to dump claims the gathering
  (stacks/gatherer): it waits briefly for the other ranks' dumps (counting names, reading no file),
  reads them once and writes hang.json (which rank is stuck where, which collective the others wait
  in). Every other rank only dumps, then waits for hang.json (one stat a poll). Each then calls
  ``on_hang`` (which records the failure and asks for a requeue) before ending the process.

The hang watch looks at this rank's own clock every second; the peer watch looks at the (shared) run
dir every second, or less often for large jobs (``fs_poll_interval``: ~128 looks/s per job at most).
"""
from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
from typing import Any, Callable, Dict, Optional

from launcher.backends.base import STEP_START_ENV
from launcher.run.rundir import RunDir
from launcher.run.status import Status
from launcher.runtime import stacks

# the run dir's shared filesystem sees at most about this many watchdog looks per second from a job
# (every rank lists errors/): 1,024 ranks look every 8 s, not every 1 s
FS_READS_PER_S = 128.0
STATUS_EVERY = 16  # status.json read on every 16th look only (a cancel leaves its mark in errors/)
GATHER_POLL_S = 0.5  # the gatherer counts the dumps, the others look for hang.json, this often


def _step_start() -> Optional[float]:
    """When this attempt's processes were started, as whatever started them said (None: nothing did)."""
    try:
        return float(os.environ[STEP_START_ENV])
    except (KeyError, ValueError):
        return None


def fs_poll_interval(world: int, interval_s: float = 1.0) -> float:
    """Seconds between one rank's looks at the run dir: ``interval_s``, longer for large jobs."""
    return max(float(interval_s), float(world) / FS_READS_PER_S)


class Watch:
    def __init__(self, rd: RunDir, rank: int, world: int, hang_timeout_s: float = 0.0,
                 on_hang: Optional[Callable[[str], int]] = None, interval_s: float = 1.0,
                 startup_timeout_s: float = 0.0) -> None:
        self.rd, self.rank, self.world = rd, rank, world
        self.hang_timeout_s = float(hang_timeout_s)
        self.startup_timeout_s = float(startup_timeout_s)
        self._progress = time.monotonic()  # the last start-up progress (the watch's start, then progress())
        self._waited_s = self.hang_timeout_s  # the timeout that fired
        self.on_hang = on_hang
        self.interval_s = interval_s
        self.step: Optional[int] = None
        self._last: Optional[float] = None  # armed by the first beat (start-up may take long)
        # errors recorded before this attempt's processes were started are an earlier attempt's; not the
        # watch's own start: a peer that fails in its first second (a port in use) fails before a slower
        # rank gets here, and that rank would then wait in the rendezvous for ever
        self._born = _step_start() or time.time()
        self._looks = 0
        self.stop_event = threading.Event()

    def beat(self, step: Optional[int] = None) -> None:
        """The rank made progress (finished a step, or a long save/load)."""
        if step is not None:
            self.step = step
        self._last = time.monotonic()

    def progress(self) -> None:
        """Start-up progress (the process group up, the checkpoint verified): the start-up watch counts
        again from now. Once the first beat came, the hang watch alone counts."""
        self._progress = time.monotonic()

    def overdue(self, now: float) -> Optional[str]:
        """Which watch fired at ``now``: "hang" (no beat for hang_timeout_s since the last), "startup"
        (before the first beat, no progress for startup_timeout_s), or None."""
        if self._last is not None:
            return "hang" if 0 < self.hang_timeout_s < now - self._last else None
        return "startup" if 0 < self.startup_timeout_s < now - self._progress else None

    def set(self) -> None:  # (the old stop-event interface)
        self.stop_event.set()

    def start(self) -> Watch:
        threading.Thread(target=self._run, name="rank-watchdog", daemon=True).start()
        return self

    def _run(self) -> None:
        every = fs_poll_interval(self.world, self.interval_s)
        next_fs = time.monotonic() + every
        while not self.stop_event.wait(self.interval_s):
            fired = self.overdue(time.monotonic())
            if fired is not None:
                os._exit(self._hang(fired))
            if time.monotonic() < next_fs:
                continue
            next_fs = time.monotonic() + every
            why = self.look()
            if why is not None:
                print(f"[watchdog] rank {self.rank}: {why}", file=sys.stderr, flush=True)
                os._exit(1)

    def look(self) -> Optional[str]:
        """One look of the peer watch: why this rank should end now, or None."""
        self._looks += 1
        alarm = self.rd.alarm(except_rank=self.rank, since=self._born)
        if alarm is not None and alarm != "cancelled":
            return f"{alarm} failed; ending this rank too"
        if alarm == "cancelled" or (self._looks % STATUS_EVERY == 0
                                    and self.rd.status().state is Status.cancelled):
            # cancelled (launcher cancel, submit.wait_timeout_s): the outcome is recorded, and a rank
            # blocked in a collective would not see the interrupt until the process-group timeout
            return "the run was cancelled; ending this rank"
        return None

    # ---- hang ------------------------------------------------------------------------------------
    def _hang(self, fired: str = "hang") -> int:
        self._waited_s = self.startup_timeout_s if fired == "startup" else self.hang_timeout_s
        gatherer = self.dump_stack()
        finding = self.gather() if gatherer else self.await_finding()
        described = stacks.describe(finding) if finding is not None else \
            f"see {self.rd.STACK.split('/')[0]}/ (no {self.rd.HANG} was written)"
        if fired == "startup":
            message = (f"hang in start-up: no progress for {self._waited_s:.0f} s before the first step (the "
                       f"process group, a first collective or the resume; a start that is slow on purpose: "
                       f"raise train.startup_timeout_s, or call ctx.progress()): " + described)
        else:
            message = f"hang: no step finished for {self.hang_timeout_s:.0f} s after step {self.step}: " + described
        print(f"[watchdog] rank {self.rank}: {message}", file=sys.stderr, flush=True)
        return self.on_hang(message) if self.on_hang is not None else 1

    def _deadline(self) -> float:
        return time.monotonic() + min(15.0, max(3.0, self._waited_s))

    def dump_stack(self) -> bool:
        """This rank's stacks into stacks/rank_<r>.txt; whether it is the rank that gathers them."""
        path = self.rd.stack_path(self.rank)
        # written under a hidden name and renamed whole: the gatherer counts and reads only whole dumps (a
        # dump it read half-written showed a waiting rank's other threads only, and named it stuck)
        tmp = path.with_name(f".{path.name}.partial")
        try:
            f = open(tmp, "w")
        except FileNotFoundError:
            path.parent.mkdir(parents=True, exist_ok=True)
            f = open(tmp, "w")
        with f:
            f.write(f"# rank {self.rank}, " + ("no start-up progress" if self._last is None else "no step finished")
                    + f" for {self._waited_s:.0f} s (last finished step: {self.step})\n")
            issued = collectives_issued()
            if issued:
                f.write(stacks.counts_line(issued))
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
        os.replace(tmp, path)
        return self.rd.claim_gathering(self.rank)

    def gather(self) -> Dict[str, Any]:
        """The gatherer: every rank's dump (or the deadline), read once, into hang.json."""
        deadline = self._deadline()
        while self.rd.stack_count() < self.world and time.monotonic() < deadline:
            time.sleep(GATHER_POLL_S)
        finding = stacks.finding(self.rd.stacks(), self.world, self.step, self._waited_s)
        finding["phase"] = "startup" if self._last is None else "steps"  # which watch fired
        if self.rd.hang() is None and not self.rd.is_final():
            self.rd.write_hang(finding)
        return finding

    def await_finding(self) -> Optional[Dict[str, Any]]:
        """Any other rank: the gatherer's hang.json (None: it wrote none in time, dead or slow)."""
        deadline = self._deadline() + 5.0
        path = self.rd.path / self.rd.HANG
        while not path.exists() and time.monotonic() < deadline:
            time.sleep(GATHER_POLL_S)
        return self.rd.hang()


def collectives_issued() -> Dict[str, int]:
    """How many collectives this rank has issued on each of its process groups (torch.distributed's
    own count, the same on gloo and NCCL; read from this thread while the main one may be blocked in
    one). Empty where the process has no process group (or never imported torch: not imported here)."""
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is None or not dist.is_initialized():
            return {}
        c10d = dist.distributed_c10d
        default = c10d._get_default_group()
        out: Dict[str, int] = {}
        for pg, name in list(c10d._world.pg_names.items()):
            label = "world" if pg is default else str(name)
            out[label] = int(pg._get_sequence_number_for_group())
        return out
    except Exception:  # (a torch without these internals: the stacks alone then)
        return {}


def start(rundir: Any, rank: int, interval_s: float = 1.0, world: int = 1, hang_timeout_s: float = 0.0,
          on_hang: Optional[Callable[[str], int]] = None, startup_timeout_s: float = 0.0) -> Watch:
    """Start the watches for ``rank``; ``.set()`` on the result stops them, ``.progress()`` feeds the
    start-up watch and ``.beat(step)`` the hang watch."""
    rd = rundir if isinstance(rundir, RunDir) else RunDir(rundir)
    return Watch(rd, rank, world, hang_timeout_s, on_hang, interval_s, startup_timeout_s).start()
