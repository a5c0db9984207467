"""The run's outcome decided after the job step, outside the ranks (the batch script's teardown).

Ranks record their own outcome when Python sees the failure (a raised error, the hang watch, a
signal). On NCCL many failures never reach Python: a rank killed by the OOM killer, a segfault or a
lost node leaves its peers blocked in a CUDA wait until srun's ``--kill-on-bad-exit`` or
ProcessGroupNCCL's teardown ends them in C++, and no handler runs. So every job leaves a note
(``leave``): rank 0 at the start of each attempt (the run dir, the attempt, the restart budget), and a
rank that asks for a requeue (why). The batch script's teardown line
(``python -m launcher.runtime.after_step "$rc"``) runs after srun returns, on the first node, and
``decide`` (pure) turns the note, the run's status, srun's exit status and the scheduler's word on
the job into one of:

- nothing: the run has its outcome, a rank's requeue went through, the scheduler is ending or
  requeueing the job itself (cancel, time limit, node failure), or the note is an earlier attempt's;
- requeue: a rank asked but its ``scontrol requeue`` died with the step (asked again), or no rank
  recorded anything and the step failed ("a rank died without a word"), within train.max_restarts;
- fail: the same silent death repeated the previous attempt's before any new step
  (restart_policy), the restart budget is spent, or the step exited 0 with no outcome recorded.

``settle`` carries it out through the backend (its requeue, whether the job was requeued already,
its state now). A final run's seal, left due by the ranks, is then handed to the backend
(``arrange_seal``: Slurm seals it in a one-node job after this one, off the allocation). No torch here.
"""
from __future__ import annotations

import os
import signal
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, Optional

from launcher import backends
from launcher.archive import atomic
from launcher.features.asha import rungs
from launcher.features.elastic import resize as elastic
from launcher.features.nodes import record as node_ledger
from launcher.run.rundir import RunDir
from launcher.run.status import RunStatus, Status
from launcher.runtime import restart_policy, restarts
from launcher.runtime.restart_policy import Failure

ENV = restarts.NOTE_ENV  # the note's path, exported by the batch script (one per job id)
# the scheduler's words for a job whose step may still be judged here: anything else (CANCELLED,
# TIMEOUT, NODE_FAIL, PREEMPTED, REQUEUED, PENDING...) is the scheduler's own decision
STILL_RUNNING = ("", "RUNNING", "COMPLETING", "CONFIGURING", "SUSPENDED")


# the note: rank 0 writes it at the start of each attempt, a rank asking for a requeue adds why
leave = restarts.leave_note


@dataclass(frozen=True)
class StepEnd:
    """What the teardown knows about the step that just ended."""

    rc: int  # the step's exit status (a signal N as 128+N)
    scheduler_state: str = ""  # the scheduler's word for the job now ("": unknown)
    source: str = "the step"  # whose exit status it is, in words (the backend's step_word)


@dataclass(frozen=True)
class Outcome:
    action: str  # "nothing" | "requeue" | "fail"
    why: str
    stop: Dict[str, Any] = field(default_factory=dict)  # status.json's stop (requeue) or the failure's fields (fail)

    def to_json(self) -> Dict[str, Any]:
        return asdict(self)


def describe(rc: int, source: str = "the step") -> str:
    """An exit status in words: the signal that ended a task where it says one."""
    if rc > 128:
        try:
            return f"{source} exit {rc} ({signal.Signals(rc - 128).name})"
        except ValueError:
            pass
    return f"{source} exit {rc}"


WORDLESS = "a rank died without a word"


