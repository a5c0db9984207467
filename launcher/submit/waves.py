"""Waves: a sweep larger than the scheduler's room, queued in parts by its own jobs (no daemon).

A launch queues the points that fit the room now (the controller's MaxJobCount, the user's
MaxSubmitJobs of the association and QOS: Backend.array_limits), less one slot. The rest are staged and
published like any run, recorded ``waiting``, and listed in ``<sweep>/waves.json`` (WavePlan). The slot
kept is the wave job's: one node, one task, queued after the wave's arrays have all ended (afterany),
in their account, partition and QOS. It runs ``python -m launcher.submit.waves SWEEP_DIR``: reads the
room then, queues the next points that fit (each a RunTask of its run dir, in arrays as a launch makes
them) and its own successor while points wait.

- ``launcher cancel SWEEP`` records the waiting runs cancelled and cancels the wave job (``cancel``).
- A launch interrupted mid-wave (SIGTERM, SIGHUP, Ctrl-C) keeps the arrays it queued, puts the runs it
  had not queued back to waiting and queues the wave job before it exits (``queue_launch``); a killed one
  is repaired by the next command (launcher.submit.interrupted, ``repaired``).
- No run is queued twice: a run leaves ``waiting`` (its job.json written, status pending) under the
  sweep's waves lock, and only a run still ``waiting`` is queued.
"""
from __future__ import annotations

import os
import socket
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, List, Optional, Sequence, Tuple

from launcher import backends
from launcher.run.rundir import SweepDir, now_iso
from launcher.run.status import Status
from launcher.run.waves_record import Wave, WavePlan
from launcher.submit import signals, submission
from launcher.sweeps import TooManyJobs, Unschedulable, job_name

RETRY_BEGIN = "now+60"  # a wave job that finds no room queues its successor to look again this much later
SCOPE = submission.SUBMIT_SCOPE


def allowed(cfg: Any) -> bool:
    """Whether a launch of this config may be queued in waves: submit.waves, a backend that has them, and
    a launch that does not wait for its runs (submit.wait=true, a sweeper that needs every result: it
    would wait for the first wave alone, so such a sweep is refused whole)."""
    return bool(cfg.submit.get("waves", True)) and not cfg.submit.get("wait") and backends.of(cfg).waves


def scope_of(cfg: Any) -> dict:
    cl = cfg.cluster
    return {k: str(cl.get(k)) for k in SCOPE if cl.get(k)}


# ---- the launch's side ----------------------------------------------------------------------------


def begin(sd: SweepDir, waiting: Sequence[int], backend: str) -> None:
    """Before the first wave is queued: the runs past the room recorded ``waiting`` (staged: they are
    published with the others) and the plan written."""
    for i in waiting:
        sd.staging(i).set_status(Status.waiting)
    sd.write_waves(WavePlan(waiting=tuple(sorted(waiting)), backend=backend,
                            launch=(socket.gethostname(), os.getpid())))


def unsent(sd: SweepDir) -> Callable[[List[Any], str], None]:
    """What an interrupted launch does with the runs it had not queued: back to waiting, for the wave job."""
    def back(runs: List[Any], _why: str) -> None:
        for r in runs:
            r.staged.set_status(Status.waiting)
        with sd.waves_lock():
            plan = sd.waves() or WavePlan()
            more = [SweepDir.index_of(r.run_id) for r in runs]
            sd.write_waves(replace(plan, waiting=tuple(sorted(set(plan.waiting) | set(more)))))
    return back


def queue_launch(sd: SweepDir, cfg: Any, submit: Callable[[], Tuple[List[Any], List[str]]]) -> Tuple[list, list]:
    """A waves launch's submission: ``submit()`` (the first wave), then the wave job queued after it,
    also when the launch is interrupted (the runs it queued stay queued; the rest wait)."""
    try:
        runs, job_ids = submit()
    except KeyboardInterrupt:
        with signals.shielded():  # what it queued (published in sweep.json) is the first wave
            sent = sd.read() or {}
            job = _after(sd, cfg, sent.get("job_ids", []), "launch (interrupted)",
                         [SweepDir.index_of(r) for r in sent.get("runs", [])])
        print(f"launch interrupted: the runs not queued wait for the sweep's wave job {job} "
              f"(launcher cancel {sd.sweep_id} stops them)", file=sys.stderr)
        raise
    except submission.SubmissionRefused as e:
        stop(sd, f"the first wave was refused ({e})")
        raise
    with signals.shielded():  # an interrupt now lands once the wave job is queued and recorded
        _after(sd, cfg, job_ids, "launch", [SweepDir.index_of(r.run_id) for r in runs])
    return runs, job_ids


