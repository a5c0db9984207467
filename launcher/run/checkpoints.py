"""RunDir's checkpoints: listing, latest, partials, rejected, fallbacks; and which seal problems are a
checkpoint's (verify reads them apart: a resume falls back past a bad checkpoint)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from launcher.archive import atomic
from launcher.run.io import (
    fill_name,
    now_iso,
)


class Checkpoints:
    """A run's checkpoints (a mixin of RunDir)."""

    # ---- checkpoints -----------------------------------------------------------------------------
    @property
    def script_checkpoint_dir(self) -> Path:
        """recipe=script: the dir the script owns (LAUNCHER_CHECKPOINT_DIR)."""
        return self._p(self.SCRIPT_CHECKPOINTS)

    def checkpoint_dir(self, step: int) -> Path:
        return self._p(fill_name(self.CHECKPOINT, n=f"{int(step):08d}"))

    def checkpoint_partial(self, step: int) -> Path:
        """Where a checkpoint is written until every rank has its part in (then one rename)."""
        return self._p(fill_name(self.CHECKPOINT_PARTIAL, n=f"{int(step):08d}"))

    def reshard_source(self, step: int) -> Path:
        """Where a reshard writes the universal form of the checkpoint of ``step`` that names it in its
        own files (deleted once loaded and checked; the checkpoint stays as its manifest lists it)."""
        return self._p(fill_name(self.RESHARD_SOURCE, n=f"{int(step):08d}"))

    def checkpoints(self) -> List[Path]:
        """Complete checkpoints, oldest first."""
        return self._glob(self.CHECKPOINT, n="*")

    def latest_checkpoint(self) -> Optional[Path]:
        """The checkpoint ``latest`` names (None: none yet, or it names one that is gone)."""
        p = self._p(self.LATEST)
        name = p.read_text().strip() if p.is_file() else ""
        ckpt = p.parent / name if name else None
        return ckpt if ckpt is not None and ckpt.is_dir() else None

    def set_latest(self, ckpt: Path) -> None:
        atomic.write_text(self._p(self.LATEST), Path(ckpt).name + "\n")

    def stale_partials(self) -> List[Path]:
        return self._glob(self.CHECKPOINT_PARTIAL, n="*")

    @staticmethod
    def checkpoint_step(ckpt: Path) -> int:
        return int(Path(ckpt).name.rsplit("_", 1)[-1])

    def rejected_checkpoint(self, ckpt: Path, attempt: int) -> Path:
        """Where a checkpoint that failed verification when ``attempt`` resumed is moved aside."""
        return self._p(fill_name(self.CHECKPOINT_REJECTED, n=f"{self.checkpoint_step(ckpt):08d}", a=int(attempt)))

    def record_fallback(self, row: Dict[str, Any]) -> None:
        """A resume that fell back past checkpoints that failed verification (not a restart)."""
        with open(self._p(self.FALLBACKS), "a") as f:
            f.write(json.dumps({"time": now_iso(), **row}) + "\n")

    def fallbacks(self) -> List[Dict[str, Any]]:
        p = self._p(self.FALLBACKS)
        return [json.loads(line) for line in p.read_text().splitlines() if line.strip()] if p.exists() else []



def is_checkpoint_problem(problem: str) -> bool:
    """Whether a problem ``RunDir.verify`` names is about checkpoints/ alone (a checkpoint added,
    missing or changed, ``latest`` re-pointed): what a checkpoint's own checkpoint.json decides at
    resume (launcher.run.checkpoint_manifest: fall back to an intact one, or refuse naming the file)."""
    first = problem.split(" ", 1)[0]  # the path (or "checkpoint <name>") a problem starts with
    return first in ("checkpoint", "checkpoints") or first.startswith("checkpoints/")


def checkpoint_problems(manifest: Dict[str, Any], names: List[str],
                         latest: Optional[str]) -> Tuple[List[str], List[str]]:
    """(problems, the checkpoint dirs they cover whole): checkpoints added or missing versus the
    manifest's names, ``latest`` re-pointed."""
    sealed = list(manifest.get("checkpoints") or [])
    problems = [f"checkpoint {n} missing" for n in sealed if n not in names]
    problems += [f"checkpoint {n} added after the seal" for n in names if n not in sealed]
    if "latest" in manifest and manifest["latest"] != latest:
        problems.append(f"checkpoints/latest re-pointed: {manifest['latest']} when sealed, {latest} now")
    return problems, [f"checkpoints/{n}" for n in {*sealed, *names} if (n in sealed) != (n in names)]


class CheckpointDigests:
    """The sha256 each checkpoint's checkpoint.json records per file, read once per checkpoint."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.by_ckpt: Dict[str, Dict[str, Any]] = {}

    def get(self, rel: str, size: int) -> Optional[str]:
        """The recorded sha256 of ``<checkpoint>/<file>`` (relative to checkpoints/) if its recorded
        size is ``size``; None where nothing (or something else) is recorded."""
        ckpt, _, file = rel.partition("/")
        if not file:
            return None
        if ckpt not in self.by_ckpt:
            found = atomic.read_json(self.root / ckpt / "checkpoint.json")
            files = found.get("files") if isinstance(found, dict) else None
            self.by_ckpt[ckpt] = files if isinstance(files, dict) else {}
        d = self.by_ckpt[ckpt].get(file)
        ok = isinstance(d, dict) and d.get("size") == size and isinstance(d.get("sha256"), str)
        return d["sha256"] if ok else None
