"""Where a training loop's metrics rows go: the run's metrics file through ``ctx.log_metrics``, and
wandb (``wandb.enabled``; offline by default, under ``ctx.rundir.wandb_dir``)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List, Optional

if TYPE_CHECKING:
    from launcher.config.schema import RunConfig


def _config(cfg: RunConfig, ctx: Any) -> Dict[str, Any]:
    """What wandb records as the run's config: the archived one (its secrets are references, never
    values); a loop run outside a launched run dir: the config with secret-named values redacted."""
    if (ctx.rundir.path / ctx.rundir.CONFIG).is_file():
        return ctx.rundir.config()
    from omegaconf import OmegaConf

    from launcher.archive.secrets import redact_config

    plain = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True) if OmegaConf.is_config(cfg) else dict(cfg)
    return redact_config(plain)


class MetricsSink:
    """Rows go to the run's metrics file (rank 0, through ctx.log_metrics) and, when enabled, to the
    run's one wandb run (launcher.training.wandb_stream: resumed on each attempt, never able to fail
    the training or replace its stop). ``history``: the rows of the steps resumed from a checkpoint."""

    def __init__(self, cfg: RunConfig, ctx: Any, history: Optional[List[Dict[str, Any]]] = None) -> None:
        self.ctx = ctx
        self.stream = None
        wb = cfg.get("wandb") if hasattr(cfg, "get") else None
        if ctx.is_main and wb is not None and bool(wb.enabled):
            from launcher.training.wandb_stream import WandbStream

            self.stream = WandbStream(wb, ctx.rundir, _config(cfg, ctx), list(history or []))

    @property
    def run(self) -> Any:
        """The wandb run this attempt logs to (None: wandb off, or lost for this attempt)."""
        return None if self.stream is None or self.stream.lost else self.stream.run

    def log(self, step: int, row: Dict[str, Any]) -> None:
        self.ctx.log_metrics(step, **row)
        if self.stream is not None:
            self.stream.log(step, row)

    def close(self) -> None:
        """Never raises: the wandb run's end is no outcome of the training (launcher.training.wandb_stream)."""
        stream, self.stream = self.stream, None
        if stream is not None:
            stream.close()
