"""A checkpoint's own manifest and the choice of the checkpoint a run resumes from (no torch: the
launcher's seal and the login path may read it too).

``checkpoints/step_<n>/checkpoint.json`` names every file of the checkpoint, whatever wrote it (the
Checkpointer's files, an engine's native ones, the done marks): its path relative to the
checkpoint, size and sha256, and the step. The rank that commits the checkpoint writes it after
every rank's done mark and before the rename (launcher.training.checkpoint); a rank's done mark
carries the digests of the files that rank wrote, so the committing rank hashes only the rest.

``resume_point`` verifies ``checkpoints/latest`` against its manifest: the name is a step dir that
exists, its manifest's step is the one in its name (and in meta.json), and every file is there with
its size and digest, none added. A latest that fails falls back to the newest earlier checkpoint
that passes (``adopt``: the rejected ones are moved to ``checkpoints/rejected/``, ``latest`` names
the one resumed from, a row in ``checkpoint_fallbacks.jsonl`` says why); with none,
``CheckpointCorrupt`` names the file and what is wrong, and no restart is spent on it
(launcher.runtime.restart_policy: kind ``corrupt_checkpoint``). In a job of several ranks the digests
are split (``shares``): rank 0 checks names, sizes and steps, every rank hashes its share of the
bytes, and the ranks agree on the result (launcher.training.checkpoint_resume).
"""
from __future__ import annotations

import hashlib
import heapq
import json
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Optional

from launcher.archive import atomic
from launcher.run.rundir import RunDir, file_sha256, now_iso

MANIFEST = "checkpoint.json"
_STEP_DIR = re.compile(r"step_\d{8}")


class CheckpointCorrupt(RuntimeError):
    """No checkpoint to resume from passes verification: ``problems`` per checkpoint name (the file
    and what is wrong with it). A restart would read the same bytes: the run ends at once."""

    def __init__(self, problems: Mapping[str, List[str]]) -> None:
        self.problems = {k: list(v) for k, v in problems.items()}
        lines = "; ".join(p for ps in self.problems.values() for p in ps)
        super().__init__(f"no intact checkpoint to resume from: {lines}")

    def __reduce__(self):  # pickled back as it was: a rank raises it, a job's result carries it
        return (CheckpointCorrupt, (self.problems,))


@dataclass(frozen=True)
class ResumePoint:
    """The checkpoint to resume from (None: a fresh start) and the ones rejected on the way there."""

    path: Optional[Path]
    rejected: Dict[str, List[str]] = field(default_factory=dict)  # checkpoint name -> its problems

    @property
    def fell_back(self) -> bool:
        return bool(self.rejected)


def digest(path: Path) -> Dict[str, Any]:
    """``{"size", "sha256"}`` of one file."""
    return {"size": path.stat().st_size, "sha256": file_sha256(path)}


def _files(ckpt: Path) -> List[str]:
    return sorted(str(p.relative_to(ckpt)) for p in ckpt.rglob("*") if p.is_file() and p.name != MANIFEST)


def mark_done(marker: Path, written: Mapping[str, Mapping[str, Any]]) -> None:
    """A rank's done mark, with the digests of the files it wrote (the committing rank reuses them)."""
    atomic.write_json(marker, {"files": dict(written)})  # its temporary name does not match done_rank_*


def write(ckpt: Path, step: int, marks: List[Path]) -> Dict[str, Any]:
    """checkpoint.json for every file in ``ckpt`` (``marks``: the ranks' done marks, whose digests
    are used where the size still matches; every other file is hashed here)."""
    known: Dict[str, Mapping[str, Any]] = {}
    for m in marks:
        try:
            raw = m.read_bytes()
        except OSError:
            raw = b""
        known.update(_json_object(m, raw).get("files") or {})
        # the mark itself: hashed from the bytes read for its digests, not read again (N ranks, N marks)
        known[m.name] = {"size": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}
    files = {}
    for rel in _files(ckpt):
        d = known.get(rel)
        files[rel] = dict(d) if d and d.get("size") == (ckpt / rel).stat().st_size else digest(ckpt / rel)
    manifest = {"step": int(step), "written": now_iso(), "files": files}
    atomic.write_json(ckpt / MANIFEST, manifest)
    return manifest


def _json_object(path: Path, raw: Optional[bytes] = None) -> Dict[str, Any]:
    """A done mark's record, or a manifest's ({} for an empty file or one that is not a JSON object);
    ``raw``: its bytes, already read."""
    try:
        obj = json.loads((path.read_bytes() if raw is None else raw) or b"null")
    except (OSError, ValueError):
        return {}
    return obj if isinstance(obj, dict) else {}


def problems(ckpt: Path, contents: bool = True) -> List[str]:
    """What is wrong with the checkpoint dir ``ckpt`` (empty: intact), each naming the file.
    ``contents=False``: names, sizes and steps only, no file hashed (what the login node checks)."""
    where = f"{ckpt.parent.name}/{ckpt.name}"
    try:
        manifest = json.loads((ckpt / MANIFEST).read_text())
        listed = manifest["files"]
        step = int(manifest["step"])
        assert isinstance(listed, dict)
    except FileNotFoundError:
        return [f"{where}/{MANIFEST} missing (a checkpoint not committed by a Checkpointer, or planted)"]
    except (OSError, ValueError, KeyError, TypeError, AssertionError) as e:
        return [f"{where}/{MANIFEST} unreadable ({type(e).__name__})"]
    out = []
    named = RunDir.checkpoint_step(ckpt) if _STEP_DIR.fullmatch(ckpt.name) else None
    if named != step:
        out.append(f"{where} holds step {step} ({MANIFEST}), not the step its name says ({named})")
    present = set(_files(ckpt))
    sized = []
    for rel, want in sorted(listed.items()):
        want = want if isinstance(want, dict) else {}
        p = ckpt / rel
        if rel not in present:
            out.append(f"{where}/{rel} missing")
            continue
        size = p.stat().st_size
        if size != want.get("size"):
            out.append(f"{where}/{rel} is {size} bytes, {MANIFEST} says {want.get('size')}"
                       + (" (truncated)" if isinstance(want.get("size"), int) and size < want["size"] else ""))
        else:
            sized.append(rel)
    if contents:
        out += content_problems(ckpt, listed, sized)
    out += [f"{where}/{rel} added (not in {MANIFEST})" for rel in sorted(present - set(listed))]
    if not out and "meta.json" in listed:  # the Checkpointer's record of the step (training.checkpoint)
        try:
            meta_step = json.loads((ckpt / "meta.json").read_text()).get("step")
        except (OSError, ValueError, AttributeError):
            meta_step = "?"
        if meta_step != step:
            out.append(f"{where}/meta.json says step {meta_step}, {MANIFEST} step {step}")
    return out


