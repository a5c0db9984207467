"""sweep=asha on the node: a point's report at a rung, the rung's decision, and carrying it out.

No head process: the sweep dir holds every report and decision (``SweepDir.rung_rows``), written
under the sweep's lock (``SweepDir.rungs_lock``). At a rung, rank 0 of a point (the step loop,
launcher.training.loop) records its objective, then decides what the record allows
(launcher.features.asha.schedule.decide_all) and carries out the new decisions: a promoted paused point is set
``requeued`` (restart reason "promoted", which train.max_restarts does not count) and resumed through
its backend (``Backend.resume_paused``: Slurm releases its held job; local: its controller, waiting,
starts it again); a pruned paused point is finalised ``pruned`` and its job dropped
(``Backend.drop_paused``). The reporting point itself goes on (promoted), ends ``pruned``, or pauses:
status ``paused`` and ``Backend.pause`` (Slurm: ``scontrol requeuehold``, the job ends and frees its
slot; local: the processes exit, the controller waits), done under the lock so that no decision can
resume it before it is paused.

A point that ends without reaching its next rung (failed, cancelled) must not block the rung: the
step's teardown (launcher.runtime.after_step) and the local controller call ``on_end``, which decides
again with that point counted as the worst. No torch here.
"""
from __future__ import annotations

import os
import sys
import time
from typing import TYPE_CHECKING, Any, Dict, List, Optional

from launcher.features.asha import schedule as asha
from launcher.features.paused import backend_of, drop_held, pause_point, point_of, recorded, release
from launcher.features.pbt import generations as pbt
from launcher.run.rundir import RunDir, SweepDir
from launcher.run.status import Status

if TYPE_CHECKING:
    from launcher.config.schema import RunConfig


def since_process_start() -> float:
    """Seconds since this process started (its imports, the model's construction, the resume: what each
    start of a paused point costs again); 0 where /proc does not say."""
    from launcher.backends.local import process_start

    try:
        ticks = process_start(os.getpid())
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return max(0.0, time.time() - (boot + ticks / os.sysconf("SC_CLK_TCK"))) if ticks is not None else 0.0
    except (OSError, ValueError, StopIteration):
        return 0.0


def rule_of(rd: RunDir, cfg: Optional[RunConfig] = None) -> Optional[Any]:
    """The run's scheduler (None: not in an asha or pbt sweep): its config's sweep group (an asha.Rule or
    a pbt.Rule, which pause alike), or for a Hydra app's run the launcher's (hydra.launcher.sweep,
    archived in run.json; asha only, rungs only: no train.steps)."""
    try:
        if cfg is None:
            meta = rd.run() or {}
            if meta.get("kind") == "hydra_app":
                return asha.Rule.of({"sweep": meta["sweep"], "train": {"steps": 0}}) if meta.get("sweep") else None
            cfg = rd.config()
        return asha.Rule.of(cfg) or pbt.Rule.of(cfg)
    except (OSError, ValueError):
        return None


# the run this process reports for through ``at_step`` (a Hydra app's job attaches it before the app runs)
_attached: Dict[str, Any] = {}


def attach(rd: RunDir, attempt: int, job_id: Optional[str], rank: int, world: int) -> None:
    _attached.clear()
    rule = rule_of(rd)
    if rule is not None:
        me = point_of(rd)  # resumed: its segment starts at the last rung it reported
        last = max((int(r["step"]) for r in _sweep(rd).rung_rows() if r.get("kind") == "report"
                    and r.get("point") == me), default=0)
        _attached.update(rd=rd, rule=rule, attempt=attempt, job_id=job_id, rank=rank, world=world,
                         t0=time.time(), startup=since_process_start(), last=last)


def at_step(step: int, value: Optional[float]) -> None:
    """The public call of code that runs no StepLoop (a Hydra app on hydra/launcher=launcher_*): after
    step ``step`` (its checkpoint saved: a decision may resume the point from it at once), report the
    objective. At a rung where the point does not go on, raises ``AtRung`` (paused: the job ends and a
    promotion starts the app again, which resumes from its own checkpoint; or pruned): let it propagate.
    Elsewhere, and outside such a sweep, it does nothing. One process per point reports (rank 0)."""
    from launcher.runtime.restarts import AtRung

    a = _attached
    if not a or step not in a["rule"].rungs or a["rank"] != 0:
        return
    verdict = report(a["rd"], a["rule"], int(step), None if value is None else float(value), attempt=int(a["attempt"]),
                     seconds=time.time() - a["t0"], from_step=int(a["last"]), world=int(a["world"]),
                     job_id=a["job_id"], startup_s=a["startup"])
    a.update(t0=time.time(), startup=0.0, last=int(step))
    if verdict in ("wait", "pruned"):
        raise AtRung(verdict, int(step))


def _sweep(rd: RunDir) -> SweepDir:
    return SweepDir(rd.path.parent)


def _state(sd: SweepDir) -> asha.State:
    runs = sd.runs()
    ended = [point_of(r) for r in runs if r.status().is_final]
    return asha.state_from(sd.rung_rows(), [point_of(r) for r in runs], ended)


