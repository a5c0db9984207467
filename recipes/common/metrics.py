"""Training metrics: the FLOPs account behind MFU, peak memory, and where rows go
(metrics.jsonl through the run context, and wandb, offline by default)."""
from __future__ import annotations

import os
from typing import Any, Dict, Optional

import torch


def flops_per_token(model: Any) -> float:
    """Training FLOPs per token, forward + backward, without recomputation:
    6 * N (every parameter: one multiply-add forward, two backward) plus the attention scores and
    weighted sum, 12 * layers * hidden * seq_len (causal masking not discounted), the
    PaLM / Megatron convention. N counts the weights used in matmuls: per layer 12 h^2 (+ biases
    ignored) and the output head V * h; position/token lookups are not matmuls."""
    l, h, s = int(model.num_layers), int(model.hidden_size), int(model.seq_len)
    f, v = int(model.ffn_hidden_size), int(model.vocab_size)
    n_matmul = l * (4 * h * h + 2 * h * f) + v * h
    return 6.0 * n_matmul + 12.0 * l * h * s


def peak_memory_bytes(device: torch.device) -> Optional[int]:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return None


class MetricsSink:
    """Rows go to metrics.jsonl (rank 0, through ctx.log_metrics) and, when enabled, to wandb."""

    def __init__(self, cfg: Any, ctx: Any) -> None:
        self.ctx = ctx
        self.run = None
        wb = cfg.get("wandb") if hasattr(cfg, "get") else None
        if ctx.is_main and wb is not None and bool(wb.enabled):
            os.environ.setdefault("WANDB_MODE", str(wb.mode))
            os.environ.setdefault("WANDB_SILENT", "true")
            import wandb

            from omegaconf import OmegaConf

            self.run = wandb.init(
                project=str(wb.project), dir=str(ctx.run_dir), mode=str(wb.mode),
                name=ctx.run_dir.parent.name + "-" + ctx.run_dir.name,
                config=OmegaConf.to_container(cfg, resolve=True, enum_to_str=True),
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
