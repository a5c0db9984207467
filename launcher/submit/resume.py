"""`launcher resume RUN` and `launcher retry SWEEP --failed`: the next attempt of ended runs, in the
same run dirs (archived config, code snapshot, seeds), from each run's latest checkpoint.

Every run is checked before anything changes: it must have ended, its sealed archive must be intact
(a changed archive is refused), and a change asked for (``--steps``, ``key=value``) must keep the
archived layout. Then each run's manifest is kept under ``attempts/<a>/``, the run reopens,
``restarts.jsonl`` records why (``resume`` or ``retry``, with the changes), and the runs go out
together: runs that share resources as ONE submitit batch (one Slurm array, split under the
scheduler's limits like a launch). The new job resumes from ``checkpoints/latest`` like any requeued
attempt does (launcher.runtime.restarts).
"""
from __future__ import annotations

import copy
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from launcher import backends
from launcher.layout import ConfigError, ConfigErrors
from launcher.rundir import FINAL, RunDir, Status, SweepDir, now_iso


@dataclass
class _Next:
    """One run's next attempt, checked and ready to submit."""

    rd: RunDir
    run_id: str
    status: Dict[str, Any]
    plain: Dict[str, Any]  # the config the next attempt runs with (archived, plus the changes)
    cfg: Any  # the same, typed
    changed: Dict[str, Any]  # dotted key -> (old, new) of what differs from the archived config
    done: int  # the step of the latest checkpoint (0: none)
    backend: backends.Backend
    code_dir: Path


