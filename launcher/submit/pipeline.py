"""The launch pipeline, one step a function, read top to bottom in ``launch``:

    validate every point  ->  dry run (print, submit nothing)
                          or  create the sweep dir  ->  stage each run  ->  submit  ->  publish

A single run is a sweep of one point. Each point is resolved once (``validate``); points that share
their backend's grouping key go out as ONE submitit batch (one Slurm array job; launcher.submit.submission,
the submission path every launcher shares). Nothing is written or submitted unless every point is valid;
a staged run becomes visible (``publish``) only whole. Waiting and exit codes are the app's (launcher.app).
"""
from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from launcher import backends, script_recipe
from launcher.archive import atomic, index as run_index, secrets, snapshot, yamlio
from launcher.config import group_options, recipe_contract, recipe_target, rules, schema
from launcher.config.errors import ConfigError, ConfigErrors
from launcher.config.layout import Layout
from launcher.config.recipe_target import is_script
from launcher.config.rules import resolve
from launcher.config.view import ConfigView
from launcher.data import archived as data_archive, checks as data_checks
from launcher.run.checks_record import LAUNCH, ChecksRecord
from launcher.run.rundir import RunDir, SweepDir
from launcher.submit import interrupted, spread, submission, waves
from launcher.submit.source import config_targets, snapshot_root, source_root  # noqa: F401 (tests read them here)
from launcher.submit.submission import Array, SubmittedRun
from launcher.sweeps import Unschedulable, job_name


@dataclass
class Point:
    cfg: schema.RunConfig  # composed run config (no hydra node): a DictConfig, or a ConfigView over ``resolved``
    overrides: List[str] = field(default_factory=list)
    choices: Dict[str, Any] = field(default_factory=dict)
    resolved: Optional[Dict[str, Any]] = None  # already resolved (launcher.config.compose.SweepComposer's fast path)
    # group -> names of <group>.name accepted though no config dir provides them (a reproduction: the
    # archived run's, launcher.config.group_options)
    accepted_names: Dict[str, List[str]] = field(default_factory=dict)
    config_dirs: Tuple[str, ...] = ()  # the search path's dirs beyond conf/ it was composed from (--config-dir)

    @classmethod
    def of_resolved(cls, resolved: Dict[str, Any], overrides: List[str], choices: Dict[str, Any],
                    config_dirs: Tuple[str, ...] = ()) -> Point:
        return cls(cfg=ConfigView(resolved), overrides=overrides, choices=choices, resolved=resolved,
                   config_dirs=config_dirs)


@dataclass
class Checked:
    """A valid point: its config resolved once, its layout, its planner estimate, its backend."""

    point: Point
    index: int
    resolved: Dict[str, Any]
    layout: Layout
    plan: Optional[Dict[str, Any]]  # None: the recipe has no planner (no plan.json)
    backend: backends.Backend
    checks: ChecksRecord  # checks.json: the warnings forced, the advice printed
    archived: Optional[Dict[str, Any]] = None  # config.yaml as staged (secrets redacted)
    run_record: Optional[Dict[str, Any]] = None  # run.json as staged
    known: Optional[Dict[str, str]] = None  # the secrets of every point of the launch (one dict, shared)

    @cached_property
    def run_config(self) -> Dict[str, Any]:
        """The config the run archives and its job reads: the resolution as checked, with the checked
        layout's concrete engine for ``parallelism.engine`` (never "auto"). Validation leaves
        ``resolved`` as it checked it; the engine it chose is ``layout.engine``."""
        return {**self.resolved, "parallelism": {**self.resolved["parallelism"], "engine": self.layout.engine}}

    @cached_property
    def written(self) -> Any:
        """The point's config as written (interpolations unresolved): which secrets are references."""
        cfg = self.point.cfg
        return OmegaConf.to_container(cfg, resolve=False, enum_to_str=True) if OmegaConf.is_config(cfg) else None

    @cached_property
    def lifted(self) -> Dict[str, str]:
        """Its secret literals, by the variable that carries each to the job (secrets.lifted_secrets)."""
        return secrets.lifted_secrets(self.resolved, self.written)


@dataclass
class SweepResult:
    sweep_id: str
    sweep_dir: Optional[Path]
    runs: List[SubmittedRun]
    job_ids: List[str]
    backend: Optional[backends.Backend] = None
    dry_run: bool = False

    def run_ids(self, indices: List[int]) -> List[Optional[str]]:
        """The run id of each point index: queued now or waiting for a wave (published at launch all
        the same, never in ``runs``); None for a dry run."""
        if self.dry_run or self.sweep_dir is None:
            return [None] * len(indices)
        return [f"{self.sweep_id}-{i}" for i in indices]


