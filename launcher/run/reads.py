"""RunDir's readers: every record, each read size-capped and as its type (None where absent)."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Dict, List, Optional

from launcher.archive import atomic
from launcher.run.checks_record import ChecksRecord
from launcher.run.io import (
    SweepNames,
    Unreadable,
    fill_name,
    read_object_lines,
    read_points,
    read_record,
    read_tail,
    read_yaml_mapping,
)
from launcher.run.job_record import JobRecord
from launcher.run.status import RunStatus

ERROR_TAIL = 256 * 1024  # bytes of a rank's recorded error read (its end)

class Reads:
    """Readers of a run dir's records (a mixin of RunDir)."""

    # ---- reading ---------------------------------------------------------------------------------
    def exists(self) -> bool:
        return self._p(self.RUN).is_file()

    def run(self) -> Optional[Dict[str, Any]]:
        """run.json (None: not written yet); Unreadable when it holds anything but a JSON object."""
        return read_record(self._p(self.RUN))

    def config(self) -> Dict[str, Any]:
        """config.yaml (FileNotFoundError: none); Unreadable when it is not a YAML mapping of plain
        values (a python/object tag, binary junk, aliases expanding beyond yamlio's bound)."""
        return read_yaml_mapping(self._p(self.CONFIG))

    def overrides(self) -> Dict[str, Any]:
        p = self._p(self.OVERRIDES)
        if p.exists():
            return read_yaml_mapping(p) or {}
        return (self._point_record() or {}).get("overrides") or {}

    def layout(self):
        """The Layout archived at launch: what the job runs with (never recomputed on the node)."""
        from launcher.config.layout import (
            Layout,  # omegaconf (through launcher.config.schema): most readers of a run dir need no layout
        )

        return Layout.from_json((self.run() or {})["layout"])

    def status(self) -> RunStatus:
        """status.json (a run whose job has not written one yet is pending); Unreadable when it is
        not a status record."""
        found = read_record(self._p(self.STATUS))
        try:
            return RunStatus.from_json(found or {})
        except (TypeError, ValueError) as e:  # an unknown status, a field of another shape
            raise Unreadable(f"{self.STATUS} is not a status record ({e})", self._p(self.STATUS)) from None

    def backend_name(self) -> str:
        """The backend its job was submitted to: job.json's, else run.json's (a Hydra app's run has no
        cluster group), else its config's cluster.backend; "local" when none says."""
        job = self.job()
        if job is not None and job.backend:
            return str(job.backend)
        meta = self.run() or {}
        if meta.get("backend"):
            return str(meta["backend"])
        try:
            return str((self.config().get("cluster") or {}).get("backend") or "local")
        except (OSError, ValueError):
            return "local"

    def job(self) -> Optional[JobRecord]:
        """job.json (None: the run was never submitted, or it is no job record)."""
        found = atomic.read_json(self._p(self.JOB))
        if not isinstance(found, dict) or not found:
            return None
        try:
            return JobRecord.from_json(found)
        except (TypeError, ValueError):  # a field of another shape: no job this launcher can ask about
            return None

    def seeds(self) -> Optional[Dict[str, Any]]:
        found = atomic.read_json(self._p(self.SEEDS))
        return found if found is not None else (self._point_record() or {}).get("seeds")

    def plan(self) -> Optional[Dict[str, Any]]:
        return atomic.read_json(self._p(self.PLAN))

    def checks(self) -> Optional[ChecksRecord]:
        """What was checked before the run was queued (None: staged before checks.json existed)."""
        return ChecksRecord.from_json(atomic.read_json(self._p(self.CHECKS)))

    def data_manifest(self) -> Optional[Dict[str, Any]]:
        """The datasets the run was launched with (launcher.data.archived), or None (it reads none)."""
        found = atomic.read_json(self._p(self.DATA_MANIFEST))
        return found if isinstance(found, dict) else None

    def git(self) -> Dict[str, Any]:
        return atomic.read_json(self._shared_p(self.GIT), {}) or {}

    def has_patch(self) -> bool:
        return self._shared_p(self.PATCH).exists()

    def patch(self) -> str:
        return self._shared_p(self.PATCH).read_text() if self.has_patch() else ""

    def snapshot(self) -> Dict[str, Any]:
        return atomic.read_json(self._shared_p(self.SNAPSHOT), {}) or {}

    def software(self) -> Optional[Dict[str, Any]]:
        return atomic.read_json(self._shared_p(self.SOFTWARE))

    # A sweep writes the files every run holds alike (SHARED_FILES: code and software records) once,
    # into <sweep>/shared/; a run links them in when it starts (adopt_shared) and at the latest when
    # it is sealed. Until then they are read from there.
    def _shared_p(self, name: str) -> Path:
        own = self._p(name)
        if own.exists():
            return own
        shared = self.path.parent / SweepNames.SHARED / name
        return shared if shared.exists() else own

    def adopt_shared(self) -> None:
        """Link the sweep's shared files this run lacks into it, and write its own seeds.json and
        overrides.yaml from the sweep's per-point record (idempotent; safe from many tasks at once:
        each write replaces the file whole, with the same content)."""
        shared = type(self)(self.path.parent / SweepNames.SHARED)
        missing = tuple(n for n in self.SHARED_FILES if not self._p(n).exists() and shared._p(n).exists())
        self.link_from(shared, missing)  # ranks racing to it: each link made once (link_from)
        point = self._point_record()
        if point is not None:
            if not self._p(self.SEEDS).exists() and point.get("seeds") is not None:
                self.write_seeds(point["seeds"])
            if not self._p(self.OVERRIDES).exists() and point.get("overrides") is not None:
                ov = point["overrides"]
                self.write_overrides(ov.get("overrides") or [], ov.get("choices") or {})

    def _point_record(self) -> Optional[Dict[str, Any]]:
        """This run's entry in its sweep's per-point record (<sweep>/shared/points.json: seeds and
        overrides of every point, written in one file at launch), or None."""
        if not self.path.name.isdigit():
            return None
        found = read_points(self.path.parent / SweepNames.SHARED / SweepNames.POINTS).get(self.path.name)
        return None if found is None else json.loads(json.dumps(found))  # the caller's own copy

    def runtime(self) -> Optional[Dict[str, Any]]:
        return atomic.read_json(self._p(self.RUNTIME))

    def script(self) -> Optional[str]:
        p = self._p(self.SCRIPT)
        return p.read_text() if p.exists() else None

    def rank(self, rank: int) -> Dict[str, Any]:
        """ranks/rank_<r>.json of one rank ({} before it started)."""
        return atomic.read_json(self._p(fill_name(self.RANK, r=rank)), {}) or {}

    def rank_attempts(self) -> Dict[str, Any]:
        return atomic.read_json(self._p(self.RANK_ATTEMPTS), {}) or {}

    def rank_file_mtimes(self) -> Dict[int, float]:
        """The modification time of each rank's ranks/rank_<r>.json, by rank (cheap: no file read)."""
        out = {}
        for p in self._glob(self.RANK, r="*"):
            rank = p.stem.rsplit("_", 1)[-1]
            try:
                if rank.isdigit():
                    out[int(rank)] = p.stat().st_mtime
            except FileNotFoundError:
                pass
        return out

    def ranks(self) -> List[Dict[str, Any]]:
        rows = [atomic.read_json(p, {}) for p in self._glob(self.RANK, r="*")]
        return sorted(rows, key=lambda r: r.get("rank", 0))

    def states(self) -> Dict[int, Dict[str, Any]]:
        """ranks/state_<r>.json of every rank that wrote one, by rank."""
        out = {}
        for p in self._glob(self.STATE, r="*"):
            rank, data = p.stem.rsplit("_", 1)[-1], atomic.read_json(p)
            if rank.isdigit() and isinstance(data, dict):
                out[int(rank)] = data
        return out

    def topology(self) -> List[Dict[str, Any]]:
        return [atomic.read_json(p, {}) for p in self._glob(self.TOPOLOGY, name="*", n="*")]

    def failed_ranks(self, except_rank: Optional[int] = None, since: Optional[float] = None) -> List[str]:
        """Names of the ranks that recorded an error (``rank_3``), other than ``except_rank``; with
        ``since``, only errors recorded at or after that time (not an earlier attempt's). Asked for
        all of them (no ``since``), an older launcher's errors (in ranks/) count too."""
        out = [n for n in self._alarms(except_rank, since) if n != self._cancel_name()]
        if since is None:
            old = {p.name.split(".")[0] for p in self._glob(self.OLD_RANK_ERROR, r="*")}
            out = sorted(set(out) | old - {f"rank_{except_rank}"}, key=lambda n: int(n.rsplit("_", 1)[-1]))
        return out

    def alarm(self, except_rank: Optional[int] = None, since: Optional[float] = None) -> Optional[str]:
        """What ends a rank's peer watch, from one listing of errors/ (which holds only the ranks that
        failed: its cost does not grow with the job): ``rank_3`` (another rank failed), ``cancelled``
        (the run was recorded cancelled), or None. ``since`` as for failed_ranks."""
        found = self._alarms(except_rank, since)
        ranks = [n for n in found if n != self._cancel_name()]
        return ranks[0] if ranks else found[0] if found else None

    def _cancel_name(self) -> str:
        return self.CANCELLED_MARK.rsplit("/", 1)[-1]

    def _alarms(self, except_rank: Optional[int], since: Optional[float]) -> List[str]:
        """errors/ listed once: each rank error's name (``rank_3``) and the cancel mark's, by rank."""
        own = fill_name(self.RANK_ERROR, r=except_rank).rsplit("/", 1)[-1] if except_rank is not None else None
        out = []
        try:
            with os.scandir(self._p(self.RANK_ERROR).parent) as it:
                entries = [e for e in it if e.name.endswith(".error") or e.name == self._cancel_name()]
        except (FileNotFoundError, NotADirectoryError):  # no rank has failed
            return []
        for p in entries:
            try:
                fresh = since is None or p.stat().st_mtime >= since
            except FileNotFoundError:  # moved aside by the next attempt
                continue
            if p.name != own and fresh:
                out.append(p.name.split(".")[0])
        return sorted(out, key=lambda n: (0, int(n[5:])) if n.startswith("rank_") and n[5:].isdigit() else (1, 0))

    def rank_error_path(self, rank: int) -> Path:
        """errors/rank_<r>.error (ranks/rank_<r>.error where an older launcher left it)."""
        p = self._p(fill_name(self.RANK_ERROR, r=rank))
        old = self._p(fill_name(self.OLD_RANK_ERROR, r=rank))
        return old if not p.exists() and old.exists() else p

    def attempts(self) -> List[Path]:
        """The dirs of earlier attempts (attempts/<a>/), in order."""
        return sorted(self._glob(self.ATTEMPT, a="*"), key=lambda p: int(p.name) if p.name.isdigit() else 0)

    def rank_errors(self) -> Dict[int, str]:
        """Each failed rank's recorded error text, by rank (an older launcher's in ranks/ too)."""
        out = {}
        for p in self._glob(self.OLD_RANK_ERROR, r="*") + self._glob(self.RANK_ERROR, r="*"):
            try:  # its end: a traceback ends with what was raised
                out[int(p.name.split(".")[0].split("_")[-1])] = read_tail(p, ERROR_TAIL).decode(errors="replace")
            except (OSError, Unreadable):
                continue
        return out

    def metrics(self) -> List[Dict[str, Any]]:
        if not self.metrics_path.exists():
            return []
        return read_object_lines(self.metrics_path)  # a line being written right now is skipped

    def _glob(self, pattern: str, **parts: Any) -> List[Path]:
        return sorted(self.path.glob(fill_name(pattern, **parts)))
