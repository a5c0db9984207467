"""JobRecord: what job.json holds, typed. A backend makes one from the job it submitted
(Backend.job_record: it alone knows how its job ids read); RunDir writes and reads it."""
from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Dict, Optional, Tuple


@dataclass(frozen=True)
class JobRecord:
    backend: str
    job_id: str  # the scheduler's id of this run's job (`<array>_<task>` for a Slurm array task)
    array_job_id: Optional[str] = None  # the array's own id, for a task of an array
    array_task_id: Optional[int] = None
    submitit_folder: str = ""
    stdout: str = ""
    stderr: str = ""
    num_tasks: Optional[int] = None
    submitted: str = ""
    earlier_job_ids: Tuple[str, ...] = ()  # the jobs of the run's earlier attempts (resume, retry)
    # local: when the job's process started (clock ticks after boot, /proc/<pid>/stat): with the pid
    # (job_id) its identity, so that a pid reused by another process is never taken for the job
    process_start: Optional[int] = None
    # a packed point (cluster.pack): its place in its pack's queue; job_id is the pack's allocation
    pack_index: Optional[int] = None

    @property
    def submission_id(self) -> str:
        """The id of the submission the job went out in: the array's, else the job's own."""
        return self.array_job_id or self.job_id

    def after(self, earlier: Optional[JobRecord]) -> JobRecord:
        """This record as the next attempt of ``earlier``'s run (its job ids kept, oldest first)."""
        if earlier is None:
            return self
        return replace(self, earlier_job_ids=(*earlier.earlier_job_ids, earlier.job_id))

    def read_in(self, sweep_dir: Path) -> JobRecord:
        """The record as the archive at ``sweep_dir`` reads it: where that is a copy of the sweep the job
        ran in (its own submitit folder beside its runs), the logs are the copy's, not the original's."""
        folder = Path(self.submitit_folder)
        own = Path(sweep_dir) / folder.name
        if not self.submitit_folder or not own.is_dir() or _same(folder.parent, Path(sweep_dir)):
            return self

        def moved(p: str) -> str:
            return str(own / Path(p).name) if p and Path(p).parent == folder else p

        return replace(self, submitit_folder=str(own), stdout=moved(self.stdout), stderr=moved(self.stderr))

    def to_json(self) -> Dict[str, Any]:
        # (plain values: read, not deep-copied as asdict does; every run of a launch writes one)
        out = {name: getattr(self, name) for name in _FIELDS}
        out["earlier_job_ids"] = list(self.earlier_job_ids)
        if not out["earlier_job_ids"]:
            del out["earlier_job_ids"]
        for key in ("process_start", "pack_index"):
            if out[key] is None:
                del out[key]
        return out

    @classmethod
    def from_json(cls, data: Dict[str, Any]) -> JobRecord:
        task = data.get("array_task_id")
        tasks = data.get("num_tasks")
        return cls(backend=str(data.get("backend") or ""), job_id=str(data.get("job_id") or ""),
                   array_job_id=None if data.get("array_job_id") is None else str(data["array_job_id"]),
                   array_task_id=None if task is None else int(task),
                   submitit_folder=str(data.get("submitit_folder") or ""), stdout=str(data.get("stdout") or ""),
                   stderr=str(data.get("stderr") or ""), num_tasks=None if tasks is None else int(tasks),
                   submitted=str(data.get("submitted") or ""),
                   earlier_job_ids=tuple(str(j) for j in data.get("earlier_job_ids") or () if j is not None),
                   process_start=_ticks(data.get("process_start")), pack_index=_ticks(data.get("pack_index")))


_FIELDS = tuple(f.name for f in fields(JobRecord))


def _ticks(value: Any) -> Optional[int]:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _same(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return a == b
