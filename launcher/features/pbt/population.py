"""sweep=pbt on the node: a member's report at a generation's boundary, the generation's decision
(launcher.features.pbt.generations), and carrying it out. No head process and no torch, as
launcher.features.asha.rungs (which calls this for a PBT rule): the sweep dir's ``rungs.jsonl`` holds
every report and every decided generation, written under the sweep's lock.

At a boundary rank 0 of a member records its objective. The member whose report completes the
generation (every member reported, or ended: the worst) decides it: the bottom members **exploit**
(the donor's checkpoint at that step copied into the member's run dir as its ``latest``, verified
against the checkpoint's own manifest of digests) and **explore** (their new values of the explored
keys written to the run's ``pbt_values.json``, which the runtime lays over the archived config when
an attempt starts: ``apply``). Each change is a row of the member's ``lineage.jsonl`` (generation,
step, donor run and its checkpoint's manifest sha256, values before and after) and of the sweep's
record. Then every paused member is resumed through its backend (restart reason ``promoted``), the
decider too where it changed (it pauses and is resumed as the others: its process holds the old
state); a decider that did not change goes on in place. Nobody is pruned.

``sweep.replay`` (launcher reproduce of a member): the decisions are the ones the named sweep dir
recorded, generation by generation, not computed again.
"""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional

from launcher.archive import atomic
from launcher.features.paused import pause_point, point_of, recorded, release
from launcher.features.pbt import generations as pbt
from launcher.run import checkpoint_manifest
from launcher.run.rundir import RunDir, SweepDir
from launcher.run.status import Status

VALUES = "pbt_values.json"  # the member's explored values now (laid over config.yaml at each attempt)
LINEAGE = "lineage.jsonl"  # one row per exploit: whose checkpoint at which step, which values
STAGE = ".pbt_stage"  # a donor's checkpoint is copied here, verified, then moved into checkpoints/


# ---- the member's values ---------------------------------------------------------------------------


def values_now(rd: RunDir) -> Dict[str, Any]:
    """The explored values a member trains with now (empty: its config's)."""
    return dict((atomic.read_json(rd.path / VALUES, default=None) or {}).get("values") or {})


def apply(rd: RunDir, plain: Dict[str, Any]) -> Dict[str, Any]:
    """Lay the member's explored values over its archived config (plain dicts, in place)."""
    for key, value in values_now(rd).items():
        node = plain
        *parents, last = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return plain


def current(rd: RunDir, keys: List[str]) -> Dict[str, Any]:
    tree = apply(rd, rd.config())
    return {k: pbt.lookup(tree, k)[1] for k in keys}


def lineage(rd: RunDir) -> List[Dict[str, Any]]:
    p = rd.path / LINEAGE
    if not p.is_file():
        return []
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]


