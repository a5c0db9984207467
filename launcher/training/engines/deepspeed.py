"""Data parallelism with DeepSpeed ZeRO stages 0-3 (tp = pp = 1) and offload, for any model.

The DeepSpeed config is generated from the run config and the layout (``launcher.training.ds_config``)
and archived by rank 0 (``RunDir.DS_CONFIG``). ZeRO 0-2 build the model as DDP does
(``build.build_model``: the same weights on every layout); ZeRO-3 builds it shard-first: each block is
materialised from the meta device, initialised, cast to the model dtype and partitioned over the dp
group (``deepspeed.zero.Init(module=block)``) before the next exists, then the rest of the model. The
client optimizer is torch AdamW with the engines' param groups (no weight decay on ndim < 2), or with
``zero.offload_optimizer`` DeepSpeedCPUAdam (AdamW mode, same groups). The step loop owns the lr.

One ``train_step``: per micro batch the contract's loss through the DeepSpeed engine, its backward
(scaled by 1/accum, reduced at the boundary) and ``step()`` (a no-op but at the boundary); the loss is
the global-batch mean on every rank, the grad norm DeepSpeed's pre-clipping global norm (ZeRO-0 in
fp32 records none: computed from the all-reduced gradients). Checkpoints: DeepSpeed's own
save_checkpoint / load_checkpoint (model, optimizer, ZeRO partitions, loss scaler).
"""
from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from launcher.archive import atomic
from launcher.config.schema import enum_value
from launcher.config.seeding import dropout_seed
from launcher.training import jit_ops, universal
from launcher.training.deepspeed_dist import init_distributed
from launcher.training.ds_config import build_ds_config
from launcher.training.engines.build import apply_recompute, build_model, params_on_meta
from launcher.training.engines.contract import ModelContract
from launcher.training.engines.ddp import mean_over_ranks, rank_log
from launcher.training.engines.engine import (
    DTYPES,
    Batch,
    Engine,
    StepStats,
    adamw_kwargs,
    dtype_name,
    fused_kwargs,
    grad_reduce_dtype,
    param_groups,
    tensor_bytes,
)

if TYPE_CHECKING:
    from launcher.config.schema import RunConfig


