"""Staging: what a run dir holds before its job is submitted, written into its hidden staging dir
(``SweepDir.staging``) by one function for every way runs are launched: `launch` (and resume, retry,
reproduce, preflight and packs, which go through it) and a Hydra app's launcher plugin. Each hands the
points' records (``Staged``); everything written passes through the scrubber (a known secret value
under any key or in any text becomes secrets.REDACTED). A new record in every run dir is a field here
and one writer of RunDir."""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Dict, List, Optional

from launcher.archive import secrets, snapshot, software
from launcher.run.checks_record import ChecksRecord
from launcher.run.rundir import RunDir, SweepDir
from launcher.submit.spread import in_processes


@dataclass
class Staged:
    """One point's records before submission."""
    index: int
    config: Dict[str, Any]  # config.yaml, secrets already redacted (the caller's redaction: it knows how)
    run: Dict[str, Any]  # run.json (no status.json yet: a run without one is pending); once staged, as written
    overrides: Dict[str, Any]  # overrides.yaml: {"overrides": [...], "choices": {...}}
    checks: ChecksRecord  # checks.json: what was checked before it was queued, what was let through
    seeds: Optional[Dict[str, Any]] = None  # seeds.json (None: the program seeds itself, unknown)
    plan: Optional[Dict[str, Any]] = None  # plan.json (the recipe's planner), most points of a sweep share it
    data: Optional[Dict[str, Any]] = None  # the datasets' manifest record: points that share it share the object


def write_shared(sd: SweepDir, code_dir: Path, snap: Dict[str, Any], known: secrets.Known) -> None:
    """The records every run of the sweep holds alike, once, in its shared dir (each run links them in
    when it starts, RunDir.adopt_shared): the code (git, patch, snapshot) and the software."""
    clean = lambda obj: secrets.scrub_tree(obj, known)  # noqa: E731
    patch_path = code_dir / snapshot.PATCH_FILE
    patch = clean(patch_path.read_text() if patch_path.exists() else "")
    git = clean({k: v for k, v in (snap.get("git") or {}).items() if k != "patch"})
    meta = clean({**{k: v for k, v in snap.items() if k != "git"}, "path": str(code_dir)})
    shared = sd.shared()
    shared.write_code(git, patch, meta)
    shared.write_software(clean(software.versions()), clean(software.pip_freeze()))


def stage(sd: SweepDir, points: List[Staged], known: secrets.Known) -> List[RunDir]:
    """Each point's staging dir: config.yaml, run.json, its plan and data manifest (each distinct one
    written once and linked into its runs), and the sweep's points record (seeds and overrides of every
    point in one file: each run writes its own seeds.json and overrides.yaml from it when it starts)."""
    clean = lambda obj: secrets.scrub_tree(obj, known)  # noqa: E731
    sd.add_points({str(p.index): {"seeds": clean(p.seeds), "overrides": clean(p.overrides)} for p in points})
    shared = sd.shared()
    plan_of = {p.index: json.dumps(clean(p.plan), sort_keys=True) for p in points if p.plan is not None}
    plans: Dict[str, RunDir] = {}
    for text in dict.fromkeys(plan_of.values()):
        plans[text] = RunDir(shared.path / f".plan-{len(plans)}")
        plans[text].write_plan(json.loads(text))
    checks_of = {p.index: replace(p.checks, forced=tuple(clean(list(p.checks.forced))),
                                  advice=tuple(clean(list(p.checks.advice)))) for p in points}
    checks: Dict[ChecksRecord, RunDir] = {}  # most points of a sweep were checked alike: one file, linked
    for record in dict.fromkeys(checks_of.values()):
        checks[record] = RunDir(shared.path / f".checks-{len(checks)}")
        checks[record].write_checks(record)
    datas: Dict[int, RunDir] = {}  # by the record object: a corpus's manifest lists every input file
    for p in points:
        if p.data is not None and id(p.data) not in datas:
            datas[id(p.data)] = RunDir(shared.path / f".data-{len(datas)}")
            datas[id(p.data)].write_data_manifest(clean(p.data))

    def one(p: Staged) -> Dict[str, Any]:
        rd = sd.staging(p.index)
        if p.index in plan_of:
            rd.link_from(plans[plan_of[p.index]], (RunDir.PLAN,))
        if p.data is not None:
            rd.link_from(datas[id(p.data)], (RunDir.DATA_MANIFEST,))
        rd.link_from(checks[checks_of[p.index]], (RunDir.CHECKS,))
        rd.write_config(p.config)
        return rd.write_run(clean(p.run))  # what the index row holds (registry.record), without reading it back

    # a few files per run: the interpreter's work and the file system's, spread over the host's cores
    for p, written in zip(points, in_processes(one, points)):
        p.run = written
    return [sd.staging(p.index) for p in points]


def publish(sd: SweepDir, indices: List[int]) -> List[RunDir]:
    """Each staged run renamed into place (the renames spread as the writes were), the shared plan and
    data copies removed (each run holds its own link), and a run that ended already (a refused
    submission) sealed."""
    import shutil

    def put(index: int) -> bool:
        rd = sd.publish(index)
        return rd.exists() and rd.is_final()

    ended = in_processes(put, indices)
    shared = sd.shared().path
    for linked in [*shared.glob(".plan-*"), *shared.glob(".data-*"), *shared.glob(".checks-*")]:
        shutil.rmtree(linked, ignore_errors=True)
    published = [sd.run(i) for i in indices]
    for rd, final in zip(published, ended):
        if final:
            rd.seal()
    return published
