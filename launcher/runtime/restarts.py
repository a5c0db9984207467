"""The requeue contract, on the node (no torch here).

A run lives in ONE run dir for its whole life; each start of its job in that dir is an attempt.

- Signals: Slurm (and submitit's local controller) send USR2 ``cluster.signal_delay_s`` before the time
  limit; Slurm sends TERM on preemption, ``scontrol requeue`` and ``scancel``. ``StopFlag`` records
  which arrived (chaining any handler installed before it, except submitit's own, whose job this
  takes over); the recipe polls ``ctx.should_stop()`` at each step boundary, where all ranks agree,
  save a checkpoint and stop (``Interrupted``).
- A time limit, a failed rank or a hang asks the backend for a requeue (``request_requeue``) while the
  restart budget lasts (``train.max_restarts`` restarts since launch or the last ``launcher resume``);
  Slurm requeues the same job id, submitit's local controller restarts the processes. A request that
  the step's teardown killed is made again after the step, and a step that ended with no rank's word
  (a rank killed in a way Python never saw, as NCCL's failures are) is requeued there too
  (``after_step``). Either way the
  job starts again in the same run dir and resumes from ``checkpoints/latest``.
- ``begin_attempt`` (rank 0, before the process group forms) records the restart in
  ``restarts.jsonl`` (when, why, from which step, on which nodes), moves what the last attempt left
  aside, and refuses to start once the budget is spent.
"""
from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any, Dict, Optional, Sequence

from launcher.archive import atomic
from launcher.backends.base import NOTE_ENV
from launcher.features.elastic import resize as elastic
from launcher.features.nodes import record as node_ledger
from launcher.run.rundir import RunDir
from launcher.run.status import Status
from launcher.runtime import job_start

# the reason each signal stands for, and the code ranks agree on (the highest wins)
SIGNAL_REASONS = {signal.SIGTERM: "preempted", signal.SIGUSR2: "time_limit"}
# ("grow": cluster.elastic's shrunk run ending its job at a checkpoint to grow back, launcher.features.elastic.regrow;
# the lowest: a signal's reason outranks it, and the scheduler's end of the job decides what follows)
STOP_CODES = {None: 0, "grow": 1, "preempted": 2, "time_limit": 3}
STOP_REASONS = {v: k for k, v in STOP_CODES.items()}


class Interrupted(Exception):
    """Raised by a recipe after it saved a checkpoint because the job was signalled."""

    def __init__(self, reason: str, step: int, why: str = "") -> None:
        super().__init__(f"{reason} at step {step} (checkpoint saved)")
        self.reason, self.step, self.why = reason, step, why  # why: what decided it (a straggler's line)

    def __reduce__(self):  # pickled back as it was (a job's result may carry it)
        return (Interrupted, (self.reason, self.step, self.why))


class AtRung(Exception):
    """Raised by the step loop at a rung of sweep=asha (launcher.features.asha.rungs) where the run does not go
    on: ``verdict`` "wait" (paused: checkpointed, its job ends, the rung's decision resumes it) or
    "pruned" (final). Nothing is wrong: the job ends cleanly."""

    def __init__(self, verdict: str, step: int) -> None:
        super().__init__(f"{verdict} at rung step {step}")
        self.verdict, self.step = verdict, step

    def __reduce__(self):  # pickled back as it was (a Hydra app's job returns it in its JobReturn)
        return (AtRung, (self.verdict, self.step))


class StopFlag:
    """Remembers the first stop signal; the step loop reads it at a boundary."""

    def __init__(self) -> None:
        self.reason: Optional[str] = None

    def install(self) -> StopFlag:
        for sig, reason in SIGNAL_REASONS.items():
            prev = signal.getsignal(sig)

            def handler(signum: int, frame: Any, prev: Any = prev, reason: str = reason) -> None:
                if self.reason is None or STOP_CODES[reason] > STOP_CODES[self.reason]:
                    self.reason = reason
                if callable(prev) and not str(getattr(prev, "__module__", "")).startswith("submitit"):
                    prev(signum, frame)

            signal.signal(sig, handler)
        job_start.replay()  # what arrived while the job started (launcher.runtime.job_start)
        return self


