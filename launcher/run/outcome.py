"""Settling runs: the outcome of a job that ended without recording one (killed, timed out, node lost).

The job records its own outcome (RunDir.finish). Where it could not, status.json still says pending
or running after the scheduler says the job ended; only the commands whose job is to settle runs
record the outcome then (the wait at the end of a launch, `launcher status`/`retry`/`results`,
preflight's rungs, `launcher cancel`). Listing and showing runs (`launcher runs`, `show`, `report`)
never write a run dir: they show the scheduler's word next to the recorded status. The same commands
seal a final run whose job left its seal due and has ended, where nothing after the job did.
"""
from __future__ import annotations

import sys
import time
from typing import Any, Dict, Iterable, List, Optional

from launcher.archive import atomic
from launcher.archive.registry import job_states
from launcher.backends import JobState
from launcher.features.elastic import resize as elastic
from launcher.run.rundir import RunDir, parse_iso
from launcher.run.status import RunStatus, Status


def record_lost_outcome(rd: RunDir, state: JobState, seen: Optional[RunStatus] = None) -> Status:
    """A job ended without recording its outcome: record the outcome its scheduler state implies (a
    clean exit that recorded nothing is a failure), then seal the run. A recorded outcome is kept, and
    so is a run that moved on since ``seen`` was read (cluster.elastic's job reopened it for a new job:
    both take the run's lock)."""
    with rd.seal_lock():
        now = rd.status()
        if now.is_final or (seen is not None and (now.state, now.attempt, now.job_id)
                            != (seen.state, seen.attempt, seen.job_id)):
            return now.state
        status = state.status if state.status in (Status.cancelled, Status.timeout) else Status.failed
        # tamper evidence is recorded but never sealed over (a new manifest would hide the change)
        lost = rd.lost_seal()
        if lost is None and state.status is Status.completed and not (rd.path / RunDir.STATUS).exists():
            # a job that ran to its end wrote its status first: none at all means it was removed since
            lost = (f"status.json missing although its job ran to its end (scheduler state {state.raw}): the run "
                    "dir does not hold what its job wrote; not sealed")
        elif lost is not None:
            lost = f"its records were removed after its job ran: {lost}"
        rd.finish(status, seal=lost is None, exit_code=None,
                  error=lost or f"job ended without recording an outcome (scheduler state {state.raw or '?'})")
        return rd.status().state


def _waits_on_purpose(st: RunStatus) -> bool:
    return st.state is Status.paused or elastic.waits_for_its_job(st.state.value, st.stop)


def settle(rd: RunDir, ended: bool = False) -> Status:
    """The run's outcome as recorded, or, for a job its scheduler says has ended without one, the
    outcome that state implies (recorded and sealed). ``ended``: the caller has seen the job end (its
    waiter returned), so a job the scheduler no longer knows or still calls live has failed. A run
    not submitted, or whose job still runs, keeps its recorded status."""
    return settle_all([rd], ended=ended)[0]


# a final run whose job the scheduler no longer knows is sealed once its outcome is this old: its ranks
# wrote their last records within it (a scheduler that cannot be asked says nothing of any job)
SEAL_UNKNOWN_AFTER_S = 600.0


def seal_now(due: bool, st: RunStatus, state: Optional[JobState], ended: bool, now: float) -> bool:
    """Whether the login side seals a run now (pure): its seal is due (the job left it: finish_in_job)
    and its job has ended: the caller saw it end, the scheduler says so, or neither it knows the job
    nor did the outcome come within SEAL_UNKNOWN_AFTER_S (a run never submitted: at once)."""
    if not due:
        return False
    if ended or (state is not None and state.ended):
        return True
    if state is not None:  # queued or running still: its ranks may be writing their last records
        return False
    when = parse_iso(st.ended or st.updated)
    return when is None or now - when >= SEAL_UNKNOWN_AFTER_S


def settle_all(rds: Iterable[RunDir], ended: bool = False) -> List[Status]:
    """``settle`` for many runs, with one scheduler query per backend. A final run whose seal its job
    left due is sealed here once the job has ended (seal_now): the fallback of the backend's seal
    after the job (docs/archive.md, "The seal"), so no run stays unsealed."""
    rds = list(rds)
    records = [rd.status() for rd in rds]
    due = [st.is_final and rd.seal_due() for rd, st in zip(rds, records)]
    jobs = [rd.job() if not st.is_final or d else None for rd, st, d in zip(rds, records, due)]
    states = job_states(j.to_json() for j in jobs if j is not None and j.job_id)
    # the outcomes and seals of a settle are flushed to disk once, together (a crash before loses them whole:
    # the next command settles those runs again), not with an fsync a file
    with atomic.deferred_sync():
        return [_settle_one(rd, st, job, d, states, ended) for rd, st, job, d in zip(rds, records, jobs, due)]


def _settle_one(rd: RunDir, st: RunStatus, job: Any, due: bool, states: Dict[str, JobState], ended: bool) -> Status:
    if due:
        state = states.get(job.job_id) if job is not None and job.job_id else None
        if seal_now(True, st, state, ended or job is None or not job.job_id, time.time()):
            try:
                rd.seal()
            except OSError as e:
                print(f"launcher: cannot seal {rd.path} ({e.strerror or e}); the next refresh tries again",
                      file=sys.stderr)
    # paused at a sweep's rung (sweep=asha), or cluster.elastic's (ended to grow, or to be restarted): its
    # job ended (or is held) on purpose, a decision resumes it (the rung's; the job queued after it)
    if st.is_final or _waits_on_purpose(st) or job is None or not job.job_id:
        return st.state
    state = states.get(job.job_id)
    if not (ended or (state is not None and state.ended)):
        return st.state
    try:
        return record_lost_outcome(rd, state or JobState(Status.failed, ""), seen=st)
    except OSError as e:  # a full disk, a read-only archive: the run stays as recorded, said once
        print(f"launcher: cannot record the outcome of {rd.path} ({e.strerror or e}); it stays "
              f"{st.state.value} until the outcome can be written", file=sys.stderr)
        return st.state
