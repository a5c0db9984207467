"""What a recipe gets besides its config (``fn(cfg, ctx)``): who it is in the job, the layout it runs
with, its run dir, and a metrics logger. This is the recipes' public API of the launcher."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Optional

from launcher.layout import Layout
from launcher.rundir import RunDir


@dataclass
class RunContext:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    hostname: str
    rundir: RunDir  # write files of the run dir through it (ctx.rundir.write_state(...), ...)
    layout: Layout  # the layout archived at launch (engine, dp/tp/pp, grad accumulation, placement)
    device: str  # "cpu" or "cuda:N"
    backend: str  # torch.distributed backend: "gloo" or "nccl"
    _metrics_file: Optional[Any] = field(default=None, repr=False)

    @property
    def run_dir(self) -> Path:
        return self.rundir.path

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def log_metrics(self, step: int, **metrics: Any) -> None:
        """Append one JSON line per step to the run's metrics file (rank 0 only; others no-op)."""
        if not self.is_main:
            return
        if self._metrics_file is None:
            self._metrics_file = open(self.rundir.metrics_path, "a", buffering=1)
        row: Dict[str, Any] = {"step": step, **metrics, "time": time.time()}
        self._metrics_file.write(json.dumps(row) + "\n")

    def close(self) -> None:
        if self._metrics_file is not None:
            self._metrics_file.close()
            self._metrics_file = None
