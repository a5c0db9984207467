"""Plain data parallelism with torch DistributedDataParallel (tp = pp = 1, no ZeRO: the layouts the
launcher's rules give this engine)."""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from launcher.training import universal
from launcher.training.checkpoint import load_on_one_rank
from launcher.training.engines.engine import (
    Batch,
    Engine,
    StepStats,
    adamw,
    autocast_for,
    compress_ddp_grads,
    grad_scaler,
    optimizer_state_bytes,
    optimizer_step,
    tensor_bytes,
)
from recipes.common.memory import BuildMeter
from recipes.gpt.engines.base import build_model, evaluating, mean_over
from recipes.gpt.model import count_parameters


class DDPEngine(Engine):
    def __init__(self, cfg: Any, ctx: Any) -> None:
        layout = ctx.layout  # data parallel only (tp = pp = 1): the launcher's layout rules hold
        self.world = int(ctx.world_size)
        self.dp, self.dp_rank = int(layout.dp), layout.coords(int(ctx.rank))[0]
        self.device = torch.device(ctx.device)
        self.build_meter = BuildMeter(self.device).start()  # what the model's construction uses
        self.model = build_model(cfg, self.dp_rank).to(self.device)
        self.build_meter.stop()
        self.num_params = count_parameters(self.model)
        self.ddp: Optional[nn.parallel.DistributedDataParallel] = None
        if self.world > 1:
            ids = [self.device.index] if self.device.type == "cuda" else None
            # gradients are views into DDP's all-reduce buckets: no second copy of every gradient
            self.ddp = nn.parallel.DistributedDataParallel(self.model, device_ids=ids, gradient_as_bucket_view=True)
            compress_ddp_grads(self.ddp, cfg)  # precision.grad_reduce_dtype
        self.runner: nn.Module = self.ddp if self.ddp is not None else self.model
        self.model.train()
        self.optimizer = adamw(self.model, cfg.optim)
        self.params = [p for g in self.optimizer.param_groups for p in g["params"]]
        self.grad_clip = float(cfg.optim.grad_clip)
        self.autocast = autocast_for(cfg, self.device.type)
        self.scaler, self.static_scale = grad_scaler(cfg, self.device.type)
        self.min_scale = float(cfg.precision.min_loss_scale)
        self._last_grad_bytes = 0
        self.stats = StepStats(ctx, self.world)  # the loss all-reduce carries the stop votes

    def train_step(self, batches: List[Batch], lr: float) -> Tuple[float, float]:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        accum = len(batches)
        loss_sum = torch.zeros((), device=self.device, dtype=torch.float32)
        for k, (tokens, labels) in enumerate(batches):
            tokens = tokens.to(self.device, non_blocking=True)
            labels = labels.to(self.device, non_blocking=True)
            sync = self.ddp is None or k == accum - 1
            with contextlib.nullcontext() if sync else self.ddp.no_sync():
                with self._phase("forward"), self.autocast():
                    loss = self.runner(tokens, labels=labels) / accum
                with self._phase("backward"):  # (the last one holds DDP's overlapped gradient all-reduce)
                    (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
            loss_sum += loss.detach()
        with self._phase("optimizer"):
            grad_norm = self._optimizer_step()
        stats = self.stats.with_votes(loss_sum.reshape(1))
        if self.world > 1:
            with self._phase("loss_sync"):
                dist.all_reduce(stats, op=dist.ReduceOp.SUM)
            stats[:1] /= self.world
        norm_value, loss_value = self.stats.read(torch.cat([grad_norm.float().reshape(1), stats]))
        return loss_value, norm_value

    def eval_loss(self, batches: List[Batch]) -> float:
        loss_sum = torch.zeros((), device=self.device, dtype=torch.float32)
        with evaluating(self.model):  # the module itself: DDP's hooks and buffer syncs stay out of it
            for tokens, labels in batches:
                with self.autocast():
                    loss = self.model(tokens.to(self.device), labels=labels.to(self.device))
                loss_sum += loss.float()
        return mean_over(loss_sum, len(batches), world=self.world)

    def _optimizer_step(self) -> torch.Tensor:
        """Unscale, clip, step, zero the gradients; the norm before clipping."""
        norm, self._last_grad_bytes = optimizer_step(self.optimizer, self.params, self.grad_clip, self.scaler,
                                                     self.static_scale, self.min_scale)
        return norm

    # one copy of the replicated state, written by data-parallel rank 0 and read by every rank
    FILE = "model.pt"

    def optimizers(self) -> List[torch.optim.Optimizer]:
        return [self.optimizer]

    def checkpoint_files(self) -> Dict[str, Any]:
        if self.dp_rank != 0:
            return {}
        return {self.FILE: {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                            "scaler": self.scaler.state_dict() if self.scaler is not None else None}}

    def universal_state(self) -> Dict[str, Any]:
        return universal.module_state(self.model, self.optimizer, self.scaler)

    def load_universal(self, path: Path) -> None:
        universal.load_module_state(self.model, self.optimizer, path, self.scaler)

    def load_checkpoint(self, path: Path) -> None:
        # data-parallel rank 0 reads the file, the others receive it (bit for bit) from it
        state = load_on_one_rank(path / self.FILE, self.device)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scaler is not None:
            self.scaler.load_state_dict(state["scaler"])

    def state_bytes(self) -> Dict[str, int]:
        return {
            "params": tensor_bytes(self.model.parameters()),
            "grads": self._last_grad_bytes,
            "optimizer": optimizer_state_bytes(self.optimizer),
        }
