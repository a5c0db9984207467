"""Data parallelism with DeepSpeed ZeRO stages 0-3 (tp = pp = 1), optimizer / parameter offload.

The DeepSpeed config is generated from the run config and the run's layout (``ctx.layout``: dp,
ZeRO stage, offload, gradient accumulation) by ``launcher.training.ds_config`` and archived in the run
dir by rank 0 (``RunDir.DS_CONFIG``, as the generic deepspeed engine does). Which layouts this engine gets (tp = pp = 1;
no fp16 at ZeRO-0, where DeepSpeed 0.19 never scales the loss, deepspeedai/DeepSpeed#8393) is the
launcher's rule table's business (``launcher.rules.RULES``). ZeRO 0-2 build the model exactly as
DDP does (``base.build_model``: same seed, same init). ZeRO-3 builds it already partitioned (see
``_build_partitioned``): no rank ever holds the whole model, and each rank's partitions hold exactly
the single-process initial values (``recipes.gpt.init.init_flat``). The client optimizer is torch
AdamW with the same param groups (no weight decay on ndim < 2), except with ``zero.offload_optimizer`` where
DeepSpeed's host optimizer DeepSpeedCPUAdam (same groups, AdamW mode) steps the offloaded fp32
partitions. The step loop owns the lr schedule: it is written into the optimizer's param groups
before every step; no DeepSpeed scheduler is configured.

One ``train_step`` = for each micro batch ``engine(tokens, labels)`` -> loss, ``engine.backward``
(DeepSpeed divides by the accumulation steps and reduces / reduce-scatters at its boundary) and
``engine.step()`` (a no-op except at the boundary, where it clips and steps). The reported loss is
the mean over the micro batches, averaged over the ranks: the global-batch mean, on every rank.
The grad norm is DeepSpeed's pre-clipping global norm (``get_global_grad_norm``); ZeRO-0 in fp32
records none, so it is computed from the all-reduced gradients.

First use compiles C++ ops (gcc + ninja; in a node-local dir seeded from ~/.cache/torch_extensions:
launcher.training.jit_ops): DeepSpeedCPUAdam for zero.offload_optimizer (~2-2.5 min on 2 CPU cores,
2.5 s to load once built). DeepSpeed's shared-memory comm op, which only inference uses, is not built
(launcher.training.deepspeed_dist).
"""
from __future__ import annotations

import contextlib
import gc
import os
import warnings
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from launcher.archive import atomic
from launcher.schema import enum_value
from launcher.seeding import dropout_seed
from launcher.training import jit_ops
from launcher.training.deepspeed_dist import init_distributed
from launcher.training.ds_config import build_ds_config
from launcher.training.engines.deepspeed import DeepSpeedCheckpoints, set_communication_dtype
from launcher.training.engines.engine import (
    Batch,
    Engine,
    StepStats,
    adamw_kwargs,
    dtype_name,
    fused_kwargs,
    param_groups,
)
from recipes.common.memory import BuildMeter
from recipes.common.seeding import seed_everything
from recipes.gpt.engines.base import build_model, evaluating, mean_over
from recipes.gpt.init import init_flat
from recipes.gpt.model import GPT