def _append(path: Path, row: Mapping[str, Any]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


# ---- exploit ---------------------------------------------------------------------------------------


def manifest_sha256(ckpt: Path) -> str:
    return hashlib.sha256((ckpt / checkpoint_manifest.MANIFEST).read_bytes()).hexdigest()


def exploit(member: RunDir, donor: RunDir, step: int) -> Dict[str, Any]:
    """The donor's checkpoint at ``step`` made the member's latest (a copy, verified file by file against
    the donor's manifest); returns what the lineage records of it."""
    src = donor.checkpoint_dir(step)
    bad = checkpoint_manifest.problems(src)
    if bad:
        raise RuntimeError(f"the donor's checkpoint {src} does not verify: {'; '.join(bad)}")
    stage = member.path / STAGE
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir()
    staged = stage / src.name
    shutil.copytree(src, staged)
    bad = checkpoint_manifest.problems(staged)
    if bad:
        raise RuntimeError(f"the copy of {src} does not verify: {'; '.join(bad)}")
    dst = member.checkpoint_dir(step)
    if dst.exists():
        shutil.rmtree(dst)  # the member's own state at this step: replaced (its metrics stay in its lineage)
    dst.parent.mkdir(exist_ok=True)
    staged.rename(dst)
    shutil.rmtree(stage, ignore_errors=True)
    member.set_latest(dst)
    return {"donor_run": donor.run_id, "checkpoint": src.name, "checkpoint_sha256": manifest_sha256(dst)}


# ---- the generation --------------------------------------------------------------------------------


def _replayed(rule: pbt.Rule, gen: int) -> Optional[pbt.Generation]:
    """The recorded decision of generation ``gen`` in the sweep ``sweep.replay`` names."""
    recorded = pbt.generations(SweepDir(Path(str(rule.replay))).rung_rows())
    if gen not in recorded:
        raise RuntimeError(f"sweep.replay={rule.replay} recorded no generation {gen}")
    return recorded[gen]


def _complete(sd: SweepDir, rule: pbt.Rule, gen: int) -> Optional[Dict[int, Optional[float]]]:
    """Every member's report at ``gen`` (None: ended without one) once the generation is complete."""
    rows = sd.rung_rows()
    if gen in pbt.generations(rows):
        return None  # decided already
    reports = {int(r["point"]): r.get("value") for r in rows if r.get("kind") == "report" and r.get("rung") == gen}
    values: Dict[int, Optional[float]] = {}
    for r in sd.runs():
        p = point_of(r)
        if p in reports:
            values[p] = None if reports[p] is None else float(reports[p])
        elif r.status().is_final:
            values[p] = None
        else:
            return None
    return values


def _decide(sd: SweepDir, rule: pbt.Rule, gen: int, values: Dict[int, Optional[float]],
            me: Optional[int]) -> pbt.Generation:
    """Decide generation ``gen`` (or replay it), record it, apply every change; returns the decision."""
    alive = [p for p in values if p == me or sd.run(p).status().state is Status.paused]
    if rule.replay:
        decision = _replayed(rule, gen)
    else:
        now = {p: current(sd.run(p), list(rule.explore)) for p in values}
        decision = pbt.decide(rule, gen, values, now, alive=alive)
    step = rule.pause_rungs[gen]
    digests: Dict[int, Dict[str, Any]] = {}
    for c in decision.changes:
        member, donor = sd.run(c.member), sd.run(c.donor)
        if c.member not in alive:
            continue
        got = exploit(member, donor, step)
        digests[c.member] = got
        atomic.write_json(member.path / VALUES, {"values": {**values_now(member), **c.after}, "generation": gen})
        _append(member.path / LINEAGE, {"generation": gen, "step": step, "donor": c.donor, **got,
                                        "before": c.before, "after": c.after, "factors": c.factors,
                                        **({"replayed_from": str(rule.replay)} if rule.replay else {})})
    # the copies and values above are what the members train on; this row is the record of the decision:
    # one that cannot be written never keeps the members from going on (paused.recorded)
    recorded(f"pbt generation {gen}'s decision", sd.add_rung_rows,
             [{"kind": "generation", **decision.to_json(), "step": step,
               "values": {str(p): v for p, v in values.items()}, "copied": {str(p): d for p, d in digests.items()},
               **({"replayed_from": str(rule.replay)} if rule.replay else {})}])
    return decision


def _resume_paused(sd: SweepDir, gen: int, step: int) -> None:
    for rd in sd.runs():
        if rd.status().state is not Status.paused:
            continue
        release(rd, rd.status().job_id, f"member {rd.path.name}", "release",
                {"reason": "promoted", "detail": f"pbt generation {gen} (step {step})", "rank": None, "step": step},
                f"pbt generation {gen} decided but not resumed")


def _pause(rd: RunDir, gen: int, step: int, job_id: Optional[str]) -> None:
    pause_point(rd, f"paused at pbt generation {gen} (step {step})", step, job_id)


def report(rd: RunDir, rule: pbt.Rule, step: int, value: Optional[float], *, attempt: int, seconds: float,
           from_step: int, world: int, job_id: Optional[str], startup_s: float = 0.0) -> str:
    """Rank 0 of a member at a boundary (or at train.steps: "end"): its report recorded; "promoted" (go on
    in place) or "wait" (paused: the job ends; the generation's decision resumes it)."""
    sd, me = SweepDir(rd.path.parent), point_of(rd)
    gen = rule.rungs.index(step)
    with sd.rungs_lock():
        sd.add_report(me, gen, step, value, attempt=attempt, seconds=seconds, startup_s=startup_s,
                      from_step=from_step, world=world)
        if step not in rule.pause_rungs:
            return "end"
        values = _complete(sd, rule, gen)
        if values is None:
            _pause(rd, gen, step, job_id)
            return "wait"
        decision = _decide(sd, rule, gen, values, me)
        changed = decision.change_of(me) is not None
        if changed:  # this process holds the state it no longer trains on: it starts again from the copy
            _pause(rd, gen, step, job_id)
        _resume_paused(sd, gen, step)
        return "wait" if changed else "promoted"


def on_end(rd: RunDir, rule: pbt.Rule) -> None:
    """A member's job ended: if its run is final, the generation it leaves is decided without it."""
    if not rd.status().is_final:
        return
    sd = SweepDir(rd.path.parent)
    with sd.rungs_lock():
        rows = sd.rung_rows()
        decided = pbt.generations(rows)
        reported = {int(r["rung"]) for r in rows if r.get("kind") == "report"}
        for gen, step in enumerate(rule.pause_rungs):
            if gen in decided or gen not in reported:
                continue
            values = _complete(sd, rule, gen)
            if values is not None:
                _decide(sd, rule, gen, values, None)
                _resume_paused(sd, gen, step)
            break


def summary(sd: SweepDir, rule: pbt.Rule) -> Dict[str, Any]:
    """The generations, every member's lineage and final value, the compute (as
    launcher.features.asha.schedule.summary's)."""
    from launcher.features.asha import schedule as asha

    runs = sd.runs()
    rows = sd.rung_rows()
    out = asha.summary(rows, rule, [point_of(r) for r in runs])  # type: ignore[arg-type]
    gens = pbt.generations(rows)
    final = {int(r["point"]): r.get("value") for r in rows
             if r.get("kind") == "report" and r.get("step") == rule.steps}
    lineages = {point_of(r): lineage(r) for r in runs}
    recorded = [{k: v for k, v in r.items() if k not in ("time", "kind")} for r in rows
                if r.get("kind") == "generation"]
    out.update(scheduler="pbt", generations=recorded,
               lineages={str(p): v for p, v in lineages.items()},
               final={str(p): v for p, v in final.items()},
               lines=pbt.describe(gens, lineages, {p: (None if v is None else float(v)) for p, v in final.items()},
                                  rule.mode)
               + [f"compute: {out['spent_s']:.1f} process-s ({out['starts']} starts), {out['steps']} steps in "
                  f"{out['loop_s']:.1f} process-s of step loops"])
    return out

