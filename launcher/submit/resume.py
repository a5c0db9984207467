"""`launcher resume RUN` and `launcher retry SWEEP --failed`: the next attempt of ended runs, in the
same run dirs (archived config, code snapshot, seeds), from each run's latest checkpoint.

Every run is checked before anything changes: it must have ended, its sealed archive must be intact
(a changed archive is refused), its latest checkpoint (or an earlier one) must match its
checkpoint.json by name and size (launcher.run.checkpoint_manifest; the job checks every byte), and a
change asked for (``--steps``, ``key=value``) must pass the rules, and one that moves state between
ranks (dp, ZeRO stage, engine, node count) needs a layout-independent checkpoint and the same global
batch (launcher.submit.reshard). Then each run's
manifest is kept under ``attempts/<a>/``, the run reopens, ``restarts.jsonl`` records why
(``resume`` or ``retry``, with the changes), and the runs go out together: runs that share
resources as ONE submitit batch (one Slurm array, split under the scheduler's limits like a
launch). The new job resumes from ``checkpoints/latest`` like any requeued
attempt does (launcher.runtime.restarts).
"""
from __future__ import annotations

import contextlib
import copy
import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from launcher import backends
from launcher.archive import registry, secrets
from launcher.config import recipe_contract, recipe_target
from launcher.config.errors import ConfigError, ConfigErrors
from launcher.config.rules import resolve
from launcher.config.schema import RunConfig, typed
from launcher.config.view import ConfigView
from launcher.data import archived as data_archive
from launcher.features.elastic.resize import GROW, SHRINK, waits_for_its_job
from launcher.run import checkpoint_manifest
from launcher.run.checkpoint_manifest import CheckpointCorrupt
from launcher.run.rundir import RunDir, SweepDir, is_checkpoint_problem, now_iso
from launcher.run.status import FINAL, Status
from launcher.runtime.restart_policy import NOT_FIXED_BY_A_RESTART
from launcher.runtime.task import RunTask
from launcher.submit import reshard, submission
from launcher.submit.pipeline import SweepResult
from launcher.sweeps import Unschedulable, job_name


@dataclass
class _Next:
    """One run's next attempt, checked and ready to submit."""

    rd: RunDir
    run_id: str
    status: Dict[str, Any]
    plain: Dict[str, Any]  # the config the next attempt runs with (archived, plus the changes)
    cfg: RunConfig  # the same, typed
    changed: Dict[str, Any]  # dotted key -> (old, new) of what differs from the archived config
    done: int  # the step of the latest checkpoint (0: none)
    backend: backends.Backend
    code_dir: Path
    layout: Optional[Dict[str, Any]] = None  # {"from", "to"}: resumed on another layout (launcher.submit.reshard)


def _flat(d: Any, prefix: str = "") -> Dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix: d}
    out: Dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def _refused_keys(plain: Dict[str, Any], changes: Sequence[str]) -> List[str]:
    """The keys of the changes the archived config does not take, each tried alone (all, if none alone)."""
    keys = [c.lstrip("+").split("=")[0] for c in changes]
    bad = []
    for key, change in zip(keys, changes):
        try:
            OmegaConf.merge(typed(plain), OmegaConf.from_dotlist([change.lstrip("+")]))
        except OmegaConfBaseException:
            bad.append(key)
    return bad or keys


def _apply(plain: Dict[str, Any], changes: Sequence[str], run_id: str) -> Dict[str, Any]:
    """The archived config with ``key=value`` changes (Hydra-style values, typed by the schema)."""
    try:
        cfg = OmegaConf.merge(typed(plain), OmegaConf.from_dotlist([c.lstrip("+") for c in changes]))
        return OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or ", ".join(_refused_keys(plain, changes))
        raise ConfigErrors([ConfigError(str(key), str(e).splitlines()[0], "use a key of the archived config "
                                        "(key=value: a config group such as parallelism=tp is chosen at launch; "
                                        "set its keys instead, e.g. parallelism.tp=2)")], f"({run_id})") from e