class InvalidSweep(ValueError):
    """At least one point is invalid; nothing was submitted."""


@dataclass
class _Sweep:
    """What every run of one launch shares."""

    dir: SweepDir
    code_dir: Path
    snapshot: Dict[str, Any]
    known: Dict[str, str]  # values to keep out of every archived text
    argv: List[str]
    extra_meta: Optional[Dict[str, Any]]
    joined: bool = False  # the points join an existing sweep (its shared records are already written)


# ---- 1. validate ---------------------------------------------------------------------------------


def _resolve(point: Point, index: int) -> Dict[str, Any]:
    """The point's config resolved, without the groups of a recipe it does not run (schema.own_config)."""
    if point.resolved is not None:
        return schema.own_config(point.resolved, point.overrides)
    try:
        return schema.own_config(OmegaConf.to_container(point.cfg, resolve=True, enum_to_str=True), point.overrides)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "?"
        raise ConfigErrors([ConfigError(str(key), f"cannot be resolved: {getattr(e, 'msg', e)}",
                                        "fix the interpolation")], f"(point {index})") from e


def _check(p: Point, i: int, searched: Dict[Tuple[str, ...], Dict[str, group_options.Group]]) -> Tuple[Any, ...]:
    """One point resolved and checked, nothing printed: ``(errors, resolved, None...)`` where it is
    invalid (``resolved`` None where it could not be resolved), else ``(None, resolved, layout, plan,
    warnings, advice)``. No side effect outside the point: a large launch runs it for half its points in
    a forked child (spread.in_processes)."""
    resolved: Optional[Dict[str, Any]] = None
    try:
        resolved = _resolve(p, i)
        view = ConfigView(resolved)  # the rules read the resolution, not the DictConfig (faster)
        named = group_options.problems(resolved, searched[p.config_dirs], p.accepted_names)
        try:
            lay = resolve(view, resolved)
        except ConfigErrors as e:
            raise ConfigErrors(named + e.errors) from None
        if named:
            raise ConfigErrors(named)
        planner = recipe_contract.of(recipe_contract.tree_get(resolved, "recipe._target_")).planner
        res = planner(view, lay) if planner is not None else recipe_contract.CheckResult()
        if res.errors:
            raise ConfigErrors(res.errors)
    except ConfigErrors as e:
        return list(e.errors), resolved, None, None, None, None
    advice = rules.advice(resolved)
    data_checks.make_absolute(resolved)  # the job reads its datasets from its run dir's work/
    return None, resolved, lay, res.plan, list(res.warnings), advice