def _after(sd: SweepDir, cfg: Any, job_ids: Sequence[str], by: str, runs: Sequence[int] = ()) -> Optional[str]:
    """The wave job queued after ``job_ids`` and recorded (with the wave they are, when ``runs``)."""
    with sd.waves_lock():
        plan = sd.waves() or WavePlan()
        try:
            job: Optional[str] = backends.of(cfg).wave_job(sd.path, list(job_ids), sd.submitit_folder, scope_of(cfg),
                                                           begin=None if job_ids else "now")
        except RuntimeError as e:  # what was queued runs; the rest wait for the next `launcher runs` to queue one
            print(f"launch: warning: the sweep's wave job was refused ({e}); its {len(plan.waiting)} waiting run(s) "
                  "wait until `launcher runs` queues one", file=sys.stderr)
            job = None
        if runs:
            plan = plan.queued(Wave(tuple(job_ids), tuple(runs), now_iso(), by), list(plan.waiting), job)
        sd.write_waves(replace(plan, job_id=job))
    return job


def stop(sd: SweepDir, why: str) -> None:
    """No more waves: every waiting run recorded failed "not submitted" (launcher retry --failed queues
    them again), the plan says why."""
    with sd.waves_lock():
        plan = sd.waves()
        if plan is None:
            return
        _stop_held(sd, plan, why)


def cancel(sd: SweepDir) -> Optional[str]:
    """``launcher cancel SWEEP``: the wave job cancelled (the waiting runs are cancelled with the others);
    what was done, or None when the sweep has no waves."""
    with sd.waves_lock():
        plan = sd.waves()
        if plan is None or plan.stopped or not (plan.waiting or plan.job_id):
            return None
        if plan.job_id:
            backends.get(plan.backend).cancel_helper(plan.job_id, "waves")
        sd.write_waves(replace(plan, waiting=(), job_id=None, stopped="cancelled by user"))
    return f"its wave job {plan.job_id} cancelled: no more waves" if plan.job_id else "no more waves"


def repaired(sd: SweepDir, back: Sequence[int] = ()) -> Optional[str]:
    """A sweep's waves after a launch or a wave job was killed (SIGKILL, a lost node: launcher runs asks):
    the runs ``back`` (staged, never queued) put back to waiting, and a wave job queued at once when runs
    wait and none is queued or running. What was done, or None."""
    from launcher.backends.local import pid_alive

    plan = sd.waves()
    if plan is None or plan.stopped or not (plan.waiting or back):
        return None
    if not back and plan.job_id is None and not plan.waves and plan.launch is not None \
            and plan.launch[0] == socket.gethostname() and pid_alive(plan.launch[1]):
        return None  # its launch is still queueing the first wave
    with sd.waves_lock():
        plan = sd.waves() or plan
        backend = backends.get(plan.backend)
        if plan.job_id:
            state = backend.states([{"job_id": plan.job_id, "backend": plan.backend}]).get(plan.job_id)
            if state is not None and not state.ended:  # queued or running: it queues them
                return None
        # a wave job killed between taking its runs out of waiting and recording their jobs: back too
        back = [*back, *(i for i in plan.waiting if sd.run(i).exists() and sd.run(i).job() is None
                         and sd.run(i).status().state is Status.pending)]
        for i in back:
            (sd.staging(i) if sd.staging(i).path.exists() else sd.run(i)).set_status(Status.waiting)
        plan = replace(plan, waiting=tuple(sorted(set(plan.waiting) | set(back))))
        cfg = _run_of(sd, plan.waiting[0]).cfg if sd.run(plan.waiting[0]).exists() else None
        scope = scope_of(cfg) if cfg is not None else {}
        sd.write_waves(replace(plan, job_id=None))
        try:
            job = backend.wave_job(sd.path, [], sd.submitit_folder, scope, begin="now")
        except RuntimeError as e:  # the queue is full now: the next command tries again
            return (f"sweep {sd.sweep_id}: {len(plan.waiting)} run(s) wait and no wave job is queued; queueing one "
                    f"was refused ({e}); the next `launcher runs` tries again")
        sd.write_waves(replace(plan, job_id=job))
    return f"sweep {sd.sweep_id}: {len(plan.waiting)} run(s) wait and no wave job was queued: wave job {job} queued"


# ---- the wave job's side --------------------------------------------------------------------------


def _run_of(sd: SweepDir, i: int, plain: Optional[dict] = None) -> submission.Run:
    """Run ``i`` as submission takes it (``plain``: its config.yaml, when the caller has read it)."""
    from launcher.config.schema import typed  # the wave job builds each run's config as resume does
    from launcher.runtime.task import RunTask

    rd = sd.run(i)
    return submission.Run(run_id=sd.run_id(i), rundir=rd, task=RunTask(str(rd.path)),
                          cfg=typed(rd.config() if plain is None else plain),
                          code_dir=sd.code_dir, folder=sd.submitit_folder, shared=sd.shared(),
                          num_tasks=rd.layout().world_size)