def prepare(run_dir: Path, steps: Optional[int] = None, changes: Sequence[str] = (), elastic: bool = False) -> _Next:
    """Check one ended run for its next attempt (nothing is written): ended, intact, and the changes
    (``steps``: train.steps; ``changes``: key=value) valid and on a layout its checkpoint loads on.
    ``elastic``: cluster.elastic's deciding job asks (launcher.features.elastic.decide), for which a run whose job
    ended on purpose for it (to grow back, or asking for a restart: launcher.features.elastic.resize.waits_for_its_job)
    has ended too."""
    rd = RunDir(run_dir)
    if not rd.exists():
        raise FileNotFoundError(f"{run_dir} is not an archived run (no {RunDir.RUN})")
    meta = rd.run() or {}
    run_id = meta.get("run_id", rd.path.name)
    if meta.get("kind") == "hydra_app":  # its job is the app's task function, not a RunTask
        raise ConfigErrors([ConfigError("RUN", f"{run_id} is a run of a Hydra app (hydra/launcher=launcher_*)",
                                        "run the app's sweep again")])
    st = rd.status()
    queued_after = elastic and waits_for_its_job(st.state.value, st.stop)
    if st.state not in FINAL and not queued_after:
        raise ConfigErrors([ConfigError("RUN", f"{run_id} is {st.state.value}: its job may still be running or "
                                        "queued", "wait for it, or `launcher cancel` it first")])
    problems = rd.verify()
    # checkpoints carry their own manifest: a changed one is the checkpoint check's to judge (below, and
    # every byte in the job): an earlier intact checkpoint is resumed from, recorded, or the run refused
    ckpt_problems = [p for p in problems if is_checkpoint_problem(p)]
    problems = [p for p in problems if not is_checkpoint_problem(p)]
    if problems:
        raise ConfigErrors([ConfigError("RUN", f"the archive of {run_id} changed after it was sealed: "
                                        + "; ".join(problems), "resume an intact run (launcher show RUN lists "
                                        "what changed)")])
    if ckpt_problems:
        print(f"warning: {run_id}: checkpoints changed after the seal ({'; '.join(ckpt_problems)}): each is "
              "verified against its checkpoint.json before it is loaded", file=sys.stderr)
    archived = rd.config()
    plain = _apply(archived, changes, run_id) if changes else copy.deepcopy(archived)
    # the datasets it trains on again: every shard there, of its archived size (the job reads them)
    data = data_archive.problems(rd.data_manifest(), hashes=False, only=data_archive.paths(plain))
    if data:
        raise ConfigErrors([ConfigError("RUN", f"the data {run_id} was launched with changed: " + "; ".join(data),
                                        "put the dataset back as it was (`launcher show RUN` names it), or start "
                                        "a new run on the new data: `launcher reproduce RUN data.path=DIR`")])
    missing = secrets.missing_references(plain)
    if missing:
        raise ConfigErrors([ConfigError("RUN", missing, "the values the original launch was given")])
    try:  # the checkpoint the job will resume from (sizes checked here; the job reads every byte)
        point = checkpoint_manifest.resume_point(rd, contents=False)
    except CheckpointCorrupt as e:
        raise ConfigErrors([ConfigError("RUN", f"{run_id}: {e}", NOT_FIXED_BY_A_RESTART["corrupt_checkpoint"][1])
                            ]) from e
    done = RunDir.checkpoint_step(point.path) if point.path else 0
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
    code_dir = Path(rd.snapshot().get("path", ""))
    if not code_dir.is_dir():
        raise FileNotFoundError(f"the code snapshot {code_dir} of {run_id} is gone: nothing to resume with")
    layout = None
    if changed:  # the changed config must pass every rule; a new layout, one its checkpoint can be resharded to
        with recipe_target.searched_in(code_dir):  # the job imports the snapshot, whatever the cwd is now
            checked = resolve(cfg)
            lay = checked.to_json()
            # the recipe's planner too, as at launch: a new layout that would not fit is refused here
            planner = recipe_contract.of(recipe_contract.tree_get(plain, "recipe._target_")).planner
            planned = planner(ConfigView(plain), checked) if planner is not None else recipe_contract.CheckResult()
        if planned.errors:
            raise ConfigErrors(planned.errors, f"({run_id})")
        for w in planned.warnings:
            print(f"warning: {run_id}: {w}", file=sys.stderr)
        old = (rd.run() or {}).get("layout") or {}
        layout = {"from": old, "to": lay} if reshard.moved(old, lay) else None
        if layout:  # state moves between ranks: allowed where the checkpoint can be resharded
            reshard.check(run_id, old, lay, changed, point.path,
                          (was.get("precision.dtype"), now.get("precision.dtype")))
    return _Next(rd, run_id, st, plain, cfg, changed, done, backends.of(cfg), code_dir, layout)