def content_problems(ckpt: Path, listed: Mapping[str, Any], names: Iterable[str]) -> List[str]:
    """The files ``names`` of ``ckpt`` whose sha256 differs from the manifest's ``listed`` (their sizes
    already found equal)."""
    where = f"{ckpt.parent.name}/{ckpt.name}"
    out = []
    for rel in names:
        want = listed.get(rel)
        if digest(ckpt / rel)["sha256"] != (want.get("sha256") if isinstance(want, dict) else None):
            out.append(f"{where}/{rel} changed (sha256 differs from {MANIFEST})")
    return out


def shares(listed: Mapping[str, Any], world: int) -> List[List[str]]:
    """The files each of ``world`` ranks hashes to verify a checkpoint at resume: the largest first, each
    to the rank with the fewest bytes so far, so none hashes more than the total / world plus the
    largest file (rank 0 hashed all of it: the checkpoint of a 30B model is ~0.5 TB). Pure: every
    rank computes the same split from the same manifest."""
    load = [(0, r) for r in range(max(1, int(world)))]
    out: List[List[str]] = [[] for _ in load]
    sized = sorted(((int(d.get("size") or 0) if isinstance(d, dict) else 0, rel) for rel, d in listed.items()),
                   key=lambda t: (-t[0], t[1]))
    for size, rel in sized:
        total, r = heapq.heappop(load)
        out[r].append(rel)
        heapq.heappush(load, (total + size, r))
    return out


def listed_files(ckpt: Path) -> Dict[str, Any]:
    """The manifest's files of a checkpoint (``{}`` where it cannot be read: ``problems`` says why)."""
    files = _json_object(ckpt / MANIFEST).get("files")
    return files if isinstance(files, dict) else {}


def resume_point(rd: RunDir, contents: bool = True,
                 known_bad: Optional[Mapping[str, List[str]]] = None) -> ResumePoint:
    """The checkpoint to resume from: ``latest`` if it passes verification, else the newest earlier
    one that does (the rejected ones named); no ``latest`` file: a fresh start. Raises
    CheckpointCorrupt when ``latest`` fails and no earlier checkpoint passes. ``contents``: as for
    ``problems`` (False: `launcher resume`'s check before it submits, and the job's rank 0 before the
    ranks hash a share each). ``known_bad``: checkpoints the ranks' hashes already rejected (name ->
    problems), passed over as rejected."""
    known_bad = dict(known_bad or {})
    pointer = rd.path / RunDir.LATEST
    if not pointer.is_file():
        return ResumePoint(None)
    name = pointer.read_text().strip()
    rejected: Dict[str, List[str]] = {}
    bound: Optional[int] = None  # only checkpoints before the step latest names are candidates
    named = pointer.parent / name
    if not _STEP_DIR.fullmatch(name):
        rejected["latest"] = [f"{RunDir.LATEST} names {name!r}, not a step_<n> checkpoint"]
    else:
        bound = RunDir.checkpoint_step(named)
        if not named.is_dir():
            rejected[name] = [f"{RunDir.LATEST} names {name}, which does not exist"]
        else:
            found = known_bad.get(name) or problems(named, contents)
            if not found:
                return ResumePoint(named)
            rejected[name] = found
    for ckpt in reversed(rd.checkpoints()):
        if ckpt == named or (bound is not None and RunDir.checkpoint_step(ckpt) >= bound):
            continue
        found = known_bad.get(ckpt.name) or problems(ckpt, contents)
        if not found:
            return ResumePoint(ckpt, rejected)
        rejected[ckpt.name] = found
    raise CheckpointCorrupt(rejected)


def adopt(rd: RunDir, point: ResumePoint, attempt: int) -> None:
    """After a fallback (rank 0, before any rank loads): the rejected checkpoints moved aside to
    ``checkpoints/rejected/`` (kept to inspect; out of the way of pruning and of the steps redone),
    ``latest`` names the checkpoint resumed from, and the fallback is recorded."""
    if not point.fell_back or point.path is None:
        return
    moved = {}
    for name in point.rejected:
        src = (rd.path / RunDir.LATEST).parent / name
        if _STEP_DIR.fullmatch(name) and src.is_dir():
            dst = rd.rejected_checkpoint(src, attempt)
            dst.parent.mkdir(exist_ok=True)
            if dst.exists():  # this attempt rejected the same step before (a second resume in it)
                shutil.rmtree(dst)
            os.replace(src, dst)
            moved[name] = str(dst.relative_to(rd.path))
    rd.set_latest(point.path)
    rd.record_fallback({"attempt": int(attempt), "resumed_from": point.path.name,
                        "from_step": RunDir.checkpoint_step(point.path), "rejected": point.rejected,
                        "moved": moved})