def queue_next(sd: SweepDir, by: str) -> str:
    """The wave job: the next runs that fit the room queued, and the job that queues the ones after;
    what was done, in a line."""
    from launcher.archive import registry, secrets

    with sd.waves_lock():
        plan = sd.waves()
        if plan is None or plan.stopped:
            return f"sweep {sd.sweep_id}: no waves to queue ({plan.stopped if plan else 'no waves.json'})"
        waiting = [i for i in plan.waiting if sd.run(i).status().state is Status.waiting]
        if not waiting:
            sd.write_waves(replace(plan, waiting=(), job_id=None))
            return f"sweep {sd.sweep_id}: no run waits"
        plains = {waiting[0]: sd.run(waiting[0]).config()}
        first = _run_of(sd, waiting[0], plains[waiting[0]])
        # only as many runs as could fit are built (a typed config each): not every waiting run of a 10,000-point sweep
        fit = backends.of(first.cfg).array_limits(first.cfg).room
        # (one more than fits, where more wait: arrays() then keeps the next wave job's slot)
        plains.update((i, sd.run(i).config()) for i in waiting[1:int(min(fit + 1, len(waiting)))])
        runs = [first] + [_run_of(sd, i, plains[i]) for i in list(plains)[1:]]
        left: List[submission.Run] = []
        try:
            planned = submission.arrays(runs, cfg=lambda r: r.cfg, left=left)
        except TooManyJobs:  # not even one run and the next wave job fit now
            planned, left = [], runs
        except Unschedulable as e:  # the cluster changed since the launch (a partition gone, ...)
            why = f"the scheduler refuses the next wave: {str(e).splitlines()[0]}"
            _stop_held(sd, plan, why)
            return f"sweep {sd.sweep_id}: waves stopped: {why}"
        cfg = runs[0].cfg
        backend = backends.of(cfg)
        if not planned:
            job = backend.wave_job(sd.path, [], sd.submitit_folder, scope_of(cfg), begin=RETRY_BEGIN)
            sd.write_waves(replace(plan, job_id=job))
            return f"sweep {sd.sweep_id}: no room in the queue now; wave job {job} looks again ({RETRY_BEGIN})"
        known = secrets.known_secrets(list(plains.values()))  # (the candidates' own)

        def publish(sent: List[submission.SubmittedRun], job_ids: List[str]) -> None:
            sd.extend({"job_ids": job_ids, "runs": [r.run_id for r in sent]})
            registry.record(sd.path.parent, [r.rundir.path for r in sent])

        name = job_name([str(r.cfg.submit.job_name) for r in runs], sd.sweep_id)
        for r in (r for arr in planned for r in arr.points):  # out of waiting before its job may start
            r.rundir.set_status(Status.pending)
        try:
            sent, job_ids = submission.submit(planned, known, publish=publish, job_name=lambda _: name,
                                              refused="wave submission failed",
                                              unsent=lambda rs, _why: [r.rundir.set_status(Status.waiting) for r in rs])
        except submission.SubmissionRefused as e:
            _stop_held(sd, plan, f"a wave was refused ({e})")
            raise
        rest = [SweepDir.index_of(r.run_id) for r in left] + waiting[len(runs):]
        done = [SweepDir.index_of(r.run_id) for r in sent]
        plan = plan.queued(Wave(tuple(job_ids), tuple(done), now_iso(), by), rest, None)
        sd.write_waves(plan)  # the wave recorded before its successor is asked for
        try:
            job = backend.wave_job(sd.path, job_ids, sd.submitit_folder, scope_of(cfg)) if rest else None
        except RuntimeError as e:  # its runs are queued; the rest wait for `launcher runs` to queue a wave job
            return (f"sweep {sd.sweep_id}: queued {len(done)} run(s) in {', '.join(job_ids)}; the next wave job was "
                    f"refused ({e}): {len(rest)} run(s) wait until `launcher runs` queues one")
        sd.write_waves(replace(plan, job_id=job))
    more = f"; {len(rest)} wait for wave job {job}" if rest else "; none waits"
    return f"sweep {sd.sweep_id}: queued {len(done)} run(s) in {len(job_ids)} array(s) {', '.join(job_ids)}{more}"


def _stop_held(sd: SweepDir, plan: WavePlan, why: str) -> None:
    """``stop`` with the waves lock already held."""
    for i in plan.waiting:
        published = sd.run(i).exists()  # (a refused first wave: its runs are still staged)
        rd = sd.run(i) if published else sd.staging(i)
        if rd.status().state is Status.waiting:
            rd.finish(Status.failed, seal=published, exit_code=None, error=f"not submitted: {why}")
    sd.write_waves(replace(sd.waves() or plan, waiting=(), job_id=None, stopped=why))


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) != 1:
        print("usage: python -m launcher.submit.waves SWEEP_DIR", file=sys.stderr)
        return 2
    sd = SweepDir(Path(argv[0]))
    here = backends.running()  # the scheduler whose job this is: its id names the wave in the plan
    print(queue_next(sd, f"wave job {here.place(os.environ).job_id if here is not None else os.getpid()}"), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
