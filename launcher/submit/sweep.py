"""One path for every launch: validate all points, archive them, submit them, report.

A single run is a sweep of one point. Points that share cluster resources go out as ONE submitit
batch (one Slurm array job); nothing is written or submitted unless every point is valid.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from launcher import layout as layout_mod
from launcher.archive import atomic, bundle
from launcher.layout import ConfigError, ConfigErrors
from launcher.schema import enum_value
from launcher.submit import executors


@dataclass
class Point:
    cfg: DictConfig  # composed run config (no hydra node)
    overrides: List[str] = field(default_factory=list)
    choices: Dict[str, Any] = field(default_factory=dict)


@dataclass
class SubmittedRun:
    run_id: str
    run_dir: Path
    job_id: Optional[str] = None
    job: Any = None


@dataclass
class SweepResult:
    sweep_id: str
    sweep_dir: Optional[Path]
    runs: List[SubmittedRun]
    job_ids: List[str]
    dry_run: bool = False


class InvalidSweep(ValueError):
    """At least one point is invalid; nothing was submitted."""


def _resolve(point: Point, index: int) -> Dict[str, Any]:
    try:
        return OmegaConf.to_container(point.cfg, resolve=True, enum_to_str=True)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "?"
        raise ConfigErrors([ConfigError(str(key), f"cannot be resolved: {e.msg if hasattr(e, 'msg') else e}", "fix the interpolation")], f"(point {index})")


def validate(points: List[Point], plans: Optional[List[Dict[str, Any]]] = None) -> List[layout_mod.Layout]:
    """Check every point: config rules, then the planner's pre-submit checks (memory fits, pipeline
    bubble, ZeRO-3 over a slow link). Raise InvalidSweep listing every bad point (and submit nothing);
    warnings stop the launch too unless submit.force=true (then they go to stderr). ``plans``, when
    given, receives each point's planner estimate (written to <run_dir>/plan.json)."""
    from launcher.plan import checks

    problems: List[str] = []
    warned: List[str] = []
    layouts: List[layout_mod.Layout] = []
    for i, p in enumerate(points):
        where = f"point {i} ({' '.join(p.overrides) or 'defaults'})" if len(points) > 1 else "run"
        try:
            _resolve(p, i)
            layouts.append(layout_mod.resolve(p.cfg))
            res = checks.evaluate(p.cfg)
            if plans is not None:
                plans.append(res.plan)
            if res.errors:
                raise ConfigErrors(res.errors)
        except ConfigErrors as e:
            problems.append(f"{where}:\n" + "\n".join(f"  - {err}".replace("\n", "\n    ") for err in e.errors))
            continue
        if res.warnings:
            if bool(p.cfg.submit.force):
                for w in res.warnings:
                    print(f"launch: warning ({where}, submit.force=true): {w}", file=sys.stderr)
            else:
                warned.append(f"{where}:\n" + "\n".join(f"  - warning: {w}" for w in res.warnings))
    if problems or warned:
        total = len(points)
        bad = len(problems) + len(warned)
        head = f"{bad} of {total} point(s) invalid; nothing was submitted" if total > 1 else "invalid config; nothing was submitted"
        if warned:
            head += " (warnings stop the launch: submit.force=true launches anyway; errors cannot be forced)"
        raise InvalidSweep(head + "\n" + "\n".join(problems + warned))
    return layouts