def validate(points: List[Point], indices: Optional[List[int]] = None) -> List[Checked]:
    """Every point against the config rules (the shared rows and its recipe's), then its recipe's planner
    where its contract has one (memory fits, pipeline bubble, a slow link). Raise InvalidSweep listing every
    bad point; warnings stop the launch too unless submit.force=true (then they go to stderr and the run's
    checks.json). ``indices``: the points' run indices in their sweep (default 0..n-1)."""
    # the points of a launch share their search path: its dirs are listed once, before any fork
    searched = {dirs: group_options.groups(group_options.search_dirs(dirs)) for dirs in {p.config_dirs for p in points}}
    outcomes = spread.in_processes(lambda i: _check(points[i], i, searched), list(range(len(points))), pickled=True)
    # the messages below echo overrides: secrets of every point, read from its resolution (or, where
    # that failed, from its config as written)
    known = secrets.known_secrets([o[1] if o[1] is not None else p.cfg for p, o in zip(points, outcomes)])
    problems: List[str] = []
    warned: List[str] = []
    advised: List[str] = []
    good: List[Checked] = []
    for i, (p, (errors, resolved, lay, plan, warnings, advice_lines)) in enumerate(zip(points, outcomes)):
        where = (secrets.scrub(f"point {i} ({' '.join(p.overrides) or 'defaults'})", known) if len(points) > 1
                 else "run")
        if errors is not None:
            problems.append(f"{where}:\n" + "\n".join(f"  - {err}".replace("\n", "\n    ") for err in errors))
            continue
        forced = [secrets.scrub(w, known) for w in warnings] if bool(p.cfg.submit.force) else []
        for w in forced:
            print(f"launch: warning ({where}, submit.force=true): {w}", file=sys.stderr)
        if warnings and not forced:
            warned.append(f"{where}:\n" + "\n".join(f"  - warning: {w}" for w in warnings))
        advice = [secrets.scrub(line, known) for line in advice_lines]
        for line in advice:  # once per launch, whatever the number of points
            if line not in advised:
                advised.append(line)
                print(f"launch: warning: {line}", file=sys.stderr)
        index = indices[i] if indices is not None else i
        checks = ChecksRecord(LAUNCH, forced=tuple(forced), advice=tuple(advice))
        good.append(Checked(p, index, resolved, lay, plan, backends.of(p.cfg), checks, known=known))
    lifted: Dict[str, str] = {}
    for c in good:  # a secret literal travels to the job in one variable per key: one value per launch
        for name, value in c.lifted.items():
            if lifted.setdefault(name, value) != value:
                problems.append(f"{name}:\n  - points of this launch give this secret-named key different "
                                "values; fix: give each its own variable (key='${oc.env:NAME}', NAME exported)")
    seen = set()
    for c in good:  # the jobs read and write their run dirs: the nodes must see the runs root
        root = Path(str(c.point.cfg.submit.runs_root)).expanduser().absolute()
        if (c.backend.name, root) not in seen:
            seen.add((c.backend.name, root))
            # the jobs must see the runs root, and SQLite must open the run index in it
            problem = run_index.root_problem(root) or c.backend.runs_root_problem(root, c.point.cfg)
            if problem:
                problems.append(f"submit.runs_root:\n  - {problem}")
    if problems or warned:
        total, bad = len(points), len(problems) + len(warned)
        head = (f"{bad} of {total} point(s) invalid; nothing was submitted" if total > 1
                else "invalid config; nothing was submitted")
        if warned:
            head += " (warnings stop the launch: submit.force=true launches anyway; errors cannot be forced)"
        raise InvalidSweep(secrets.scrub(head + "\n" + "\n".join(problems + warned), known))
    return good


def arrays(checked: List[Checked], preview: Optional[List[str]] = None,
           left: Optional[List[Checked]] = None) -> List[Array[Checked]]:
    """The submissions of a launch (launcher.submit.submission.arrays): points of equal resources
    share one, split under the scheduler's limits. Raises InvalidSweep, before anything is written
    or submitted, when the sweep needs more jobs than the user may queue (``preview``, a dry run's notes:
    more than the limits hold with nothing queued; the room at this moment is a line in it; ``left``:
    the points past the room are put there, for the sweep's waves)."""
    try:
        return submission.arrays(checked, cfg=lambda c: c.point.cfg, preview=preview, left=left)
    except Unschedulable as e:  # TooManyJobs among them
        raise InvalidSweep(str(e)) from None


def sweep_job_name(checked: List[Checked], sweep_id: str) -> str:
    """The job name every submission of the launch carries: the name (submit.job_name) its points
    share, else ``sweep-<sweep_id>``."""
    return job_name([str(c.resolved["submit"]["job_name"]) for c in checked], sweep_id)


# ---- 2a. dry run ---------------------------------------------------------------------------------


def dry_run(checked: List[Checked], runs_root: Path, out) -> SweepResult:
    """Print each point's resolved config and each group's submission preview, as the archive would
    hold them (secrets redacted); write and submit nothing."""
    notes: List[str] = []
    waiting: Optional[List[Checked]] = [] if waves.allowed(checked[0].point.cfg) else None
    planned = arrays(checked, preview=notes, left=waiting)  # the limits, not the queue's room this minute
    if waiting:
        notes.append(f"{len(waiting)} of the {len(checked)} points would wait for room: the sweep's wave job "
                     "queues them as each wave ends (submit.waves)")
    for line in notes:
        print(f"launch: note: {line}", file=sys.stderr)
    known = _known_secrets(checked, snapshot_root(checked))  # as create() gathers them
    sweep = SweepDir.new(runs_root)
    name = sweep_job_name(checked, sweep.sweep_id)
    for c in checked:
        print(f"# ---- point {c.index}: {secrets.scrub(' '.join(c.point.overrides) or '(defaults)', known)}", file=out)
        # the text the archive's config.yaml would hold (yamlio: each distinct section emitted once)
        print(yamlio.dump(secrets.redact_config(c.run_config, known, raw=c.written)), file=out)
    for arr in planned:
        idxs = [c.index for c in arr.points]
        first = arr.points[0]
        if arr.pack_nodes is not None:  # one job of pack_nodes nodes whose runner starts the points as steps
            preview = first.backend.pack_preview(first.point.cfg, sweep.submitit_folder, idxs, arr.pack_nodes,
                                                 sweep.code_dir, job_name=name)
        else:
            preview = first.backend.preview(first.point.cfg, sweep.submitit_folder, idxs, sweep.code_dir,
                                            job_name=name, parallelism=arr.parallelism)
        print(secrets.scrub(preview, known), file=out)
    print(f"# dry run: nothing submitted ({len(checked)} point(s))", file=out)
    return SweepResult(sweep_id=sweep.sweep_id, sweep_dir=None, runs=[], job_ids=[], dry_run=True)