def _claimed_since(n: _Next) -> Optional[str]:
    """Why run ``n`` can no longer be claimed (call under its sweep's claims lock): another command began its
    next attempt since ``prepare`` read it (its status changed), named from the restart row it recorded."""
    now = n.rd.status()
    if (now.state, now.attempt, now.updated) == (n.status.state, n.status.attempt, n.status.updated):
        return None
    rows = n.rd.restarts()
    by = (rows[-1].get("by") or {}) if rows else {}
    who = (f"`launcher {by.get('command')}` (pid {by.get('pid')} on {by.get('host')}, {by.get('at')})" if by
           else "another command")
    return f"{n.run_id} was claimed by {who} since it was checked: it is {now.state.value} (attempt {now.attempt})"


def _begin(n: _Next, reason: str, detail: str, known: Dict[str, str]) -> int:
    """Reopen the run for its next attempt and record why; returns the attempt that ended."""
    attempt = int(n.status.attempt or 1)
    n.rd.reopen(attempt)
    if n.layout:  # the job runs with the run's layout (run.json): the new one
        n.rd.set_layout(n.layout["to"])
    if n.changed:  # a change may name a secret (key=value): archived redacted, like a launch's config
        n.rd.write_config(secrets.redact_config(n.plain, known, raw=n.plain))
        os.environ.update(secrets.lifted_secrets(n.plain, n.plain))  # the new job inherits them
    what = secrets.scrub("; ".join(f"{k} {a} -> {b}" for k, (a, b) in n.changed.items()), known)
    n.rd.record_restart(secrets.scrub_tree({
        "attempt": attempt + 1, "reason": reason, "detail": f"{detail} after {n.status.state.value}"
        + (f"; {what}" if what else ""), "changes": {k: b for k, (a, b) in n.changed.items()}, "from_step": n.done,
        "nodes": n.status.hosts, "job_id": n.status.job_id,
        # who claimed this attempt (a second resume, retry or reproduce is refused naming it)
        "by": {"command": reason, "pid": os.getpid(), "host": socket.gethostname(), "at": now_iso()},
        **({"layout": {k: reshard.summary(v) for k, v in n.layout.items()}} if n.layout else {})}, known))
    return attempt