def begin_attempt(rd: RunDir, max_restarts: int, job_id: Optional[str], *, world: Optional[int] = None,
                  hosts: Optional[Sequence[str]] = None) -> int:
    """Rank 0, before the others can read the run dir's state: the number of this attempt (1 = first
    start). Moves what the previous attempt left aside (``world``, ``hosts``: this attempt's, so that
    the records of ranks and nodes it lacks go too: RunDir.move_aside). Records the restart that led
    here; raises RuntimeError once the restart budget is spent."""
    st = rd.status()
    prev = int(st.attempt or 0)
    attempt = prev + 1
    if prev:
        rd.move_aside(prev, world=world, hosts=hosts)
        stop = st.stop or {}
        latest = rd.latest_checkpoint()
        if not st.resumed:  # launcher resume recorded its own row
            reason = stop.get("reason") or "scheduler"
            rd.record_restart({
                "attempt": attempt, "reason": reason,
                "detail": stop.get("detail") or ("the scheduler restarted the job (a preemption, a node failure "
                                                 "or a requeue) without a request from the run"),
                # a stop signal or a pause is no rank's failure: it names no failed rank
                "failed_step": stop.get("step"),
                "failed_rank": None if reason in SIGNAL_REASONS.values() or reason == "grow" else stop.get("rank"),
                "from_step": RunDir.checkpoint_step(latest) if latest else 0,
                "nodes": st.hosts, "job_id": job_id,
                **({"excluded": stop["excluded"]} if stop.get("excluded") else {}),  # nodes this attempt left out
                **({"failure": stop["failure"]} if stop.get("failure") else {}),  # restart_policy reads it
            })
        if rd.restarts_since_launch() > max_restarts:
            msg = (f"restart budget spent: {rd.restarts_since_launch()} restarts (train.max_restarts={max_restarts}); "
                   f"last stop: {stop.get('reason') or 'scheduler'} {stop.get('detail') or ''}".strip())
            rd.finish_in_job(Status.failed, exit_code=1, error=msg, attempt=attempt)
            raise RuntimeError(msg)
    rd.set_status(Status.running, attempt=attempt, stop=None, resumed=None)
    return attempt


def leave_note(rd: RunDir, attempt: int, stop: Optional[Dict[str, Any]], job_id: Optional[str], *,
               backend: Optional[str] = None, max_restarts: Optional[int] = None) -> bool:
    """The job's note for the step's teardown (launcher.runtime.after_step; False: this job has no
    teardown): rank 0 at the start of an attempt (``stop`` None: the run, the attempt, the budget);
    a rank asking for a requeue adds why."""
    path = os.environ.get(NOTE_ENV)
    if not path:
        return False
    note = atomic.read_json(path, default=None) or {}
    if note.get("run") != str(rd.path) or int(note.get("attempt") or 0) != int(attempt):
        note = {}  # an earlier attempt's note (or none): this one starts afresh
    note.update({"run": str(rd.path), "attempt": int(attempt), "job_id": job_id})
    note.setdefault("started", time.time())
    if backend is not None:
        note["backend"] = backend
    if max_restarts is not None:
        note["max_restarts"] = int(max_restarts)
    if stop is not None:
        note["stop"] = stop
    atomic.write_json(path, note)
    return True


def budget_left(rd: RunDir, max_restarts: int) -> bool:
    """Whether train.max_restarts allows another automatic restart."""
    return rd.restarts_since_launch() < max_restarts


def requeue_leaving_out(rd: RunDir, backend: Any, job_id: Optional[str], stop: Dict[str, Any]) -> None:
    """The backend's requeue; without the nodes the next attempt leaves out (this run's failed nodes
    and the ledger's excluded ones, launcher.features.nodes) where there are any and the backend can
    (recorded in ``stop``)."""
    try:
        cfg = rd.config() or {}
        part = (cfg.get("cluster") or {}).get("partition")
        left_out = node_ledger.for_requeue(cfg, rd, backend.partition_nodes(str(part) if part else None))
        if left_out.nodes and backend.requeue_without(job_id, left_out.nodes, rd.path):
            print(f"launcher: the next attempt is {left_out.why}", file=sys.stderr, flush=True)
            stop["excluded"] = list(left_out.nodes)
            return
    except Exception as e:  # the requeue goes on without it: the scheduler may place it on the same nodes
        print(f"launcher: the requeued job leaves no node out ({type(e).__name__}: {e})", file=sys.stderr,
              flush=True)
    backend.request_requeue(job_id)


def request_requeue(rd: RunDir, backend: Any, *, attempt: int, max_restarts: int, reason: str, detail: str,
                    rank: int, step: Optional[int], job_id: Optional[str],
                    failure: Optional[Dict[str, Any]] = None) -> bool:
    """Ask the backend to start the job again (False: the budget is spent, the run should fail).
    The first rank of an attempt to ask does it; later ones only learn that it was done. ``failure``:
    the exception's record (launcher.runtime.restart_policy), kept for the next attempt."""
    if not budget_left(rd, max_restarts) or rd.is_final():  # a cancelled run is never started again
        return False
    marker = rd.attempt_dir(attempt) / "requeue"
    marker.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return True
    os.close(fd)
    stop: Dict[str, Any] = elastic.mark({"reason": reason, "detail": detail, "rank": rank, "step": step}, os.environ)
    if failure:
        stop["failure"] = failure
    noted = leave_note(rd, attempt, stop, job_id)
    try:
        requeue_leaving_out(rd, backend, job_id, stop)
    except Exception as e:  # e.g. a partition that forbids requeues: the run fails, saying why
        if noted and getattr(e, "returncode", 0) < 0:  # the request was killed with the step: the
            rd.set_status(Status.requeued, stop={**stop, "deferred": True})  # teardown asks again
            return True
        rd.set_status(Status.running, stop={**stop, "requeue_error": f"{type(e).__name__}: {e}"})
        return False
    rd.set_status(Status.requeued, stop=stop)
    return True