def _import_deepspeed():
    """Import deepspeed, pinned to the CPU accelerator when there is no CUDA (it would pick CPU by
    itself after probing, with a warning; an explicit DS_ACCELERATOR wins)."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    # DeepSpeed's ZeRO collectives call the torch.distributed names torch 2.13 deprecated, and its
    # warnings.catch_warnings() blocks reset Python's once-per-location registry: without this
    # filter every collective of every step prints the same FutureWarning into the rank's log.
    warnings.filterwarnings(
        "ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning
    )
    import deepspeed

    return deepspeed


def _refuse_unsupported_fp16(dtype: str) -> None:
    """fp16 on DeepSpeed's CPU accelerator needs oneDNN's fp16 kernels (CPUs with avx512_fp16 or
    amx_fp16). Launch refuses it for local runs (launcher.rules reads this host's CPU flags); a job
    that lands on such a CPU anyway stops here, naming the key, instead of in deepspeed.initialize
    ("Type fp16 is not supported on your device")."""
    if dtype != "fp16":
        return
    from deepspeed.accelerator import get_accelerator

    from launcher.errors import ConfigError

    acc = get_accelerator()
    if acc.device_name() == "cpu" and not acc.is_fp16_supported():
        raise ConfigError(
            "precision.dtype",
            "fp16 on the deepspeed engine, but DeepSpeed's CPU accelerator has no fp16 on this CPU (oneDNN has no "
            "fp16 kernels: its flags include neither avx512_fp16 nor amx_fp16)",
            "use precision=bf16 (or fp32), or run fp16 on the ddp engine (zero=0, parallelism.engine=ddp or auto), "
            "whose fp16 autocast with a loss scaler runs on this CPU",
        )


class _FullShape:
    """A parameter seen with its full shape: a ZeRO-3 parameter's own tensor is empty once partitioned
    (``ds_shape`` is its shape), and the engines' ``param_groups`` tells weights from biases by ``ndim``."""

    def __init__(self, p: nn.Parameter) -> None:
        self.p, self.requires_grad, self.ndim = p, p.requires_grad, len(getattr(p, "ds_shape", p.shape))


def _param_groups(model: nn.Module, optim: Any) -> List[Dict[str, Any]]:
    """The engines' ``param_groups`` (no weight decay on ndim < 2) by each parameter's full shape."""
    groups = param_groups([(n, _FullShape(p)) for n, p in model.named_parameters()], float(optim.weight_decay))
    return [{**g, "params": [v.p for v in g["params"]]} for g in groups]


def _num_params(model: nn.Module) -> int:
    """Distinct parameters, a ZeRO-3 partitioned one by its full size (``ds_numel``)."""
    return sum(int(getattr(p, "ds_numel", p.numel())) for p in model.parameters())


def _cpu_adam(model: torch.nn.Module, optim: Any):
    """DeepSpeedCPUAdam in AdamW mode with the groups and hyper-parameters of the engines' adamw (JIT-compiles
    DeepSpeed's cpu_adam op on first use, node-locally: launcher.training.jit_ops)."""
    return jit_ops.cpu_adam(_param_groups(model, optim), adamw_mode=True, **adamw_kwargs(optim))


# torch's default initialisers, which nn.Linear / nn.Embedding / nn.LayerNorm call from their constructors
_DEFAULT_INITS = ("kaiming_uniform_", "uniform_", "normal_", "ones_", "zeros_")


@contextlib.contextmanager
def _no_default_init() -> Iterator[None]:
    """Module constructors leave their parameters uninitialised (torch.nn.init's in-place initialisers
    return their tensor untouched): values that are overwritten anyway are neither computed nor
    written, so the full-size tensors zero.Init creates per module are never written and, on the host,
    the large ones (mapped by themselves) never become resident before zero.Init frees them."""
    saved = {name: getattr(nn.init, name) for name in _DEFAULT_INITS}
    try:
        for name in _DEFAULT_INITS:
            setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
        yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


def _partition_only_init(deepspeed: Any) -> type:
    """deepspeed.zero.Init that partitions each new parameter without first broadcasting it from rank 0.

    zero.Init (DeepSpeed 0.19: ``Init._zero_init_param``) creates each module's parameters whole on
    every rank, broadcasts rank 0's values (so that every rank's partition comes from one init) and
    keeps this rank's partition. Here the partitions are filled afterwards from the shard-stable init
    (``init_flat``), the same on every rank by construction: the broadcast would send the whole model
    for nothing and make every receiving rank write (make resident) each full parameter. Where a
    DeepSpeed version has no ``_zero_init_param`` the override is never called and DeepSpeed broadcasts
    as usual: slower, the same values."""

    class PartitionOnlyInit(deepspeed.zero.Init):
        def _zero_init_param(self, param: nn.Parameter) -> None:
            self._convert_to_deepspeed_param(param)
            param.partition()

    return PartitionOnlyInit


FILL_CHUNK = 1 << 23  # elements of a partition computed at a time: 32 MB in fp32, glibc's largest mmap threshold


def _fill_partitions(model: nn.Module, seed: int, num_layers: int,
                     rank_of: Callable[[nn.Parameter], int] = lambda p: dist.get_rank(group=p.ds_process_group),
                     ) -> None:
    """Write this rank's partition of every ZeRO-3 parameter from ``init_flat``: the parameter is
    flattened row-major, padded with zeros to a multiple of the partition group's size, and rank r of
    the group holds elements [r * n, (r + 1) * n), n = ``ds_tensor.numel()`` (DeepSpeed's layout,
    ``Init._partition_param``). Computed by this rank alone, in fp32, FILL_CHUNK elements at a time
    (the values are a function of the element's place, so chunks change nothing), cast to the
    partition's dtype (the model dtype zero.Init stores: fp32, bf16 or fp16). A tied head is the
    embedding's parameter (``named_parameters`` names it once). ``rank_of``: this rank's place in the
    parameter's partition group."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            part = p.ds_tensor
            n = part.numel()
            start = n * rank_of(p)
            for lo in range(0, n, FILL_CHUNK):
                hi = min(n, lo + FILL_CHUNK)
                values = init_flat(seed, name, tuple(p.ds_shape), num_layers, start + lo, start + hi)
                part[lo:hi].copy_(values.to(dtype=part.dtype))


class DeepSpeedEngine(DeepSpeedCheckpoints, Engine):
    def __init__(self, cfg: Any, ctx: Any) -> None:
        layout = ctx.layout  # data parallel + ZeRO (tp = pp = 1): the launcher's layout rules hold
        self.stage = int(layout.zero)
        self.dtype = dtype_name(cfg)
        deepspeed = _import_deepspeed()
        _refuse_unsupported_fp16(self.dtype)
        # torch.distributed is already up (launcher runtime); DeepSpeed wraps the existing group.
        init_distributed(ctx)  # the runtime's group, no inference-only op build
        self.world = int(ctx.world_size)
        self.dp, self.dp_rank = int(layout.dp), layout.coords(int(ctx.rank))[0]
        self.device = torch.device(ctx.device)
        # overlap and pinning on GPUs; gradients reduced in precision.grad_reduce_dtype
        self.config = set_communication_dtype(build_ds_config(cfg, layout, self.device.type), cfg)
        if ctx.is_main:
            atomic.write_json(ctx.run_dir / ctx.rundir.DS_CONFIG, self.config)

        self.build_meter = BuildMeter(self.device).start()
        model = self._build_partitioned(deepspeed, cfg) if self.stage == 3 else build_model(cfg, self.dp_rank)
        self.build_meter.stop()
        self.num_params = _num_params(model)
        model.train()
        self.offload_optimizer = bool(layout.offload_optimizer)
        self.offload_params = bool(layout.offload_params)
        client = (_cpu_adam(model, cfg.optim) if self.offload_optimizer
                  else torch.optim.AdamW(_param_groups(model, cfg.optim), **adamw_kwargs(cfg.optim),
                                         **fused_kwargs(self.device.type == "cuda")))  # masters on the device
        self.ds, self.optimizer, _, _ = deepspeed.initialize(
            model=model, optimizer=client, config=self.config, dist_init_required=False
        )
        self.module = self.ds.module
        self._undo_state_init_step()
        self.stats = StepStats(ctx, self.world)  # the loss all-reduce carries the stop votes
        self._grads_peak = 0
        self._grads_last = 0

    def _build_partitioned(self, deepspeed: Any, cfg: Any) -> GPT:
        """ZeRO-3: the GPT built inside zero.Init (each module's parameters partitioned over the dp
        group as its constructor returns, in the dtype and on the device (or, with zero.offload_params,
        the host) the DeepSpeed config gives), uninitialised, then each rank's partitions filled with
        their part of the single-process values. At most one module's parameters exist whole at a
        time, untouched (see ``_no_default_init``, ``_partition_only_init``); nothing is gathered or
        broadcast. Seeded as ``base.build_model`` (dropout masks differ per dp rank)."""
        seed = int(cfg.seed)
        seed_everything(seed)
        with _no_default_init(), _partition_only_init(deepspeed)(config_dict_or_path=self.config):
            model = GPT(cfg.model, recompute=enum_value(cfg.train.recompute), seed=None)
        # the head's own weight, replaced by the tie, is a partition kept alive by a reference cycle
        # (DeepSpeed's per-parameter closures) until the cyclic collector runs: free it now
        gc.collect()
        _fill_partitions(model, seed, int(cfg.model.num_layers))
        torch.manual_seed(dropout_seed(seed, self.dp_rank))
        return model

    def _undo_state_init_step(self) -> None:
        """ZeRO-0 with bf16/fp16 wraps the client optimizer in DeepSpeed's FP16_UnfusedOptimizer, whose
        constructor runs one optimizer step on all-zero gradients to create the Adam state. On a
        torch AdamW that step counts: the first real step then uses Adam's bias correction for step 2
        (its update is ~0.73x the DDP one) and the fp32 master weights were decayed once by
        lr*weight_decay. Undo both: drop the state (AdamW recreates it at the first real step) and
        copy the 16-bit weights (untouched by that step) back into the fp32 masters."""
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
        return f"DeepSpeedEngine(zero={self.stage}{off},{self.dtype})"

    def _set_lr(self, lr: float) -> None:
        # every DeepSpeed optimizer wrapper forwards param_groups to the optimizer it steps
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def train_step(self, batches: List[Batch], lr: float) -> Tuple[float, float]:
        self._set_lr(lr)
        accum = len(batches)
        self._grads_peak = 0
        if accum != self.ds.gradient_accumulation_steps():
            raise ValueError(f"{accum} micro batches per step, "
                             f"DeepSpeed config says {self.ds.gradient_accumulation_steps()}")
        loss_sum = torch.zeros((), device=self.device, dtype=torch.float32)
        own_norm: Optional[torch.Tensor] = None
        for k, (tokens, labels) in enumerate(batches):
            tokens = tokens.to(self.device, non_blocking=True)
            labels = labels.to(self.device, non_blocking=True)
            with self._phase("forward"):
                loss = self.ds(tokens, labels)  # mean over this micro batch (fp32: the model upcasts logits)
            with self._phase("backward"):
                self.ds.backward(loss)  # DeepSpeed scales by 1/accum and reduces at the boundary
            loss_sum += loss.detach().float()
            self._sample_grads()
            if k == accum - 1:
                own_norm = self._grad_norm_before_step()
            with self._phase("optimizer"):
                self.ds.step()  # steps the optimizer (and clips) only at the accumulation boundary
        self._grads_last = self._grads_peak
        norm = self.ds.get_global_grad_norm()
        if norm is None:
            norm = own_norm
        loss_sum /= accum
        stats = self.stats.with_votes(loss_sum.reshape(1))
        if self.world > 1:
            with self._phase("loss_sync"):
                dist.all_reduce(stats, op=dist.ReduceOp.SUM)
            stats[:1] /= self.world
        norm_t = norm.detach().float().reshape(1).to(stats.device) if torch.is_tensor(norm) else torch.tensor(
            [float("nan") if norm is None else float(norm)], device=stats.device)
        norm_value, loss_value = self.stats.read(torch.cat([norm_t, stats]))
        return loss_value, norm_value

    def eval_loss(self, batches: List[Batch]) -> float:
        loss_sum = torch.zeros((), device=self.device, dtype=torch.float32)
        with evaluating(self.ds):  # DeepSpeed's forward: ZeRO-3 gathers the partitions as in training
            for tokens, labels in batches:
                loss_sum += self.ds(tokens.to(self.device), labels.to(self.device)).float()
        return mean_over(loss_sum, len(batches), world=self.world)

    def _grad_norm_before_step(self) -> Optional[torch.Tensor]:
        """ZeRO-0 with fp32 steps the client optimizer directly, which records no norm: compute it
        from the (already all-reduced) gradients. ZeRO 1-3 and 16-bit optimizers record their own."""
        if self.stage > 0 or self.dtype != "fp32":
            return None
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        return torch.nn.utils.get_total_norm(grads) if grads else None

    # ---- memory accounting -------------------------------------------------------------------
    #
    # state_bytes() counts the model state this rank keeps in its TRAINING DEVICE's memory, as
    # recipes.gpt.plan.memory.model_state_bytes_per_rank models it. State DeepSpeed offloads to host
    # memory (zero.offload_optimizer / zero.offload_params) counts 0, also on a CPU-only run where
    # host and device memory are the same RAM. Each storage is counted once (views of one flat
    # buffer add up to the buffer; a tensor already counted as a parameter is not counted again).

    def _param_tensors(self) -> List[torch.Tensor]:
        """ZeRO 0-2: every module parameter (a full replica in the model dtype). ZeRO-3: each
        parameter's own partition, ``ds_tensor`` (ceil(numel / dp) elements), or nothing with
        zero.offload_params. Gathered parameters are not counted: neither those gathered for one
        module's forward/backward nor the small ones ZeRO-3 keeps gathered for good (``ds_persist``:
        fewer elements than stage3_param_persistence_threshold = 10 * hidden_size; biases and norms,
        ~1% of gpt_tiny, ~0.02% of a 7B model)."""
        params = list(self.module.parameters())
        if self.stage < 3:
            return params
        if self.offload_params:
            return []
        return [p.ds_tensor for p in params]

    def _grad_tensors(self) -> List[torch.Tensor]:
        """Gradient storage that outlives a backward: the module's ``.grad`` (ZeRO 0-1 accumulate
        full gradients there; ZeRO 2-3 free them bucket by bucket) plus the optimizer's partitioned
        gradients (ZeRO 1-2: ``averaged_gradients``, this rank's 1/dp; ZeRO-3:
        ``grad_partitions_flat_buffer``). Not counted: communication buckets (reduce_bucket_size)
        and, with zero.offload_optimizer, the gradient partitions DeepSpeed then keeps in host
        memory (ZeRO 2-3 then hold no gradient on the device between backwards)."""
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        opt = self.optimizer
        averaged = getattr(opt, "averaged_gradients", None) or {}
        for group in averaged.values() if isinstance(averaged, dict) else averaged:
            grads.extend(_tensors(group))
        flat = getattr(opt, "grad_partitions_flat_buffer", None)
        if torch.is_tensor(flat) and not self.offload_optimizer:  # offload allocates it in host memory
            grads.append(flat)
        return grads

    def _optimizer_tensors(self) -> List[torch.Tensor]:
        """Adam's exp_avg / exp_avg_sq (this rank's partition for ZeRO >= 1) plus the fp32 master
        weights where they are a separate copy of the parameters, which DeepSpeed keeps even in
        fp32: ZeRO 1-2 ``single_partition_of_fp32_groups``, ZeRO-3 ``fp32_partitioned_groups_flat``,
        ZeRO-0 in bf16 the unfused optimizer's ``fp32_groups`` (ZeRO-0 in fp32 steps the module's
        own parameters: Adam state only). With zero.offload_optimizer all of it lives in host
        memory: nothing."""
        if self.offload_optimizer:
            return []
        opt = self.optimizer
        inner = getattr(opt, "optimizer", opt)
        held = [v for state in inner.state.values() for v in state.values() if torch.is_tensor(v) and v.dim() > 0]
        for attr in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat", "fp32_groups"):
            for entry in getattr(opt, attr, None) or []:
                held.extend(_tensors(entry))
        return held

    def _sample_grads(self) -> None:
        self._grads_peak = max(self._grads_peak, _unique_bytes(self._grad_tensors()))

    def state_bytes(self) -> Dict[str, int]:
        """{"params", "grads", "optimizer"} bytes of model state in this rank's device memory (see
        _param_tensors, _grad_tensors, _optimizer_tensors for exactly which tensors). "grads" is the
        largest gradient footprint seen after any backward of the last step (0 before the first)."""
        param_tensors = self._param_tensors()
        seen = {t.untyped_storage().data_ptr() for t in param_tensors if t.numel() > 0}
        optimizer = [t for t in self._optimizer_tensors() if t.untyped_storage().data_ptr() not in seen]
        return {"params": _unique_bytes(param_tensors), "grads": self._grads_last,
                "optimizer": _unique_bytes(optimizer)}


def _tensors(entry: Any) -> List[torch.Tensor]:
    """A tensor, or a (possibly nested) list of them -> flat list of tensors."""
    if torch.is_tensor(entry):
        return [entry]
    if isinstance(entry, (list, tuple)):
        return [t for item in entry for t in _tensors(item)]
    return []


def _unique_bytes(tensors) -> int:
    """Bytes of memory the given tensors cover, overlaps counted once (the partition views of a
    flat buffer and the buffer itself add up to the buffer)."""
    spans = sorted(
        (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors if t is not None and t.numel() > 0
    )
    total, end = 0, 0
    for lo, hi in spans:
        if hi <= end:
            continue
        total += hi - max(lo, end)
        end = hi
    return total