def resubmit(run_dirs: Sequence[Path], reason: str = "retry", steps: Optional[int] = None,
             changes: Sequence[str] = (), detail: Optional[str] = None, out=None, elastic: bool = False,
             prepared: Sequence[_Next] = ()):
    """Submit the next attempt of each of ``run_dirs`` (ended runs, usually of one sweep): every run is
    checked first (nothing changes if one is refused), then reopened and recorded (``reason``), and
    the runs sharing resources go out as ONE submitit batch (one array; split under the scheduler's
    MaxArraySize / MaxSubmitJobs) through launcher.submit.submission, as a launch's do. Returns the
    pipeline's SweepResult for the wait view."""
    out = out or sys.stdout
    if not run_dirs:
        raise ValueError("no runs to resubmit")
    # (``prepared``: the runs' checks done already, as cluster.elastic's job does while it picks a node count)
    nexts = list(prepared) or [prepare(Path(d), steps, changes, elastic) for d in run_dirs]
    try:  # one submitit folder per sweep dir; one array per resource shape
        planned = submission.arrays(nexts, cfg=lambda n: n.cfg, key=lambda n: str(n.rd.path.parent))
    except Unschedulable as e:  # TooManyJobs among them
        raise ConfigErrors([ConfigError("SWEEP", str(e).replace("the sweep has", "the retry has"),
                                        "retry fewer runs at once")]) from None
    known = secrets.known_secrets([n.plain for n in nexts])
    why = detail or f"launcher {reason}"
    fresh = [n.run_id for n in nexts if n.done == 0]
    if fresh:
        print(f"warning: {', '.join(fresh)} ha{'s' if len(fresh) == 1 else 've'} no checkpoint: "
              "starting again from step 0", file=sys.stderr)
    with contextlib.ExitStack() as claims:  # one writer at a time: every run's next attempt claimed, or none
        for sweep_dir in sorted({n.rd.path.parent for n in nexts}):
            claims.enter_context(SweepDir(sweep_dir).claims_lock())
        taken = [line for n in nexts if (line := _claimed_since(n)) is not None]
        if taken:
            raise ConfigErrors([ConfigError("RUN", line, "wait for it (launcher status RUN); each run takes one "
                                            "resume, retry or reproduce at a time") for line in taken])
        attempts = {n.run_id: _begin(n, reason, why, known) for n in nexts}

    def run_of(n: _Next) -> submission.Run:
        sweep = SweepDir(n.rd.path.parent)
        return submission.Run(run_id=n.run_id, rundir=n.rd, task=RunTask(str(n.rd.path)), cfg=n.cfg,
                              code_dir=n.code_dir, folder=sweep.submitit_folder, shared=sweep.shared(),
                              num_tasks=n.rd.layout().world_size, earlier=n.rd.job())

    def name(arr: submission.Array) -> str:
        return job_name([str(r.cfg.submit.job_name) for r in arr.points], arr.points[0].rundir.path.parent.name)

    def publish(runs: List[Any], job_ids: List[str]) -> None:
        """The submitted runs pending their new job; the refused ones sealed; the index updated."""
        for r in runs:
            r.rundir.set_status(Status.pending, job_id=r.job_id, attempt=attempts[r.run_id], resumed=True)
        for n in nexts:
            if n.rd.is_final():
                n.rd.seal()
        for root in dict.fromkeys(n.rd.path.parent.parent for n in nexts):
            registry.record(root, [n.rd.path for n in nexts if n.rd.path.parent.parent == root])

    runs, job_ids = submission.submit([submission.Array([run_of(n) for n in arr.points], arr.parallelism,
                                                        pack_nodes=arr.pack_nodes)
                                       for arr in planned], known, publish=publish, job_name=name,
                                      refused=f"{reason} submission failed")
    for r in runs:
        n = next(x for x in nexts if x.run_id == r.run_id)
        verb = {"resume": "resuming", "retry": "retrying", SHRINK: "shrinking", GROW: "growing"}.get(
            reason, "restarting")
        print(f"{verb} {r.run_id} from step {n.done} (attempt {attempts[r.run_id] + 1}), job {r.job_id}", file=out)
    sweep = SweepDir(nexts[0].rd.path.parent)
    return SweepResult(sweep_id=sweep.sweep_id, sweep_dir=sweep.path, runs=runs, job_ids=job_ids,
                       backend=nexts[0].backend)


def loaded_line(rd: RunDir, attempt: int) -> Optional[str]:
    """After a resume's wait: the checkpoint ``attempt`` loaded, where it began, trained past it and no
    node rejected one (a rejection is the wait's own line: progress.fallback_lines, naming the step
    loaded instead); None where the attempt did not get that far, or started from step 0."""
    try:
        if any(f.get("attempt") == attempt for f in rd.fallbacks()):
            return None
        st = rd.status()
        row = next((r for r in reversed(rd.restarts()) if r.get("attempt") == attempt), None)
        done = max((int(m.get("step") or 0) for m in rd.metrics()), default=0)
    except (OSError, ValueError):
        return None
    step = int((row or {}).get("from_step") or 0)
    if int(st.attempt or 0) < attempt or not step or (done <= step and st.state != Status.completed):
        return None
    return (f"{rd.run_id}: attempt {attempt} resumed from step {step} ({rd.checkpoint_dir(step).name}, verified "
            "before it was loaded)")


def resume(run_dir: Path, steps: Optional[int] = None, out=None, changes: Sequence[str] = ()):
    """Submit one run's next attempt (``launcher resume``), with ``key=value`` changes checked as
    retry's are; returns the pipeline's SweepResult."""
    return resubmit([run_dir], reason="resume", steps=steps, out=out, changes=changes)