def launch(
    points: List[Point],
    argv: Optional[List[str]] = None,
    out=None,
    code_snapshot: Optional[Path] = None,
    extra_meta: Optional[Dict[str, Any]] = None,
) -> SweepResult:
    """Validate, archive and submit `points`. `code_snapshot` reuses an existing snapshot (reproduce)
    instead of taking one of the working tree; `extra_meta` is added to each run.json."""
    out = out or sys.stdout
    argv = list(sys.argv if argv is None else argv)
    plans: List[Dict[str, Any]] = []
    layouts = validate(points, plans)
    first = points[0].cfg
    runs_root = Path(str(first.submit.runs_root)).expanduser().resolve()
    sweep_id = bundle.new_sweep_id()
    sweep_dir = runs_root / sweep_id
    folder = sweep_dir / ".submitit"
    groups = _group(points)
    code_dir = Path(code_snapshot) if code_snapshot else sweep_dir / "code"

    if bool(first.submit.dry_run):
        return _dry_run(points, groups, sweep_id, folder, code_dir, out)

    from launcher.archive import code, secrets, snapshot, software
    from recipes.common.seeding import seed_plan

    if code_snapshot is None:  # once per launch, shared by every point of the sweep
        snapshot.take(code.repo_root(Path.cwd()) or code.repo_root(Path(__file__).resolve().parent)
                      or Path.cwd(), code_dir)
    snap = snapshot.info(code_dir) or {}
    # values to keep out of every archived text: secret-named variables here and in cluster.env
    known = dict(os.environ)
    for p in points:
        known.update({str(k): str(v) for k, v in dict(p.cfg.cluster.env).items()})
    code_state = snap.get("git") or {}
    patch = secrets.scrub((code_dir / snapshot.PATCH_FILE).read_text() if (code_dir / snapshot.PATCH_FILE).exists()
                          else "", known)
    versions = software.versions()
    freeze = software.pip_freeze()
    runs: List[SubmittedRun] = []
    stage: Dict[int, Path] = {}
    for i, (p, lay) in enumerate(zip(points, layouts)):
        rid = bundle.run_id_for(sweep_id, i)
        stage[i] = sweep_dir / f".{i}.partial"  # invisible until complete and submitted
        resolved = _resolve(p, i)
        resolved["parallelism"]["engine"] = lay.engine  # archive the concrete engine, not "auto"
        atomic.write_json(stage[i] / "plan.json", plans[i])
        atomic.write_json(stage[i] / "seeds.json", seed_plan(resolved["seed"], resolved["data"].get("seed"), lay.dp))
        atomic.write_json(stage[i] / "code" / "snapshot.json", {**{k: v for k, v in snap.items() if k != "git"},
                                                                 "path": str(code_dir)})
        bundle.write_run(
            stage[i],
            run_id=rid,
            sweep_id=sweep_id,
            index=i,
            resolved=secrets.redact_config(resolved),
            overrides=[secrets.scrub(o, known) for o in p.overrides],
            choices=p.choices,
            argv=[secrets.scrub(a, known) for a in argv],
            layout=lay.__dict__,
            code={**code_state, "patch": patch},
            software=versions,
            pip_freeze=freeze,
            extra=extra_meta,
        )
        runs.append(SubmittedRun(run_id=rid, run_dir=sweep_dir / str(i)))

    from launcher.runtime.task import RunTask

    job_ids: List[str] = []
    try:
        for key, idxs in groups.items():
            cfg = points[idxs[0]].cfg
            backend = enum_value(cfg.cluster.backend)
            with executors.job_environment(cfg, code_dir):
                ex = executors.make_executor(cfg, folder, code_dir)
                try:
                    with ex.batch():
                        jobs = [ex.submit(RunTask(str(runs[i].run_dir))) for i in idxs]
                except Exception as e:  # refused: the runs become visible as failed, with the reason
                    for i in idxs:
                        bundle.set_status(stage[i], "failed", exit_code=None, error=f"submission failed: {e}")
                    raise
            sbatch = None
            if backend == "slurm":
                sbatch = secrets.scrub(executors.sbatch_text(cfg, folder, len(idxs), code_dir), known)
            for i, job in zip(idxs, jobs):
                r = runs[i]
                r.job, r.job_id = job, str(job.job_id)
                array_id, _, task = r.job_id.partition("_")
                if sbatch:
                    atomic.write_text(stage[i] / "sbatch.sh", sbatch)
                atomic.write_json(
                    stage[i] / bundle.JOB_FILE,
                    {
                        "backend": backend,
                        "job_id": r.job_id,
                        "array_job_id": array_id if task else None,
                        "array_task_id": int(task) if task else None,
                        "submitit_folder": str(folder),
                        "stdout": str(job.paths.stdout),
                        "stderr": str(job.paths.stderr),
                        "num_tasks": int(cfg.cluster.nodes) * int(cfg.cluster.gpus_per_node),
                        "submitted": bundle.now_iso(),
                    },
                )
                bundle.set_status(stage[i], "pending", job_id=r.job_id)
            job_ids.append(str(jobs[0].job_id).partition("_")[0] if len(jobs) > 1 else str(jobs[0].job_id))
    finally:
        for i, r in enumerate(runs):
            if stage[i].exists():
                os.replace(stage[i], r.run_dir)
        from launcher.archive import registry

        registry.record(runs_root, [r.run_dir for r in runs if r.run_dir.exists()])

    atomic.write_json(
        sweep_dir / "sweep.json",
        {
            "sweep_id": sweep_id,
            "created": bundle.now_iso(),
            "argv": [secrets.scrub(a, known) for a in argv],
            "num_runs": len(runs),
            "job_ids": job_ids,
            "backend": enum_value(first.cluster.backend),
            "runs": [r.run_id for r in runs],
            "code_snapshot": str(code_dir),
        },
    )
    result = SweepResult(sweep_id=sweep_id, sweep_dir=sweep_dir, runs=runs, job_ids=job_ids)
    _print_submitted(result, enum_value(first.cluster.backend), out)
    wait = first.submit.wait
    if wait is None:
        wait = enum_value(first.cluster.backend) == "local"
    if wait:
        from launcher.submit.progress import wait_and_report

        ok = wait_and_report(result, points, out, timeout_s=int(first.submit.wait_timeout_s))
        if not ok:
            raise SystemExit(1)
    return result


