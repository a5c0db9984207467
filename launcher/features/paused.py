"""A point of a scheduled sweep (sweep=asha, sweep=pbt) on the node, as both schedulers' node halves
see it: its index, its backend, and its pause at a boundary (an ASHA rung, a PBT generation)."""
from __future__ import annotations

import sys
from typing import Any, Callable, Optional

from launcher import backends
from launcher.run.rundir import RunDir
from launcher.run.status import Status


def point_of(rd: RunDir) -> int:
    """The point's index in its sweep (its run dir's name)."""
    return int(rd.path.name)


def backend_of(rd: RunDir) -> Any:
    return backends.get(rd.backend_name())


def pause_point(rd: RunDir, detail: str, step: int, job_id: Optional[str]) -> None:
    """Rank 0 of a point at a scheduler's boundary (an ASHA rung, a PBT generation): the run recorded
    ``paused`` (``detail``: where) and its job ended by the backend, kept to be resumed or dropped."""
    rd.set_status(Status.paused, stop={"reason": "rung", "detail": detail, "rank": 0, "step": step})
    backend_of(rd).pause(job_id)


def recorded(what: str, write: Callable[..., Any], *args: Any, **kwargs: Any) -> bool:
    """Write the record of a scheduler's decision or of an action on a point's job. A record that cannot
    be written (a full disk, a read-only file) never stops the action it records: said on stderr, and
    the sweep's next refresh (`launcher status`) settles the points it names. False: not written."""
    try:
        write(*args, **kwargs)
        return True
    except OSError as e:
        print(f"launcher: {what} was not recorded ({e.strerror or e}); the decision is carried out all "
              "the same, and `launcher status SWEEP` settles what it left", file=sys.stderr, flush=True)
        return False


def drop_held(rd: RunDir, job_id: Optional[str], who: str) -> bool:
    """The held job of a point that ended while paused (pruned, or a promotion that failed): dropped from
    the queue, where nothing would ever release it. False (said): it could not be dropped."""
    try:
        backend_of(rd).drop_paused(job_id)
        return True
    except Exception as e:
        print(f"launcher: the paused job {job_id} of {who} was not dropped ({type(e).__name__}: {e}); "
              "`launcher cancel SWEEP` drops it", file=sys.stderr, flush=True)
        return False


def release(rd: RunDir, job_id: Optional[str], who: str, act: str, stop: dict, failure: str) -> None:
    """A paused point the decision lets go on (an ASHA promotion, a PBT generation's release): recorded
    ``requeued`` first (the resumed job's own ``running`` must not be overwritten; a record that cannot be
    written never keeps it held), then released by its backend. A release refused ends the point
    ``failed`` (``failure``, then the backend's words) and drops its held job."""
    recorded(f"{who}'s {act}", rd.set_status, Status.requeued, stop=stop)
    try:
        backend_of(rd).resume_paused(job_id)
    except Exception as e:  # the point cannot go on: it ends, saying why, and its held job goes
        why = f"{type(e).__name__}: {e} {getattr(e, 'stderr', '') or ''}".strip()
        recorded(f"{who}'s failed {act}", rd.finish_in_job, Status.failed, exit_code=1, error=f"{failure}: {why}")
        drop_held(rd, job_id, who)
