"""Plain data parallelism for any model: torch DistributedDataParallel (one process: the model itself).
The model is built by ``build.build_model`` (the same weights as every other layout)."""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from launcher.config.schema import enum_value
from launcher.config.seeding import dropout_seed
from launcher.training import universal
from launcher.training.checkpoint import load_on_one_rank
from launcher.training.engines.build import apply_recompute, build_model
from launcher.training.engines.contract import ModelContract
from launcher.training.engines.engine import (
    Batch,
    Engine,
    StepStats,
    adamw,
    autocast_for,
    compress_ddp_grads,
    dtype_name,
    grad_scaler,
    optimizer_state_bytes,
    optimizer_step,
    tensor_bytes,
)

if TYPE_CHECKING:
    from launcher.config.schema import RunConfig


def rank_log(ctx: Any) -> Callable[[str], None]:
    """print on the job's first rank, nothing on the others."""
    return (lambda s: print(s, flush=True)) if ctx.is_main else (lambda s: None)


def mean_over_ranks(value: torch.Tensor, world: int) -> torch.Tensor:
    if world > 1:
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
        value /= world
    return value


class DDPEngine(Engine):
    def __init__(self, cfg: RunConfig, ctx: Any, model_fn: Optional[Callable[[], nn.Module]] = None,
                 contract: Optional[ModelContract] = None) -> None:
        layout = ctx.layout  # data parallel only: the launcher's rules hold
        self.world = int(ctx.world_size)
        self.dp, self.dp_rank = int(layout.dp), layout.coords(int(ctx.rank))[0]
        self.device = torch.device(ctx.device)
        seed = int(cfg.seed)
        model, self.contract, self.shard_first = self.build(cfg, ctx, model_fn, contract)
        self.model = model.to(self.device)
        apply_recompute(self.model, self.contract, enum_value(cfg.train.recompute))
        torch.manual_seed(dropout_seed(seed, self.dp_rank))  # dropout masks differ per replica
        self.num_params = sum(p.numel() for p in self.model.parameters())
        self.ddp: Optional[nn.parallel.DistributedDataParallel] = None
        if self.world > 1:
            ids = [self.device.index] if self.device.type == "cuda" else None
            self.ddp = nn.parallel.DistributedDataParallel(self.model, device_ids=ids, gradient_as_bucket_view=True)
            compress_ddp_grads(self.ddp, cfg)  # precision.grad_reduce_dtype
        self.runner: nn.Module = self.ddp if self.ddp is not None else self.model
        self.model.train()
        self.optimizer = adamw(self.model, cfg.optim)
        self.params = [p for g in self.optimizer.param_groups for p in g["params"]]
        self.grad_clip = float(cfg.optim.grad_clip)
        self.dtype = dtype_name(cfg)
        self.autocast = autocast_for(cfg, self.device.type)
        self.scaler, self.static_scale = grad_scaler(cfg, self.device.type)
        self.min_scale = float(cfg.precision.min_loss_scale)
        self._last_grad_bytes = 0
        self.stats = StepStats(ctx, self.world)  # the loss all-reduce carries the stop votes

    def build(self, cfg: RunConfig, ctx: Any, model_fn: Optional[Callable[[], nn.Module]],
              contract: Optional[ModelContract]) -> Tuple[nn.Module, ModelContract, bool]:
        """The model, alike on every rank, its contract, and whether it was built shard-first
        (``build.build_model``: on the meta device, then unit by unit with the contract's init). A recipe
        that builds its model its own way overrides this (a recipe's adapter engine does)."""
        return build_model(model_fn, int(cfg.seed), contract, log=rank_log(ctx))

    def describe(self) -> str:
        return f"DDPEngine({type(self.model).__name__},{self.contract.name},{self.dtype})"

    def train_step(self, batches: List[Batch], lr: float) -> Tuple[float, float]:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        accum = len(batches)
        loss_sum = torch.zeros((), device=self.device, dtype=torch.float32)
        for k, (tokens, labels) in enumerate(batches):
            batch = (tokens.to(self.device, non_blocking=True), labels.to(self.device, non_blocking=True))
            sync = self.ddp is None or k == accum - 1
            with contextlib.nullcontext() if sync else self.ddp.no_sync():
                with self._phase("forward"), self.autocast():
                    loss = self.contract.loss(self.runner, batch) / accum
                with self._phase("backward"):
                    (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
            loss_sum += loss.detach().float()
        with self._phase("optimizer"):
            grad_norm = self._optimizer_step()
        stats = self.stats.with_votes(loss_sum.reshape(1))
        with self._phase("loss_sync"):
            if self.world > 1:
                dist.all_reduce(stats, op=dist.ReduceOp.SUM)
                stats[:1] /= self.world
        norm_value, loss_value = self.stats.read(torch.cat([grad_norm.float().reshape(1), stats]))
        return loss_value, norm_value

    def _optimizer_step(self) -> torch.Tensor:
        norm, self._last_grad_bytes = optimizer_step(self.optimizer, self.params, self.grad_clip, self.scaler,
                                                     self.static_scale, self.min_scale)
        return norm

    def eval_loss(self, batches: List[Batch]) -> float:
        self.model.eval()
        total = torch.zeros((), device=self.device, dtype=torch.float32)
        with torch.no_grad(), self.autocast():
            for tokens, labels in batches:
                total += self.contract.loss(self.model, (tokens.to(self.device), labels.to(self.device))).float()
        self.model.train()
        return float(mean_over_ranks(total / max(1, len(batches)), self.world))

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

    def local_state(self) -> Dict[str, torch.Tensor]:
        """This rank's parameters and optimizer state, by name (for exactness checks)."""
        out = {f"param.{n}": p.detach() for n, p in self.model.named_parameters()}
        names = {id(p): n for n, p in self.model.named_parameters()}
        for p, st in self.optimizer.state.items():
            out.update({f"optim.{names[id(p)]}.{k}": v for k, v in st.items() if torch.is_tensor(v)})
        return out

    def state_bytes(self) -> Dict[str, int]:
        return {"params": tensor_bytes(self.model.parameters()), "grads": self._last_grad_bytes,
                "optimizer": optimizer_state_bytes(self.optimizer)}
