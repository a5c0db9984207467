"""Fully sharded data parallelism for any model: torch FSDP2 (``fully_shard``), one FSDP unit per block
(the contract's ``blocks``), then the root for the rest.

Built shard-first (``build.build_model``): each block is materialised on the CPU from the meta device,
initialised as on every other layout, and sharded over the dp mesh before the next block exists; no
rank ever holds more than one whole block. Mixed precision from ``precision``: parameters gathered and
computed in bf16/fp16, gradients reduced in fp32 (or bf16: precision.grad_reduce_dtype), the sharded
(master) parameters and AdamW in fp32; fp16 adds a sharded loss scaler. ``parallelism.cpu_offload``:
parameters, gradients and the optimizer step in host memory (torch's CPUOffloadPolicy);
``parallelism.reshard_after_forward``: free a block's gathered parameters after its forward (ZeRO-3
behaviour) or keep them for the backward (ZeRO-2).
Every micro batch's backward reduce-scatters into the sharded gradients. ``parallelism.tp > 1``: the
model's TP plan (its contract's ``tp_plan``: torch's ``parallelize_module`` styles) over the tp ranks of
a (dp, tp) mesh, FSDP2 over dp (built whole first, then split: not shard-first).

Checkpoints: one file per rank with its shards of the model and optimizer state
(torch.distributed.checkpoint.state_dict's sharded state dicts, as local tensors), loaded into the
same layout bit for bit.
"""
from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.tensor.parallel import parallelize_module

from launcher.config.schema import enum_value
from launcher.config.seeding import dropout_seed
from launcher.training import universal
from launcher.training.engines.build import apply_recompute, build_model, units
from launcher.training.engines.contract import ModelContract
from launcher.training.engines.ddp import mean_over_ranks, rank_log
from launcher.training.engines.engine import (
    DTYPES,
    Batch,
    Engine,
    StepStats,
    adamw,
    dtype_name,
    grad_reduce_dtype,
    grad_scaler,
    optimizer_state_bytes,
    optimizer_step,
    tensor_bytes,
)

if TYPE_CHECKING:
    from launcher.config.schema import RunConfig