def decide(st: RunStatus, note: Dict[str, Any], end: StepEnd, *, restarts_used: int, max_restarts: int,
           previous: Optional[Failure] = None, step: Optional[int] = None, from_step: int = 0) -> Outcome:
    """What follows a step (pure). ``st``: the run's status now; ``note``: the job's note; ``restarts_used``:
    restarts since launch; ``previous``: the failure that ended the attempt before this one; ``step``: the
    last step this attempt finished (None: none); ``from_step``: the checkpoint step it started from."""
    attempt = int(note.get("attempt") or 0)
    if st.is_final:
        return Outcome("nothing", f"the run has its outcome ({st.state.value})")
    if int(st.attempt or 0) != attempt:
        return Outcome("nothing", f"the note is attempt {attempt}'s, the run is at attempt {st.attempt}")
    asked = note.get("stop")
    if asked:  # a rank asked for the requeue (its budget checked): its request may have died with the step
        if st.state in (Status.running, Status.requeued):
            return Outcome("requeue", "a rank asked for a requeue before the step ended", {**asked, "deferred": True})
        return Outcome("nothing", f"the run is {st.state.value}")
    if st.state is not Status.running:  # a rank's requeue went through, or a stop left to the scheduler
        return Outcome("nothing", f"the run is {st.state.value}")
    word = (end.scheduler_state or "").split()[0].rstrip("+").upper() if end.scheduler_state else ""
    if word not in STILL_RUNNING:
        return Outcome("nothing", f"the scheduler ends the job itself ({word})")
    if end.rc == 0:
        return Outcome("fail", "the step exited 0, but no rank recorded an outcome", {"exit_code": 1})
    words = describe(end.rc, end.source)
    detail = f"{WORDLESS}: {words}"
    failure = Failure(type="RankLost", message=words, place="", kind="rank_lost", attempt=attempt, step=step,
                      from_step=from_step)
    decision = restart_policy.decide(failure, previous)
    if not decision.restart:
        return Outcome("fail", f"{detail} (not restarted: {decision.why})",
                       {"exit_code": end.rc, "no_restart": decision.to_json()})
    if restarts_used >= max_restarts:
        return Outcome("fail", f"{detail}; restart budget spent ({restarts_used} restarts, "
                               f"train.max_restarts={max_restarts})", {"exit_code": end.rc})
    return Outcome("requeue", detail, {"reason": "failure", "detail": detail, "rank": None, "step": step,
                                       "failure": failure.to_json(), "decided": "after the step"})


def judge(rd: RunDir, note: Dict[str, Any], end: StepEnd) -> Outcome:
    """``decide`` on what the run dir says (its status, restarts, metrics) for this note."""
    st = rd.status()
    attempt = int(note.get("attempt") or 0)
    from_step, previous = restart_policy.start_of(rd, attempt)
    step = restart_policy.last_logged_step(rd, since=float(note.get("started") or 0))
    max_restarts = note.get("max_restarts")
    if max_restarts is None:
        max_restarts = int((rd.config().get("train") or {}).get("max_restarts", 0))
    return decide(st, note, end, restarts_used=rd.restarts_since_launch(), max_restarts=int(max_restarts),
                  previous=previous, step=step, from_step=from_step)


# how a task that a node's fault can end ends, in the step launcher's words (not SIGABRT: NCCL's teardown aborts the
# ranks a lost peer left behind; not SIGTERM: the scheduler's; not an exit code: Python's own word)
CRASHES = ("Killed", "Segmentation fault", "Bus error", "Illegal instruction")


def note_crashes(rd: RunDir, backend: Any, job_id: Optional[str], note: Dict[str, Any], step: Optional[int]) -> int:
    """A step no rank said a word about: each rank the scheduler saw killed or crash (its step launcher's
    word, with its node) is noted in the node ledger against its node, so the requeue leaves that node out; how many."""
    cfg = rd.config() or {}
    noted = 0
    for node, task, how in backend.step_deaths(job_id):
        if how.startswith(CRASHES):
            noted += node_ledger.note(cfg, rd, node, "crashed", attempt=int(note.get("attempt") or 0), job_id=job_id,
                                      rank=task, step=step,
                                      detail=f"rank {task} ended: {how}, without a word ({backend.step_word}'s)") \
            is not None
    return noted


def settle(rd: RunDir, outcome: Outcome, backend: Any, job_id: Optional[str]) -> Optional[str]:
    """Carry out ``outcome`` (the backend's requeue); returns what was done (None: nothing)."""
    if outcome.action == "fail":
        extra = dict(outcome.stop)
        rd.finish_in_job(Status.failed, exit_code=int(extra.pop("exit_code", 1) or 1), error=outcome.why, job_id=job_id,
                  **extra)
        return "failed"
    if outcome.action != "requeue":
        return None
    # recorded first: the scheduler's requeue ends this script too (KillWait after its TERM)
    stop = elastic.mark(outcome.stop, os.environ)
    rd.set_status(Status.requeued, stop=stop)
    try:
        if not backend.requeued_since_start(job_id):  # the rank's own request went through before the kill
            restarts.requeue_leaving_out(rd, backend, job_id, stop)  # (the nodes of the ranks that crashed)
            if stop.get("excluded"):
                rd.set_status(Status.requeued, stop=stop)
    except Exception as e:
        why = f"{type(e).__name__}: {e} {getattr(e, 'stderr', '') or ''}".strip()
        rd.finish_in_job(Status.failed, exit_code=1, error=f"requeue refused: {why} ({outcome.why})",
                  stop={**outcome.stop, "requeue_error": why})
        return "failed"
    return "requeued"


