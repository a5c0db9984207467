"""Where a training loop's metrics rows go: the run's metrics file through ``ctx.log_metrics``, and
wandb (``wandb.enabled``; offline by default, under ``ctx.rundir.wandb_dir``)."""
from __future__ import annotations

import os
from typing import Any, Dict


class MetricsSink:
    """Rows go to the run's metrics file (rank 0, through ctx.log_metrics) and, when enabled, to wandb."""

    def __init__(self, cfg: Any, ctx: Any) -> None:
        self.ctx = ctx
        self.run = None
        wb = cfg.get("wandb") if hasattr(cfg, "get") else None
        if ctx.is_main and wb is not None and bool(wb.enabled):
            os.environ.setdefault("WANDB_MODE", str(wb.mode))
            os.environ.setdefault("WANDB_SILENT", "true")
            import wandb

            self.run = wandb.init(  # the archived config: its secrets are references, not values
                project=str(wb.project), dir=str(ctx.rundir.wandb_dir), mode=str(wb.mode),
                name=ctx.rundir.run_id, config=ctx.rundir.config(),
            )

    def log(self, step: int, row: Dict[str, Any]) -> None:
        self.ctx.log_metrics(step, **row)
        if self.run is not None:
            self.run.log(row, step=step)

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None
            import wandb

            wandb.teardown()  # stop wandb's service now, so it writes nothing after the run is sealed