def _flat(d: Any, prefix: str = "") -> Dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix: d}
    out: Dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def _apply(plain: Dict[str, Any], changes: Sequence[str], run_id: str) -> Dict[str, Any]:
    """The archived config with ``key=value`` changes (Hydra-style values, typed by the schema)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from launcher.schema import typed

    try:
        cfg = OmegaConf.merge(typed(plain), OmegaConf.from_dotlist([c.lstrip("+") for c in changes]))
        return OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "?"
        raise ConfigErrors([ConfigError(str(key), str(e).splitlines()[0], "use a key of the archived config")],
                           f"({run_id})")


def prepare(run_dir: Path, steps: Optional[int] = None, changes: Sequence[str] = ()) -> _Next:
    """Check one ended run for its next attempt (nothing is written): ended, intact, and the changes
    (``steps``: train.steps; ``changes``: key=value) valid and keeping the archived layout."""
    from launcher.layout import resolve
    from launcher.schema import typed

    rd = RunDir(run_dir)
    if not rd.exists():
        raise FileNotFoundError(f"{run_dir} is not an archived run (no {RunDir.RUN})")
    meta = rd.run() or {}
    run_id = meta.get("run_id", rd.path.name)
    if meta.get("kind") == "hydra_app":  # its job is the app's task function, not a RunTask
        raise ConfigErrors([ConfigError("RUN", f"{run_id} is a run of a Hydra app (hydra/launcher=launcher_*)",
                                        "run the app's sweep again")])
    st = rd.status()
    if st.state not in FINAL:
        raise ConfigErrors([ConfigError("RUN", f"{run_id} is {st.state.value}: its job may still be running or "
                                        "queued", "wait for it, or `launcher cancel` it first")])
    problems = rd.verify()
    if problems:
        raise ConfigErrors([ConfigError("RUN", f"the archive of {run_id} changed after it was sealed: "
                                        + "; ".join(problems), "resume an intact run (launcher show RUN lists "
                                        "what changed)")])
    archived = rd.config()
    plain = _apply(archived, changes, run_id) if changes else copy.deepcopy(archived)
    latest = rd.latest_checkpoint()
    done = RunDir.checkpoint_step(latest) if latest else 0
    old_steps = int(archived["train"]["steps"])
    if steps is not None:
        if int(steps) < max(1, done):
            raise ConfigErrors([ConfigError("--steps", f"{steps} is before the latest checkpoint of {run_id} "
                                            f"(step {done})", f"choose --steps {max(done, old_steps)} or more")])
        plain["train"]["steps"] = int(steps)
    if done >= int(plain["train"]["steps"]) and st.state == "completed":
        raise ConfigErrors([ConfigError("--steps", f"{run_id} completed all {old_steps} steps",
                                        f"pass --steps N with N > {old_steps} to train further")])
    cfg = typed(plain)
    was, now = _flat(archived), _flat(plain)
    changed = {k: (was.get(k), now.get(k)) for k in sorted(set(was) | set(now)) if was.get(k) != now.get(k)}
    if changed:  # the changed config must pass every rule and keep the layout the run dir was made for
        lay = resolve(cfg).to_json()
        old = (rd.run() or {}).get("layout") or {}
        moved = {k: (old.get(k), v) for k, v in lay.items() if k in old and old.get(k) != v}
        if moved:
            raise ConfigErrors([ConfigError(", ".join(sorted(changed)), f"changes the layout of {run_id} ("
                                            + ", ".join(f"{k} {a} -> {b}" for k, (a, b) in moved.items()) + ")",
                                            "a new attempt keeps its run's layout: `launcher reproduce RUN "
                                            "key=value` starts a new run instead")])
    code_dir = Path(rd.snapshot().get("path", ""))
    if not code_dir.is_dir():
        raise FileNotFoundError(f"the code snapshot {code_dir} of {run_id} is gone: nothing to resume with")
    return _Next(rd, run_id, st, plain, cfg, changed, done, backends.of(cfg), code_dir)


def _begin(n: _Next, reason: str, detail: str) -> int:
    """Reopen the run for its next attempt and record why; returns the attempt that ended."""
    attempt = int(n.status.get("attempt") or 1)
    n.rd.reopen(attempt)
    if n.changed:
        n.rd.write_config(n.plain)
    what = "; ".join(f"{k} {a} -> {b}" for k, (a, b) in n.changed.items())
    n.rd.record_restart({"attempt": attempt + 1, "reason": reason,
                         "detail": f"{detail} after {n.status.get('status')}" + (f"; {what}" if what else ""),
                         "changes": {k: b for k, (a, b) in n.changed.items()}, "from_step": n.done,
                         "nodes": n.status.get("hosts"), "job_id": n.status.get("job_id")})
    return attempt


def resubmit(run_dirs: Sequence[Path], reason: str = "retry", steps: Optional[int] = None,
             changes: Sequence[str] = (), detail: Optional[str] = None, out=None):
    """Submit the next attempt of each of ``run_dirs`` (ended runs, usually of one sweep): every run is
    checked first (nothing changes if one is refused), then reopened and recorded (``reason``), and
    the runs sharing resources go out as ONE submitit batch (one array; split under the scheduler's
    MaxArraySize / MaxSubmitJobs). Returns the pipeline's SweepResult for the wait view."""
    from launcher.archive import registry
    from launcher.submit.pipeline import SubmittedRun, SweepResult, array_id
    from launcher.sweeps import TooManyJobs, job_name, plan_arrays

    out = out or sys.stdout
    if not run_dirs:
        raise ValueError("no runs to resubmit")
    nexts = [prepare(Path(d), steps, changes) for d in run_dirs]
    grouped: Dict[tuple, List[_Next]] = {}
    for n in nexts:  # one submitit folder per sweep dir; one array per resource shape
        grouped.setdefault((str(n.rd.path.parent), n.backend.name, n.backend.group_key(n.cfg)), []).append(n)
    groups = list(grouped.values())
    planned: List[Any] = []
    for name in {g[0].backend.name for g in groups}:
        gs = [g for g in groups if g[0].backend.name == name]
        limits = gs[0][0].backend.array_limits(gs[0][0].cfg)
        try:
            chunks = plan_arrays([len(g) for g in gs], limits,
                                 [min(int(n.cfg.cluster.array_parallelism) for n in g) for g in gs])
        except TooManyJobs as e:
            raise ConfigErrors([ConfigError("SWEEP", str(e).replace("the sweep has", "the retry has"),
                                            "retry fewer runs at once")]) from None
        planned.extend(gs[c.group][c.start:c.stop] for c in chunks)
    why = detail or f"launcher {reason}"
    fresh = [n.run_id for n in nexts if n.done == 0]
    if fresh:
        print(f"warning: {', '.join(fresh)} ha{'s' if len(fresh) == 1 else 've'} no checkpoint: "
              "starting again from step 0", file=sys.stderr)
    attempts = {n.run_id: _begin(n, reason, why) for n in nexts}
    runs: List[SubmittedRun] = []
    job_ids: List[str] = []
    for b, batch in enumerate(planned):
        first = batch[0]
        sweep = SweepDir(first.rd.path.parent)
        name = job_name([str(n.plain["submit"]["job_name"]) for n in batch], sweep.sweep_id)
        parallelism = min(int(n.cfg.cluster.array_parallelism) for n in batch)
        try:
            jobs = _submit(first, [n.rd for n in batch], sweep.submitit_folder, name, parallelism)
        except Exception as e:  # this batch and every later one: failed again, saying why
            left = [n for later in planned[b:] for n in later]
            for n in left:
                n.rd.finish(Status.failed, exit_code=None, error=f"{reason} submission failed: {e}")
            registry.record(sweep.path.parent, [n.rd.path for n in left])
            raise
        submitted = []
        for n, job in zip(batch, jobs):
            job_id = str(job.job_id)
            array, _, task = job_id.partition("_")
            old_job = n.rd.job()
            n.rd.write_job({**old_job, "job_id": job_id, "array_job_id": array if task else None,
                            "array_task_id": int(task) if task else None,
                            "stdout": str(job.paths.stdout), "stderr": str(job.paths.stderr), "submitted": now_iso(),
                            "earlier_job_ids": list(old_job.get("earlier_job_ids", [])) + [old_job.get("job_id")]})
            n.rd.set_status(Status.pending, job_id=job_id, attempt=attempts[n.run_id], resumed=True)
            submitted.append(SubmittedRun(run_id=n.run_id, rundir=n.rd, job_id=job_id, job=job))
        registry.record(sweep.path.parent, [n.rd.path for n in batch])
        runs.extend(submitted)
        job_ids.append(array_id(submitted))
    for r in runs:
        n = next(x for x in nexts if x.run_id == r.run_id)
        verb = {"resume": "resuming", "retry": "retrying"}.get(reason, reason)
        print(f"{verb} {r.run_id} from step {n.done} (attempt {attempts[r.run_id] + 1}), job {r.job_id}", file=out)
    sweep = SweepDir(nexts[0].rd.path.parent)
    return SweepResult(sweep_id=sweep.sweep_id, sweep_dir=sweep.path, runs=runs, job_ids=job_ids,
                       backend=nexts[0].backend)


def _submit(first: _Next, rds: List[RunDir], folder: Path, name: str, parallelism: int) -> List[Any]:
    """One submitit batch of RunTask(run_dir) for these runs (one array job when there are several)."""
    from launcher.runtime.task import RunTask

    backend = first.backend
    with backend.environment(first.cfg, first.code_dir):
        ex = backend.executor(first.cfg, folder, first.code_dir, job_name=name, parallelism=parallelism)
        if len(rds) == 1:
            return [ex.submit(RunTask(str(rds[0].path)))]
        with ex.batch():
            jobs = [ex.submit(RunTask(str(rd.path))) for rd in rds]
    return jobs


def resume(run_dir: Path, steps: Optional[int] = None, out=None):
    """Submit one run's next attempt (``launcher resume``); returns the pipeline's SweepResult."""
    return resubmit([run_dir], reason="resume", steps=steps, out=out)