def drop_requeued_job(rd: RunDir, backend: Any, job_id: Optional[str]) -> bool:
    """A run that is final while its job was requeued since it started (a point that ended at its
    ASHA pause's ``requeuehold``, a cancel racing a requeue): nothing will run in that job again, so it
    leaves the queue now instead of waiting there, held, for ever. True: it was dropped."""
    try:
        if rd.is_final() and job_id and backend.requeued_since_start(job_id):
            backend.drop_paused(job_id)
            return True
    except Exception as e:
        print(f"launcher: the requeued job {job_id} of ended run {rd.path} was not dropped ({type(e).__name__}: "
              f"{e})", file=sys.stderr, flush=True)
    return False


def arrange_seal(rd: RunDir, backend: Any, job_id: Optional[str], folder: Path) -> Optional[str]:
    """A final run whose seal is due (the ranks never seal, RunDir.finish_in_job): sealed here, after the
    step, when the job holds one node; otherwise the backend seals it once this job has ended, off the
    allocation (Slurm: a one-node job after this one); returns what
    will seal it, or None: nothing due, or not arranged (the login side's next refresh seals it,
    launcher.run.outcome)."""
    if not rd.seal_due():
        return None
    try:
        if backend.place(os.environ).num_nodes <= 1:
            # one node held: hashing it here holds what a seal job would take, without a trip
            # through the queue (a 100-task array would submit 100 more jobs)
            from launcher.runtime.seal import seal_if_due

            return "this job's teardown" if seal_if_due(rd) else None
        return backend.seal_after_job(rd.path, job_id, folder)
    except Exception as e:  # the login side seals it; the job's end is not the place to fail
        print(f"launcher: the seal of {rd.path} was not arranged ({type(e).__name__}: {e}); the next "
              "`launcher status` seals it", file=sys.stderr, flush=True)
        return None


def main(argv: Optional[list] = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    path = os.environ.get(ENV)
    if not path or not os.path.exists(path):
        return 0
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the requeue's TERM: the record is finished first
    note = atomic.read_json(path, default=None)
    os.unlink(path)
    if not note or not note.get("run"):
        return 0
    rc = int(args[0]) if args and args[0].lstrip("-").isdigit() else 1
    rd = RunDir(note["run"])
    backend = backends.get(str(note["backend"])) if note.get("backend") else backends.running()
    if backend is None:  # a note from no job of any backend's: nobody to ask about its state
        print(f"launcher: after the step: {path} names no backend and this is no backend's job", file=sys.stderr)
        return 0
    job_id = note.get("job_id")
    if not rd.is_final():  # the common end is final already (a rank recorded the outcome): nothing to ask
        outcome = judge(rd, note, StepEnd(rc, backend.job_state_now(job_id), source=backend.step_word))
        if outcome.why.startswith(WORDLESS):  # (decide's requeue or failure of a step no rank spoke of)
            note_crashes(rd, backend, job_id, note, (outcome.stop.get("failure") or {}).get("step"))
        done = settle(rd, outcome, backend, job_id)
        if done:
            said = describe(rc, backend.step_word)
            print(f"launcher: after the step ({said}): {done}: {outcome.why}", file=sys.stderr, flush=True)
        if done == "failed":  # ended here (a rank that records an outcome drops its job itself: Attempt.end)
            drop_requeued_job(rd, backend, job_id)
    try:  # sweep=asha: a point that ended short of its next rung must not hold the rung up
        rungs.on_end(rd)
    except Exception as e:
        print(f"launcher: the rungs were not decided after this run ended ({type(e).__name__}: {e})",
              file=sys.stderr, flush=True)
    sealer = arrange_seal(rd, backend, job_id, Path(path).parent)
    if sealer:
        print(f"launcher: {rd.path} is sealed by {sealer}" if sealer.startswith("this") else
              f"launcher: {rd.path} is sealed by job {sealer} once this job has ended", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