# ---- 2b. create the sweep dir --------------------------------------------------------------------


def create(checked: List[Checked], runs_root: Path, argv: List[str], code_snapshot: Optional[Path],
           extra_meta: Optional[Dict[str, Any]], into: Optional[Path] = None) -> _Sweep:
    """The sweep dir and the code snapshot every point runs (taken once per launch, or reused).
    ``into``: an existing sweep dir the points join (a later batch of one multirun: its snapshot)."""
    sd = SweepDir(into) if into is not None else SweepDir.new(runs_root)
    interrupted.begin(sd.path, checked[0].backend.name, [c.index for c in checked])  # before anything else
    if into is not None and code_snapshot is None:  # the snapshot the sweep's first batch runs
        code_snapshot = (sd.read() or {}).get("code_snapshot") or sd.code_dir
    code_dir = Path(code_snapshot) if code_snapshot else sd.code_dir
    root = snapshot_root(checked) if code_snapshot is None else None
    known = _known_secrets(checked, root)
    if root is not None:
        try:
            taken = snapshot.take(root, code_dir, known=known, exclude=[runs_root], tree_included=True,
                                  imports=[str(c.resolved["recipe"]["_target_"]).split(".")[0] for c in checked])
        except OSError as e:  # a full disk, a read-only runs root: its partial copy goes with the new sweep dir
            discard(sd, joined=into is not None, indices=[])
            raise InvalidSweep(unwritable(runs_root, e)) from None
        except KeyboardInterrupt:  # SIGINT/SIGTERM/SIGHUP: nothing queued, nothing of this launch kept
            undo(sd, checked, made=into is None, runs_root=runs_root)
            raise
        for line in snapshot.left_out_warnings(taken):
            print(f"warning: {line}", file=sys.stderr)
    return _Sweep(sd, code_dir, snapshot.info(code_dir) or {}, known, argv, extra_meta, joined=into is not None)


def _known_secrets(checked: List[Checked], root: Optional[Path]) -> Dict[str, str]:
    """Secret-named values of the environment and of every point's config (cluster.env included), and
    secret literals written in the source tree ``root``: kept out of the snapshot and of everything
    staged or printed, whatever key they appear under."""
    known = dict(checked[0].known) if checked and checked[0].known is not None else \
        secrets.known_secrets([c.resolved for c in checked])
    if root is not None:
        known.update(snapshot.tree_secrets(root))
    return known


# ---- 3. stage each run ---------------------------------------------------------------------------


def stage(sweep: _Sweep, checked: List[Checked]) -> List[RunDir]:
    """Each point's records, staged (launcher.submit.staging: the one staging, a Hydra app's too); the
    code and software records once per sweep (a later batch of one multirun joins the first's)."""
    # lazy: a dry run never stages, submits or publishes
    from launcher.config.seeding import seed_plan
    from launcher.submit import staging

    if not sweep.joined:  # a later batch: the first one wrote them, and its runs may be reading them
        staging.write_shared(sweep.dir, sweep.code_dir, sweep.snapshot, sweep.known)
    argv = list(sweep.argv)
    data_of: Dict[Any, Dict[str, Any]] = {}  # one record per distinct set of datasets, not per point
    points = []
    for c in checked:
        r = c.run_config
        c.archived = secrets.redact_config(r, sweep.known, raw=c.written)
        sig = data_archive.signature(r)
        if sig is not None and sig not in data_of:
            data_of[sig] = data_archive.record(r)
        points.append(staging.Staged(
            index=c.index, config=c.archived, plan=c.plan, data=data_of.get(sig),
            seeds={"not_used_by_recipe": f"{script_recipe.NOT_USED}: recipe=script seeds itself"}
            if is_script(r.get("recipe")) else seed_plan(r["seed"], r["data"].get("seed"), c.layout.dp),
            overrides={"overrides": list(c.point.overrides), "choices": dict(c.point.choices)}, checks=c.checks,
            run={"run_id": sweep.dir.run_id(c.index), "sweep_id": sweep.dir.sweep_id, "index": c.index,
                 "name": r.get("name"), "seed": r.get("seed"), "tags": r.get("tags", []), "backend": c.backend.name,
                 "argv": argv, "layout": c.layout.to_json(), **(sweep.extra_meta or {}),
                 **script_recipe.archived(r, c.layout.to_json())}))  # recipe=script: what the script never read
    staged = staging.stage(sweep.dir, points, sweep.known)
    for c, p in zip(checked, points):
        c.run_record = p.run
    return staged