def _carry_out(sd: SweepDir, rule: asha.Rule, new: List[asha.Decision], me: Optional[int]) -> None:
    """Record the new decisions and act on every paused point they name (not ``me``: the caller). A record
    that cannot be written never stops an action (``recorded``): a decision is a pure function of the
    reports, so one decided again later acts on no point twice (only paused points are acted on)."""
    if not new:
        return
    recorded("the rung decisions", sd.add_rung_rows,
             [{"kind": "decision", **d.to_json(), "step": rule.pause_rungs[d.rung]} for d in new])
    for d in new:
        step = rule.pause_rungs[d.rung]
        for p in d.promoted:
            rd = sd.run(p)
            if p == me or rd.status().state is not Status.paused:
                continue
            release(rd, rd.status().job_id, f"point {p}", "promotion",
                    {"reason": "promoted", "detail": f"promoted at rung {d.rung} (step {step})", "rank": None,
                     "step": step}, f"promoted at rung {d.rung} but not resumed")
        for p in d.pruned:
            rd = sd.run(p)
            if p == me or rd.status().state is not Status.paused:
                continue
            job_id = rd.status().job_id
            # recorded first (a refresh between the drop and the record would read a cancelled job), and
            # dropped whether or not it was: a held job nobody drops waits in the queue for ever
            pruned = recorded(f"point {p} pruned", rd.finish_in_job, Status.pruned, exit_code=0, error=None,
                              stop={"rung": d.rung, "step": step})
            if drop_held(rd, job_id, f"pruned point {p}") and pruned:
                try:  # sealed once its job has ended (Slurm: a one-node job after it; local: its controller)
                    backend_of(rd).seal_after_job(rd.path, job_id, sd.submitit_folder)
                except Exception as e:
                    print(f"launcher: the seal of pruned point {p} was not arranged ({e}); the next "
                          "`launcher status` seals it", file=sys.stderr, flush=True)


def report(rd: RunDir, rule: asha.Rule, step: int, value: Optional[float], *, attempt: int, seconds: float,
           from_step: int, world: int, job_id: Optional[str], startup_s: float = 0.0) -> str:
    """Rank 0 of a point at the rung at ``step``: its report recorded and the rungs decided; returns
    "promoted" (go on), "wait" (paused: the job ends) or "pruned" (final), or "end" (the last rung:
    train.steps, nothing to decide)."""
    if isinstance(rule, pbt.Rule):  # sweep=pbt: its own decision (launcher.features.pbt.population)
        from launcher.features.pbt import population

        return population.report(rd, rule, step, value, attempt=attempt, seconds=seconds, from_step=from_step,
                                 world=world, job_id=job_id, startup_s=startup_s)
    sd, me = _sweep(rd), point_of(rd)
    rung = rule.rungs.index(step)
    with sd.rungs_lock():
        sd.add_report(me, rung, step, value, attempt=attempt, seconds=seconds, startup_s=startup_s,
                      from_step=from_step, world=world)
        if step not in rule.pause_rungs:
            return "end"
        state = _state(sd)
        new = asha.decide_all(rule, state)
        mine = asha.verdict(rule, state, me, rung)
        if mine == "wait":
            pause_point(rd, f"paused at rung {rung} (step {step})", step, job_id)
        elif mine == "pruned":
            rd.finish_in_job(Status.pruned, exit_code=0, error=None, stop={"rung": rung, "step": step})
        _carry_out(sd, rule, new, me)
        return mine


def wait_decision(rd: RunDir, poll_s: float = 0.5) -> str:
    """A paused run's process that holds no queue slot (cluster=local): wait for its rung's decision;
    "promoted" (go on: a new attempt) or what it became (pruned, cancelled...)."""
    while rd.status().state is Status.paused:
        time.sleep(poll_s)
    st = rd.status()
    promoted = st.state is Status.requeued and (st.stop or {}).get("reason") == "promoted"
    return "promoted" if promoted else st.state.value


def on_end(rd: RunDir) -> None:
    """A point's job ended: if its run is final without having reached its next rung, the rungs it
    leaves are decided again (it counts as the worst)."""
    rule = rule_of(rd)
    if rule is None or not rd.status().is_final:
        return
    if isinstance(rule, pbt.Rule):
        from launcher.features.pbt import population

        return population.on_end(rd, rule)
    sd = _sweep(rd)
    with sd.rungs_lock():
        state = _state(sd)
        _carry_out(sd, rule, asha.decide_all(rule, state), None)


def record_end(rd: RunDir, rule: asha.Rule, step: int, *, seconds: float, from_step: int, world: int,
               startup_s: float = 0.0) -> None:
    """The measured segment of a point that ran to train.steps past its last rung (the compute spent)."""
    if step in rule.rungs:
        return  # its report at that rung holds the segment
    sd = _sweep(rd)
    with sd.rungs_lock():
        sd.add_rung_rows([{"kind": "end", "point": point_of(rd), "step": step, "seconds": round(seconds, 3),
                           "startup_s": round(startup_s, 3), "from_step": from_step, "world": world}])


def summary(sd: SweepDir) -> Optional[Dict[str, Any]]:
    """The sweep's rung table and compute (None: no scheduler)."""
    runs = sd.runs()
    if not runs:
        return None
    rule = rule_of(runs[0])
    if rule is None:
        return None
    if isinstance(rule, pbt.Rule):
        from launcher.features.pbt import population

        return population.summary(sd, rule)
    return asha.summary(sd.rung_rows(), rule, [point_of(r) for r in runs])
