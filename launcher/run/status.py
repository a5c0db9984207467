"""A run's status: the states it moves through and the record status.json holds (``RunStatus``).

A leaf module (imports nothing of the launcher): the backends map their schedulers' states onto
``Status``, RunDir reads and writes ``RunStatus``, and every reader uses its attributes.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Dict, List, Mapping, Optional


class Status(str, Enum):
    pending = "pending"
    running = "running"
    completed = "completed"
    failed = "failed"
    cancelled = "cancelled"
    timeout = "timeout"
    requeued = "requeued"
    paused = "paused"  # sweep=asha: stopped at a rung, checkpointed, its job ended; waits for the rung's decision
    pruned = "pruned"  # sweep=asha: not promoted at a rung (final: never retried)
    waiting = "waiting"  # a point past the scheduler's room: its sweep's wave job queues it (launcher.submit.waves)


STATUSES = tuple(s.value for s in Status)
FINAL = (Status.completed.value, Status.failed.value, Status.cancelled.value, Status.timeout.value,
         Status.pruned.value)


@dataclass(frozen=True)
class RunStatus:
    """status.json. ``state`` is written as ``status``; a run without the file is pending."""

    state: Status = Status.pending
    updated: Optional[str] = None  # ISO times of the last write, the first start and the outcome
    started: Optional[str] = None
    ended: Optional[str] = None
    exit_code: Optional[int] = None
    error: Optional[str] = None  # why the run did not complete (scrubbed of secrets)
    failed_rank: Optional[int] = None  # the rank that recorded the failure first
    summary: Optional[Dict[str, Any]] = None  # what the recipe returned (a Hydra app: return_value)
    duration_s: Optional[float] = None
    attempt: Optional[int] = None  # 1 = the first start
    restarts: Optional[int] = None
    stop: Optional[Dict[str, Any]] = None  # why the attempt stopped to be restarted (reason, detail, rank, step)
    resumed: Optional[bool] = None  # launcher resume/retry recorded the restart itself
    no_restart: Optional[Dict[str, Any]] = None  # a failure no restart fixes (restart_policy.Decision: why, fix)
    hosts: Optional[List[str]] = None
    world_size: Optional[int] = None
    job_id: Optional[str] = None
    array_job_id: Optional[str] = None
    array_task_id: Optional[str] = None
    output_dir: Optional[str] = None  # a Hydra app's output dir and the working dir it ran in
    working_dir: Optional[str] = None
    earlier: List[Dict[str, Any]] = field(default_factory=list)  # the outcomes of attempts before a resume
    extra: Mapping[str, Any] = field(default_factory=dict)  # keys this version does not know, kept as read

    @property
    def is_final(self) -> bool:
        return self.state.value in FINAL

    @classmethod
    def of(cls, value: RunStatus | Mapping[str, Any] | None) -> RunStatus:
        """A RunStatus as it is, or one read from status.json's mapping (tests and rules build them by hand)."""
        return value if isinstance(value, cls) else cls.from_json(value)

    @classmethod
    def from_json(cls, data: Optional[Mapping[str, Any]]) -> RunStatus:
        data = dict(data or {})
        state = Status(data.pop("status", None) or Status.pending.value)
        known = {f.name for f in dataclasses.fields(cls)} - {"state", "extra"}
        fields = {k: data.pop(k) for k in list(data) if k in known}
        if fields.get("earlier") is None:
            fields.pop("earlier", None)
        return cls(state=state, **fields, extra=data)

    def to_json(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {"status": self.state.value}
        for f in dataclasses.fields(self):
            if f.name not in ("state", "extra"):
                out[f.name] = getattr(self, f.name)
        return {**self.extra, **out}