# ---- 4. submit ----------------------------------------------------------------------------------


def runs_of(sweep: _Sweep, arr: Array[Checked]) -> Array[submission.Run]:
    """An array of checked points as submission takes it: each a RunTask of its run dir, staged."""
    from launcher.runtime.task import RunTask  # lazy: a dry run never stages, submits or publishes

    return Array([submission.Run(
        run_id=sweep.dir.run_id(c.index), rundir=sweep.dir.run(c.index), stage=sweep.dir.staging(c.index),
        task=RunTask(str(sweep.dir.run(c.index).path)), cfg=c.point.cfg, code_dir=sweep.code_dir,
        folder=sweep.dir.submitit_folder, shared=sweep.dir.shared(), num_tasks=c.layout.world_size)
        for c in arr.points], arr.parallelism, pack_nodes=arr.pack_nodes)


# ---- 5. publish ----------------------------------------------------------------------------------


def publish(sweep: _Sweep, checked: List[Checked], runs: List[SubmittedRun], job_ids: List[str]) -> List[RunDir]:
    """Rename every staged run into place, seal the ones that already ended (refused submissions),
    write sweep.json, then index them (last: the index can always be rebuilt from the dirs)."""
    from launcher.archive import registry, secrets  # lazy: a dry run never stages, submits or publishes
    from launcher.submit import staging

    published = staging.publish(sweep.dir, [c.index for c in checked])
    sweep.dir.extend({
        "sweep_id": sweep.dir.sweep_id, "argv": [secrets.scrub(a, sweep.known) for a in sweep.argv],
        "job_ids": job_ids, "backend": checked[0].backend.name, "runs": [r.run_id for r in runs],
        "code_snapshot": str(sweep.code_dir),
    })
    archived = {str(rd.path): c.archived for c, rd in zip(checked, published) if c.archived is not None}
    jobs = {r.run_id: r.record for r in runs}
    held = {str(rd.path): registry.Held(c.run_record, jobs.get(c.run_record["run_id"]))
            for c, rd in zip(checked, published) if c.run_record is not None}
    registry.record(sweep.dir.path.parent, [rd for rd in published if rd.exists()], configs=archived, held=held)
    interrupted.end(sweep.dir.path)
    return published


# ---- the pipeline --------------------------------------------------------------------------------


