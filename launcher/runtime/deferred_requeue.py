"""A requeue that a rank asked for but could not finish, asked again from outside the job step.

On Slurm, once one rank of a step dies, srun ends every other process of the step
(``--kill-on-bad-exit``), and that includes the ``scontrol requeue`` child a surviving rank has just
started. So before a rank asks, it leaves a note: the run dir, its attempt, why. The batch script's
teardown line (``python -m launcher.runtime.deferred_requeue``) runs after srun returns, outside the
step. If the note's attempt is still the run's attempt and the run has not ended, it asks for the
requeue itself. If that fails too, it records the run as failed, with the reason. (A note left by an
earlier attempt of the same job id does nothing: its attempt is not the run's any more.)

No torch here: this runs in the batch script on the first node of the allocation.
"""
from __future__ import annotations

import os
import sys
from typing import Any, Dict, Optional

from launcher import backends
from launcher.archive import atomic
from launcher.backends.slurm import REQUEUE_NOTE_ENV
from launcher.rundir import RunDir
from launcher.status import Status

ENV = REQUEUE_NOTE_ENV  # the note's path, exported by the batch script (one per job id)


def leave(rd: RunDir, attempt: int, stop: Dict[str, Any], job_id: Optional[str]) -> bool:
    """Before a rank asks for a requeue: the note the teardown reads (False: this job has no teardown)."""
    path = os.environ.get(ENV)
    if not path:
        return False
    atomic.write_json(path, {"run": str(rd.path), "attempt": int(attempt), "stop": stop, "job_id": job_id})
    return True


def settle(note: Dict[str, Any], request: Any, already: Any = lambda job_id: False) -> Optional[str]:
    """What the teardown does with a note; ``request(job_id)`` asks the scheduler, ``already(job_id)``
    says whether the rank's own request went through before it was killed. Returns what was done
    (None: nothing was due)."""
    rd = RunDir(note["run"])
    st = rd.status()
    if st.is_final or int(st.attempt or 0) != int(note["attempt"]):
        return None
    stop = dict(note.get("stop") or {}, deferred=True)
    try:
        if not already(note.get("job_id")):
            request(note.get("job_id"))
    except Exception as e:
        why = f"{type(e).__name__}: {e} {getattr(e, 'stderr', '') or ''}".strip()
        rd.finish(Status.failed, exit_code=1, error=f"requeue refused: {why}", stop={**stop, "requeue_error": why})
        return "failed"
    rd.set_status(Status.requeued, stop=stop)
    return "requeued"


def main() -> int:
    path = os.environ.get(ENV)
    if not path or not os.path.exists(path):
        return 0
    note = atomic.read_json(path, default=None)
    os.unlink(path)
    if not note:
        return 0
    slurm = backends.get("slurm")
    done = settle(note, slurm.request_requeue, slurm.requeued_since_start)
    if done:
        print(f"launcher: the requeue rank {note['stop'].get('rank')} asked for was made after the step "
              f"ended: {done}", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
