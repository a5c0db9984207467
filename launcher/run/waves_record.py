"""WavePlan: what a sweep's waves.json holds, typed. A sweep larger than the scheduler's room (the
controller's MaxJobCount, the user's MaxSubmitJobs) is queued in waves by its own jobs
(launcher.submit.waves): the points not queued yet, the job that queues the next wave, and each wave
queued so far. SweepDir.waves / write_waves read and write it."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Dict, List, Optional, Tuple


@dataclass(frozen=True)
class Wave:
    """One wave: its arrays' job ids and the runs (indices) they hold, and when it was queued."""

    job_ids: Tuple[str, ...]
    runs: Tuple[int, ...]
    queued: str
    by: str  # "launch", "wave job <id>", "repair"

    def to_json(self) -> Dict[str, Any]:
        return {"job_ids": list(self.job_ids), "runs": list(self.runs), "queued": self.queued, "by": self.by}


@dataclass(frozen=True)
class WavePlan:
    waiting: Tuple[int, ...] = ()  # the runs no wave has queued yet (status `waiting`), in sweep order
    job_id: Optional[str] = None  # the wave job that queues the next wave (None: none queued)
    backend: str = "slurm"
    waves: Tuple[Wave, ...] = field(default_factory=tuple)
    stopped: Optional[str] = None  # why no more waves are queued (cancelled, refused), when they stopped early
    launch: Optional[Tuple[str, int]] = None  # the host and pid of the launch that queues the first wave

    def queued(self, wave: Wave, left: List[int], job_id: Optional[str]) -> WavePlan:
        """The plan after ``wave`` was queued: ``left`` still waiting, ``job_id`` queues the next."""
        return replace(self, waiting=tuple(left), job_id=job_id, waves=(*self.waves, wave))

    def describe(self) -> str:
        """One line for `launcher status` / `launcher show`."""
        queued = sum(len(w.runs) for w in self.waves)
        line = f"waves: {len(self.waves)} queued ({queued} run(s)), {len(self.waiting)} run(s) waiting"
        if self.stopped:
            return line + f"; stopped: {self.stopped}"
        if self.waiting:
            return line + (f" for wave job {self.job_id}" if self.job_id else " (no wave job queued: launcher runs "
                                                                               "repairs it)")
        return line

    def to_json(self) -> Dict[str, Any]:
        return {"waiting": list(self.waiting), "job_id": self.job_id, "backend": self.backend,
                "waves": [w.to_json() for w in self.waves], "stopped": self.stopped,
                "launch": list(self.launch) if self.launch else None}

    @classmethod
    def from_json(cls, data: Optional[Dict[str, Any]]) -> Optional[WavePlan]:
        if not isinstance(data, dict) or not isinstance(data.get("waiting"), list):
            return None  # no waves, or a damaged file
        waves = tuple(Wave(tuple(str(j) for j in w.get("job_ids") or ()), tuple(int(i) for i in w.get("runs") or ()),
                           str(w.get("queued") or ""), str(w.get("by") or "")) for w in data.get("waves") or ()
                      if isinstance(w, dict))
        job, launch = data.get("job_id"), data.get("launch")
        return cls(waiting=tuple(int(i) for i in data["waiting"]), job_id=str(job) if job else None,
                   backend=str(data.get("backend") or "slurm"), waves=waves,
                   stopped=str(data["stopped"]) if data.get("stopped") else None,
                   launch=(str(launch[0]), int(launch[1])) if isinstance(launch, list) and len(launch) == 2 else None)