def launch(points: List[Point], argv: Optional[List[str]] = None, out=None, code_snapshot: Optional[Path] = None,
           extra_meta: Optional[Dict[str, Any]] = None, into: Optional[Path] = None,
           indices: Optional[List[int]] = None) -> SweepResult:
    """Check, archive and submit ``points``. ``code_snapshot`` reuses an existing snapshot (reproduce)
    instead of taking one of the working tree; ``extra_meta`` is added to each run.json. ``into`` and
    ``indices``: the points join that existing sweep as those runs (a later batch of one multirun,
    with its code snapshot) instead of making a new sweep numbered from 0."""
    out = out or sys.stdout
    argv = list(sys.argv if argv is None else argv)
    with recipe_target.searched_in(code_snapshot):  # a reproduction imports from its snapshot, not the cwd
        checked = validate(points, indices)
    first = checked[0].point.cfg
    runs_root = Path(str(first.submit.runs_root)).expanduser().resolve()
    if bool(first.submit.dry_run):
        return dry_run(checked, runs_root, out)

    # past the room: queued in waves (a new sweep's; a later batch of a multirun joins one queued whole)
    waiting: Optional[List[Checked]] = [] if waves.allowed(first) and into is None else None
    planned = arrays(checked, left=waiting)  # the scheduler's limits: without waves, a sweep too large is refused
    sweep: Optional[_Sweep] = None
    try:
        sweep = create(checked, runs_root, argv, code_snapshot, extra_meta, into)
        try:
            with atomic.deferred_sync(private=True):  # staged dirs are hidden: one flush, before any job may start
                stage(sweep, checked)
                if waiting:
                    waves.begin(sweep.dir, [c.index for c in waiting], checked[0].backend.name)
        except OSError as e:  # a full disk, a read-only runs root: nothing was submitted, nothing half-written stays
            discard(sweep.dir, joined=sweep.joined, indices=[c.index for c in checked])
            raise InvalidSweep(unwritable(runs_root, e)) from None
        name = sweep_job_name(checked, sweep.dir.sweep_id)
        export_lifted(checked)
    except KeyboardInterrupt:  # SIGINT/SIGTERM/SIGHUP before anything was queued: as if never launched
        undo(sweep.dir if sweep is not None else None, checked, made=into is None, runs_root=runs_root)
        raise
    def submit() -> Tuple[List[SubmittedRun], List[str]]:
        return submission.submit([runs_of(sweep, arr) for arr in planned], sweep.known,
                                 publish=lambda runs, job_ids: publish(sweep, checked, runs, job_ids),
                                 job_name=lambda _: name, whole=True,
                                 unsent=waves.unsent(sweep.dir) if waiting else None,
                                 queued=lambda job_id, runs: interrupted.queued(
                                     sweep.dir.path, job_id, [SweepDir.index_of(r.run_id) for r in runs]))
    runs, job_ids = waves.queue_launch(sweep.dir, first, submit) if waiting else submit()
    runs.sort(key=lambda r: SweepDir.index_of(r.run_id))
    result = SweepResult(sweep_id=sweep.dir.sweep_id, sweep_dir=sweep.dir.path, runs=runs, job_ids=job_ids,
                         backend=checked[0].backend)
    _print_submitted(result, out)
    return result


def unwritable(runs_root: Path, e: OSError) -> str:
    where = f" ({e.filename})" if e.filename else ""
    return (f"cannot write the sweep under submit.runs_root={runs_root}: {e.strerror or e}{where}; nothing was "
            "submitted, and what was written of it is removed")


def discard(sd: SweepDir, joined: bool, indices: List[int]) -> None:
    """What a launch that could not write its sweep left: the new sweep dir whole, or the staged runs
    of a batch that joined an existing sweep."""
    for path in ([sd.staging(i).path for i in indices] if joined else [sd.path]):
        shutil.rmtree(path, ignore_errors=True)


def undo(sd: Optional[SweepDir], checked: List[Checked], made: bool, runs_root: Path) -> None:
    """A launch interrupted before its first sbatch: its staged runs removed, and the sweep dir when
    this launch made it (a later batch of a multirun keeps the sweep its first batch made)."""
    from launcher.submit import signals  # lazy: a dry run never stages, submits or publishes

    with signals.shielded():
        if sd is None:  # interrupted while the sweep dir was being named: a new one, if any, is empty of runs
            return
        for c in checked:
            shutil.rmtree(sd.staging(c.index).path, ignore_errors=True)
        if made and sd.path.parent == runs_root:
            shutil.rmtree(sd.path, ignore_errors=True)
        else:
            interrupted.end(sd.path)


def export_lifted(checked: List[Checked]) -> None:
    """The secret literals of the points' configs, in the variables their archived configs reference:
    the submitted jobs inherit this environment (sbatch passes it on, local jobs are children)."""
    for c in checked:
        os.environ.update(c.lifted)


def _print_submitted(result: SweepResult, out) -> None:
    n = len(result.runs)
    packed = any(r.record is not None and r.record.pack_index is not None for r in result.runs)
    what = ("job" if n == 1 else ("pack job" if packed else "array job") if len(result.job_ids) == 1
            else f"{len(result.job_ids)} jobs")
    name = result.backend.name if result.backend else "?"
    print(f"sweep {result.sweep_id}: {n} run(s) submitted ({name}), {what} {', '.join(result.job_ids)}", file=out)
    for r in result.runs:
        print(f"  {r.run_id}  job {r.job_id}  {r.run_dir}", file=out)
    root = result.sweep_dir.parent if result.sweep_dir else ""
    plan = SweepDir(result.sweep_dir).waves() if result.sweep_dir else None
    if plan is not None:  # past the scheduler's room: the rest queued by the sweep's wave job
        print(f"  {plan.describe()} (the scheduler's submit limits; waves.json)", file=out)
    print(f"watch: launcher runs --sweep {result.sweep_id} --root {root}", file=out)
    out.flush()