def local(obj: Any) -> Any:
    """A (nested) state with every DTensor replaced by this rank's shard (a plain tensor)."""
    if hasattr(obj, "to_local"):
        return obj.to_local()
    if isinstance(obj, dict):
        return {k: local(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(local(v) for v in obj)
    return obj


def fill(live: Any, saved: Any) -> Any:
    """``live`` (a state dict of this layout, DTensors included) with the values of ``saved`` (its
    ``local`` form) copied in; non-tensor entries are taken from ``saved``."""
    if hasattr(live, "to_local"):
        live.to_local().copy_(saved)
        return live
    if torch.is_tensor(live):
        return live.copy_(saved) if torch.is_tensor(saved) and live.shape == saved.shape else saved
    if isinstance(live, dict) and isinstance(saved, dict):
        return {k: fill(live[k], v) if k in live else v for k, v in saved.items()}
    if isinstance(live, (list, tuple)) and isinstance(saved, (list, tuple)) and len(live) == len(saved):
        return type(live)(fill(a, b) for a, b in zip(live, saved))
    return saved


class FSDPEngine(Engine):
    def __init__(self, cfg: RunConfig, ctx: Any, model_fn: Callable[[], nn.Module],
                 contract: Optional[ModelContract] = None) -> None:
        layout = ctx.layout  # data parallel, ZeRO off, tp = pp = 1: the launcher's rules hold
        self.world, self.rank = int(ctx.world_size), int(ctx.rank)
        self.dp, self.dp_rank = int(layout.dp), layout.coords(self.rank)[0]
        self.device = torch.device(ctx.device)
        self.dtype = dtype_name(cfg)
        par = cfg.parallelism
        self.offload = bool(par.cpu_offload)
        self.reshard = bool(par.reshard_after_forward)
        self.tp = int(layout.tp)
        if self.tp > 1:  # rank = dp_idx * tp + tp_idx (launcher.config.layout): the row-major (dp, tp) mesh
            self.mesh = init_device_mesh(self.device.type, (self.dp, self.tp), mesh_dim_names=("dp", "tp"))
            dp_mesh = self.mesh["dp"]
            # (a grad norm over the 2D mesh is two all-reduces: torch says so every step)
            logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
        else:
            self.mesh = dp_mesh = init_device_mesh(self.device.type, (self.world,), mesh_dim_names=("dp",))
        low = DTYPES[self.dtype] if self.dtype != "fp32" else None
        options = dict(mesh=dp_mesh, reshard_after_forward=self.reshard,
                       mp_policy=MixedPrecisionPolicy(param_dtype=low, reduce_dtype=grad_reduce_dtype(cfg)),
                       offload_policy=CPUOffloadPolicy(pin_memory=self.device.type == "cuda") if self.offload
                       else OffloadPolicy())
        seed = int(cfg.seed)

        def shard(unit: nn.Module, name: str) -> None:
            fully_shard(unit, **options)  # moves the unit to the mesh's device (kept on the host with offload)

        if self.tp == 1:
            self.model, self.contract, self.shard_first = build_model(model_fn, seed, contract, take=shard,
                                                                      log=rank_log(ctx))
        else:
            self.model, self.contract, self.shard_first = self._tensor_parallel(model_fn, seed, contract, shard,
                                                                                rank_log(ctx))
        torch.manual_seed(dropout_seed(seed, self.dp_rank))
        apply_recompute(self.model, self.contract, enum_value(cfg.train.recompute))
        self.num_params = sum(p.numel() for p in self.model.parameters())
        self.model.train()
        self.optimizer = adamw(self.model, cfg.optim)
        self.params = [p for g in self.optimizer.param_groups for p in g["params"]]
        self.grad_clip = float(cfg.optim.grad_clip)
        self.scaler, self.static_scale = grad_scaler(cfg, self.device.type, ShardedGradScaler)
        if self.scaler is not None:  # its one-element scale meets DTensor gradients: torch warns every step
            warnings.filterwarnings("ignore", message="Found a non-scalar tensor with numel=1", category=UserWarning)
        self.min_scale = float(cfg.precision.min_loss_scale)
        self._last_grad_bytes = 0
        self.stats = StepStats(ctx, self.world)  # the loss all-reduce carries the stop votes

    def _tensor_parallel(self, model_fn: Callable[[], nn.Module], seed: int, contract: Optional[ModelContract],
                         shard: Callable[[nn.Module, str], None], log: Callable[[str], None]
                         ) -> Tuple[nn.Module, ModelContract, bool]:
        """tp > 1: the model built whole (the same weights as every layout), split by its contract's TP plan
        over the tp mesh (torch's parallelize_module), then each block and the root sharded over dp."""
        model, contract, _ = build_model(model_fn, seed, contract, log=log)
        if contract.tp_plan is None:
            raise ValueError(f"parallelism.tp={self.tp} on the fsdp engine needs the model's TP plan, but "
                             f"{type(model).__name__}'s contract ({contract.name}) has none: give it a "
                             "launcher_contract() with tp_plan (docs/training-api.md), or set parallelism.tp=1")
        parallelize_module(model, self.mesh["tp"], contract.tp_plan(model))
        for name, unit, _ in units(model, contract):
            shard(unit, name)
        return model, contract, False

    def describe(self) -> str:
        extra = (("+cpu_offload" if self.offload else "") + ("" if self.reshard else "+no_reshard")
                 + (f",tp={self.tp}" if self.tp > 1 else ""))
        return f"FSDPEngine({type(self.model).__name__.removeprefix('FSDP')},{self.contract.name},{self.dtype}{extra})"

    def _to_device(self, batch: Batch) -> Batch:
        return batch[0].to(self.device, non_blocking=True), batch[1].to(self.device, non_blocking=True)

    def train_step(self, batches: List[Batch], lr: float) -> Tuple[float, float]:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        accum = len(batches)
        loss_sum = torch.zeros((), device=self.device, dtype=torch.float32)
        for batch in batches:
            with self._phase("forward"):
                loss = self.contract.loss(self.model, self._to_device(batch)) / accum
            with self._phase("backward"):  # reduce-scatters each block's gradients into their shards
                (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
            loss_sum += loss.detach().float()
        with self._phase("optimizer"):
            norm, self._last_grad_bytes = optimizer_step(self.optimizer, self.params, self.grad_clip, self.scaler,
                                                         self.static_scale, self.min_scale)
        stats = self.stats.with_votes(loss_sum.reshape(1))
        with self._phase("loss_sync"):
            if self.world > 1:
                torch.distributed.all_reduce(stats, op=torch.distributed.ReduceOp.SUM)
                stats[:1] /= self.world
        norm_value, loss_value = self.stats.read(torch.cat([norm.float().reshape(1).to(stats.device), stats]))
        return loss_value, norm_value

    def eval_loss(self, batches: List[Batch]) -> float:
        self.model.eval()
        total = torch.zeros((), device=self.device, dtype=torch.float32)
        with torch.no_grad():
            for batch in batches:
                total += self.contract.loss(self.model, self._to_device(batch)).float()
        for m in self.model.modules():  # without a backward, reshard_after_forward=false leaves them gathered
            if isinstance(m, FSDPModule):
                m.reshard()
        self.model.train()
        return float(mean_over_ranks(total / max(1, len(batches)), self.world))

    # ---- checkpoints: this rank's shards ------------------------------------------------------------
    FILE = "fsdp_rank_{rank:05d}.pt"

    def optimizers(self) -> List[torch.optim.Optimizer]:
        return [self.optimizer]

    def checkpoint_files(self) -> Dict[str, Any]:
        return {self.FILE.format(rank=self.rank): {
            "model": local(get_model_state_dict(self.model)),
            "optimizer": local(get_optimizer_state_dict(self.model, self.optimizer)),
            "scaler": self.scaler.state_dict() if self.scaler is not None else None}}

    def universal_state(self) -> Dict[str, Any]:
        return universal.module_state(self.model, self.optimizer, self.scaler)

    def load_universal(self, path: Path) -> None:
        universal.load_module_state(self.model, self.optimizer, path, self.scaler)

    def load_checkpoint(self, path: Path) -> None:
        state = torch.load(path / self.FILE.format(rank=self.rank), map_location="cpu", weights_only=True)
        set_model_state_dict(self.model, fill(get_model_state_dict(self.model), state["model"]))
        live = get_optimizer_state_dict(self.model, self.optimizer)  # (creates the state a fresh AdamW lacks)
        set_optimizer_state_dict(self.model, self.optimizer, fill(live, state["optimizer"]))
        if self.scaler is not None:
            self.scaler.load_state_dict(state["scaler"])

    def local_state(self) -> Dict[str, torch.Tensor]:
        """This rank's shards of the parameters and optimizer state, by name (for exactness checks)."""
        out = {f"param.{n}": p.detach().to_local() for n, p in self.model.named_parameters()}
        names = {id(p): n for n, p in self.model.named_parameters()}
        for p, st in self.optimizer.state.items():
            out.update({f"optim.{names[id(p)]}.{k}": local(v) for k, v in st.items() if torch.is_tensor(v)})
        return out

    def state_bytes(self) -> Dict[str, int]:
        held = [] if self.offload else [p.to_local() for p in self.model.parameters()]
        return {"params": tensor_bytes(held), "grads": 0 if self.offload else self._last_grad_bytes,
                "optimizer": 0 if self.offload else optimizer_state_bytes(self.optimizer)}
