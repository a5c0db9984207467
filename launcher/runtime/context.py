"""What a recipe gets besides its config: who it is in the job, where to write, how to log."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Optional


@dataclass
class RunContext:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    hostname: str
    run_dir: Path
    device: str  # "cpu" or "cuda:N"
    backend: str  # torch.distributed backend: "gloo" or "nccl"
    _metrics_file: Optional[Any] = field(default=None, repr=False)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def metrics_path(self) -> Path:
        return self.run_dir / "metrics.jsonl"

    def log_metrics(self, step: int, **metrics: Any) -> None:
        """Append one JSON line per step to metrics.jsonl (rank 0 only; others no-op)."""
        if not self.is_main:
            return
        if self._metrics_file is None:
            self._metrics_file = open(self.metrics_path, "a", buffering=1)
        row: Dict[str, Any] = {"step": step, **metrics, "time": time.time()}
        self._metrics_file.write(json.dumps(row) + "\n")

    def close(self) -> None:
        if self._metrics_file is not None:
            self._metrics_file.close()
            self._metrics_file = None