def _group(points: List[Point]) -> Dict[str, List[int]]:
    groups: Dict[str, List[int]] = {}
    for i, p in enumerate(points):
        groups.setdefault(executors.executor_key(p.cfg), []).append(i)
    return groups


def _dry_run(points, groups, sweep_id, folder, code_dir, out) -> SweepResult:
    for i, p in enumerate(points):
        print(f"# ---- point {i}: {' '.join(p.overrides) or '(defaults)'}", file=out)
        print(OmegaConf.to_yaml(OmegaConf.create(_resolve(p, i))), file=out)
    for key, idxs in groups.items():
        cfg = points[idxs[0]].cfg
        if enum_value(cfg.cluster.backend) == "slurm":
            print(f"# ---- sbatch script for points {idxs} ({len(idxs)} array task(s))", file=out)
            print(executors.sbatch_text(cfg, folder, len(idxs), code_dir), file=out)
        else:
            print(f"# ---- local: points {idxs}, {cfg.cluster.gpus_per_node} process(es) each", file=out)
    print(f"# dry run: nothing submitted ({len(points)} point(s))", file=out)
    return SweepResult(sweep_id=sweep_id, sweep_dir=None, runs=[], job_ids=[], dry_run=True)


def _print_submitted(result: SweepResult, backend: str, out) -> None:
    n = len(result.runs)
    what = "array job" if n > 1 and len(result.job_ids) == 1 else "job(s)"
    print(f"sweep {result.sweep_id}: {n} run(s) submitted ({backend}), {what} {', '.join(result.job_ids)}", file=out)
    for r in result.runs:
        print(f"  {r.run_id}  job {r.job_id}  {r.run_dir}", file=out)
    root = result.sweep_dir.parent if result.sweep_dir else ""
    print(f"watch: launcher runs --sweep {result.sweep_id} --root {root}", file=out)
    out.flush()