def import_deepspeed() -> Any:
    """deepspeed, pinned to the CPU accelerator without CUDA; its collectives' deprecation warnings
    (torch 2.13) silenced, which would otherwise print every step."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)
    import deepspeed

    return deepspeed


def refuse_unsupported_fp16(dtype: str) -> None:
    """fp16 on DeepSpeed's CPU accelerator needs oneDNN's fp16 kernels (CPUs with avx512_fp16 or
    amx_fp16). Launch refuses it for local runs (launcher.config.rules reads this host's CPU flags); a job
    that lands on such a CPU anyway stops here, naming the key, instead of in deepspeed.initialize
    ("Type fp16 is not supported on your device")."""
    if dtype != "fp16":
        return
    from deepspeed.accelerator import get_accelerator

    from launcher.config.errors import ConfigError

    acc = get_accelerator()
    if acc.device_name() == "cpu" and not acc.is_fp16_supported():
        raise ConfigError(
            "precision.dtype",
            "fp16 on the deepspeed engine, but DeepSpeed's CPU accelerator has no fp16 on this CPU (oneDNN has no "
            "fp16 kernels: its flags include neither avx512_fp16 nor amx_fp16)",
            "use precision=bf16 (or fp32), or run fp16 on the ddp engine (zero=0, parallelism.engine=ddp or auto), "
            "whose fp16 autocast with a loss scaler runs on this CPU",
        )


def set_communication_dtype(config: Dict[str, Any], cfg: RunConfig) -> Dict[str, Any]:
    """``precision.grad_reduce_dtype`` as DeepSpeed's ``communication_data_type`` (the dtype its gradient
    reductions travel in; DeepSpeed's own default is the model dtype). fp16 keeps DeepSpeed's default:
    its loss-scaled gradients are reduced as they are."""
    if dtype_name(cfg) != "fp16":
        config["communication_data_type"] = "bf16" if grad_reduce_dtype(cfg) == torch.bfloat16 else "fp32"
    return config


def model_width(model: nn.Module) -> int:
    """The hidden size ZeRO-3's bucket sizes derive from: a Hugging Face config's, else the widest
    embedding, else the widest linear input."""
    width = getattr(getattr(model, "config", None), "hidden_size", None)
    if width:
        return int(width)
    dims = [m.embedding_dim for m in model.modules() if isinstance(m, nn.Embedding)]
    dims = dims or [m.in_features for m in model.modules() if isinstance(m, nn.Linear)]
    return max(dims) if dims else 1024


class _FullShape:
    """A parameter seen with its full shape (a ZeRO-3 parameter's own tensor is empty; ``ds_shape``)."""

    def __init__(self, p: nn.Parameter) -> None:
        self.p, self.requires_grad, self.ndim = p, p.requires_grad, len(getattr(p, "ds_shape", p.shape))


def _groups(model: nn.Module, optim: Any) -> List[Dict[str, Any]]:
    groups = param_groups([(n, _FullShape(p)) for n, p in model.named_parameters()], float(optim.weight_decay))
    return [{**g, "params": [v.p for v in g["params"]]} for g in groups]


def tensors_of(entry: Any) -> List[torch.Tensor]:
    if torch.is_tensor(entry):
        return [entry]
    if isinstance(entry, (list, tuple)):
        return [t for item in entry for t in tensors_of(item)]
    return []


class DeepSpeedCheckpoints:
    """The checkpoint methods of an engine over ``deepspeed.initialize`` (this module's and a recipe's):
    DeepSpeed's own save and load (model, optimizer, ZeRO partitions, loss scaler; synchronous), and the
    layout-independent state (launcher.training.universal; ZeRO 1, 2 and 3, offloaded or not; ZeRO-0 in
    fp32). It
    reads ``ds``, ``module``, ``optimizer``, ``stage``, ``offload_optimizer`` and ``offload_params``."""

    DIR, TAG = "deepspeed", "state"

    def save_native(self, path: Path) -> List[Path]:
        """DeepSpeed's save; the files this rank wrote, as its checkpoint engine was asked to save them."""
        written: List[Path] = []
        engine = self.ds.checkpoint_engine
        save = engine.save
        self.native_saved = {}  # what it saved, by file (the universal form's links name its partitions)

        def noting(*args: Any, **kwargs: Any) -> Any:
            target = kwargs.get("path", args[1] if len(args) > 1 else None)
            if target is not None:
                written.append(Path(target))
                state = kwargs.get("state_dict", args[0] if args else None)
                if isinstance(state, dict):
                    self.native_saved[Path(target).relative_to(path).as_posix()] = state
            return save(*args, **kwargs)

        engine.save = noting
        try:
            self.ds.save_checkpoint(str(path / self.DIR), tag=self.TAG, save_latest=False)
        finally:
            del engine.save  # its class's method again
        return written

    def load_checkpoint(self, path: Path) -> None:
        loaded, _ = self.ds.load_checkpoint(str(path / self.DIR), tag=self.TAG, load_optimizer_states=True,
                                            load_lr_scheduler_states=False)
        if loaded is None:
            raise RuntimeError(f"DeepSpeed found no checkpoint under {path / self.DIR}")

    def _plain(self) -> bool:
        """ZeRO-0 in fp32: DeepSpeed steps the torch optimizer as it was given, over the module's own fp32
        weights (replicated, as DDP's): its state is any module's. (In bf16 DeepSpeed wraps the weights in
        an fp32 master copy of its own: not resharded.)"""
        return self.stage == 0 and not (self.ds.bfloat16_enabled() or self.ds.fp16_enabled())

    def universal_ok(self) -> bool:
        return self.stage in universal.DEEPSPEED_STAGES or self._plain()

    def universal_state(self) -> Optional[Dict[str, Any]]:
        if self._plain():
            return universal.module_state(self.module, self.optimizer)
        if not self.universal_ok():
            return None
        return universal.deepspeed_state(self.module, self.optimizer, self.stage, self._loss_scaler())

    def universal_pieces(self) -> Optional[Dict[str, Any]]:
        """ZeRO-1/2/3: each rank's fragments of the fp32 partitions its own optimizer file holds (no
        collective at a save); None elsewhere (the universal form is then built and written)."""
        if self._plain() or not self.universal_ok():
            return None
        return universal.deepspeed_pieces(self.module, self.optimizer, self.stage, self._loss_scaler(),
                                          buffers=bool(getattr(self.ds, "save_non_zero_checkpoint", True)))

    def load_universal(self, path: Path) -> None:
        if self._plain():
            universal.load_module_state(self.module, self.optimizer, path)
        else:
            universal.load_deepspeed_state(self.module, self.optimizer, self.stage, path, self._loss_scaler())

    def _loss_scaler(self) -> Any:
        """DeepSpeed's fp16 loss scaler (None in other precisions)."""
        return getattr(self.optimizer, "loss_scaler", None) if self.ds.fp16_enabled() else None


class DeepSpeedEngine(DeepSpeedCheckpoints, Engine):
    """A recipe that builds its model its own way, evaluates with its own numerics or accounts its
    memory more closely overrides ``hidden_size``, ``build``, ``eval_loss`` or ``state_bytes`` (and the
    step's ``_step_begins`` / ``_backward_ends``), as a recipe's adapter engine does."""

    def __init__(self, cfg: RunConfig, ctx: Any, model_fn: Optional[Callable[[], nn.Module]] = None,
                 contract: Optional[ModelContract] = None) -> None:
        layout = ctx.layout  # data parallel + ZeRO (tp = pp = 1): the launcher's rules hold
        self.stage = int(layout.zero)
        self.dtype = dtype_name(cfg)
        deepspeed = import_deepspeed()
        refuse_unsupported_fp16(self.dtype)
        init_distributed(ctx)  # DeepSpeed on the runtime's process group
        self.world, self.rank = int(ctx.world_size), int(ctx.rank)
        self.dp, self.dp_rank = int(layout.dp), layout.coords(self.rank)[0]
        self.device = torch.device(ctx.device)
        width = self.hidden_size(cfg, model_fn)
        self.config = set_communication_dtype(build_ds_config(cfg, layout, self.device.type, hidden_size=width), cfg)
        if ctx.is_main:
            atomic.write_json(ctx.run_dir / ctx.rundir.DS_CONFIG, self.config)
        model, self.contract, self.shard_first = self.build(deepspeed, cfg, ctx, model_fn, contract)
        apply_recompute(model, self.contract, enum_value(cfg.train.recompute))
        self.num_params = sum(int(getattr(p, "ds_numel", p.numel())) for p in model.parameters())
        model.train()
        self.offload_optimizer, self.offload_params = bool(layout.offload_optimizer), bool(layout.offload_params)
        if self.offload_optimizer:
            client = jit_ops.cpu_adam(_groups(model, cfg.optim), adamw_mode=True, **adamw_kwargs(cfg.optim))
        else:
            client = torch.optim.AdamW(_groups(model, cfg.optim), **adamw_kwargs(cfg.optim),  # DeepSpeed moves the
                                       **fused_kwargs(self.device.type == "cuda"))  # masters to the device
        self.ds, self.optimizer, _, _ = deepspeed.initialize(model=model, optimizer=client, config=self.config,
                                                             dist_init_required=False)
        self.module = self.ds.module
        self._undo_state_init_step()
        self.stats = StepStats(ctx, self.world)  # the loss all-reduce carries the stop votes

    def hidden_size(self, cfg: RunConfig, model_fn: Optional[Callable[[], nn.Module]]) -> Optional[int]:
        """The width ZeRO-3's bucket sizes derive from: the model's (built on the meta device); None where
        the config names it (``build_ds_config`` reads cfg.model.hidden_size) or below ZeRO-3."""
        if self.stage != 3:
            return None
        with params_on_meta():
            return model_width(model_fn())

    def build(self, deepspeed: Any, cfg: RunConfig, ctx: Any, model_fn: Optional[Callable[[], nn.Module]],
              contract: Optional[ModelContract]) -> Tuple[nn.Module, ModelContract, bool]:
        """The model (ZeRO-3: each unit partitioned in the model dtype as it is built), its contract,
        whether it was built shard-first; dropout seeded per data-parallel rank."""
        seed, low = int(cfg.seed), DTYPES[self.dtype]

        def partition(unit: nn.Module, name: str) -> None:
            """ZeRO-3: the unit's parameters (those not partitioned yet) in the model dtype, partitioned."""
            for p in unit.parameters():
                if not hasattr(p, "ds_id"):
                    p.data = p.data.to(low)
            deepspeed.zero.Init(module=unit, config_dict_or_path=self.config, mem_efficient_linear=False)

        built = build_model(model_fn, seed, contract, take=partition if self.stage == 3 else None, log=rank_log(ctx))
        torch.manual_seed(dropout_seed(seed, self.dp_rank))
        return built

    def _step_begins(self) -> None:
        """Before a step's first micro batch (a recipe's memory sampling)."""

    def _backward_ends(self) -> None:
        """After each micro batch's backward (a recipe's memory sampling)."""

    def _undo_state_init_step(self) -> None:
        """ZeRO-0 in bf16/fp16 wraps the client in FP16_UnfusedOptimizer, whose constructor steps once on
        zero gradients (Adam's step count 1, the fp32 masters decayed once; the first real update then
        ~0.73x too small): drop the state and copy the 16-bit weights back into the masters."""
        from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

        if not isinstance(self.optimizer, FP16_UnfusedOptimizer):
            return
        self.optimizer.optimizer.state.clear()
        with torch.no_grad():
            for fp32_group, low_group in zip(self.optimizer.fp32_groups, self.optimizer.fp16_groups):
                for master, low in zip(fp32_group, low_group):
                    master.copy_(low)

    def describe(self) -> str:
        off = (("+offload_optimizer" if self.offload_optimizer else "")
               + ("+offload_params" if self.offload_params else ""))
        return f"DeepSpeedEngine({type(self.module).__name__},{self.contract.name},zero={self.stage}{off},{self.dtype})"

    def _to_device(self, batch: Batch) -> Batch:
        return batch[0].to(self.device, non_blocking=True), batch[1].to(self.device, non_blocking=True)

    def train_step(self, batches: List[Batch], lr: float) -> Tuple[float, float]:
        for group in self.optimizer.param_groups:  # every DeepSpeed wrapper forwards its param_groups
            group["lr"] = lr
        accum = len(batches)
        if accum != self.ds.gradient_accumulation_steps():
            raise ValueError(f"{accum} micro batches per step, DeepSpeed config says "
                             f"{self.ds.gradient_accumulation_steps()}")
        self._step_begins()
        loss_sum = torch.zeros((), device=self.device, dtype=torch.float32)
        own_norm: Optional[torch.Tensor] = None
        for k, batch in enumerate(batches):
            with self._phase("forward"):
                loss = self.contract.loss(self.ds, self._to_device(batch))
            with self._phase("backward"):
                self.ds.backward(loss)
            loss_sum += loss.detach().float()
            self._backward_ends()
            if k == accum - 1 and self.stage == 0 and self.dtype == "fp32":
                own_norm = torch.nn.utils.get_total_norm([p.grad for p in self.module.parameters()
                                                          if p.grad is not None])
            with self._phase("optimizer"):
                self.ds.step()
        norm = self.ds.get_global_grad_norm()
        norm = own_norm if norm is None else norm
        stats = self.stats.with_votes(loss_sum.div_(accum).reshape(1))
        with self._phase("loss_sync"):
            if self.world > 1:
                torch.distributed.all_reduce(stats, op=torch.distributed.ReduceOp.SUM)
                stats[:1] /= self.world
        norm_t = (norm.detach().float().reshape(1).to(stats.device) if torch.is_tensor(norm)
                  else torch.tensor([float("nan") if norm is None else float(norm)], device=stats.device))
        norm_value, loss_value = self.stats.read(torch.cat([norm_t, stats]))
        return loss_value, norm_value

    def eval_loss(self, batches: List[Batch]) -> float:
        self.ds.eval()
        total = torch.zeros((), device=self.device, dtype=torch.float32)
        with torch.no_grad():
            for batch in batches:
                total += self.contract.loss(self.ds, self._to_device(batch)).float()
        self.ds.train()
        return float(mean_over_ranks(total / max(1, len(batches)), self.world))

    # ---- what this rank holds -------------------------------------------------------------------------
    def _param_tensors(self) -> List[torch.Tensor]:
        params = list(self.module.parameters())
        return params if self.stage < 3 else [p.ds_tensor for p in params]

    def _optimizer_tensors(self) -> List[torch.Tensor]:
        """Adam's state (this rank's partition for ZeRO >= 1) and the fp32 master partitions."""
        opt = self.optimizer
        inner = getattr(opt, "optimizer", opt)
        held = [v for st in inner.state.values() for v in st.values() if torch.is_tensor(v) and v.dim() > 0]
        for attr in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat", "fp32_groups"):
            for entry in getattr(opt, attr, None) or []:
                held.extend(tensors_of(entry))
        return held

    def local_state(self) -> Dict[str, torch.Tensor]:
        """This rank's parameters (ZeRO-3: partitions) and optimizer state (Adam's and the fp32 master
        partitions), by name (for exactness checks)."""
        out = {f"param.{n}": (p.ds_tensor if self.stage == 3 else p).detach()
               for n, p in self.module.named_parameters()}
        out.update({f"optim.{i}": t.detach() for i, t in enumerate(self._optimizer_tensors())})
        return out

    def state_bytes(self) -> Dict[str, int]:
        """Device bytes of this rank's parameters, gradients (the module's .grad) and optimizer state;
        offloaded state counts 0."""
        params = [] if self.offload_params else self._param_tensors()
        return {"params": tensor_bytes(params),
                "grads": tensor_bytes(p.grad for p in self.module.parameters() if p.grad is not None),
                "optimizer": 0 if self.offload_optimizer else tensor_bytes(self._optimizer_tensors())}
