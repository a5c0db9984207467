"""The GPT on the deepspeed engine (ZeRO stages 0-3, tp = pp = 1, optimizer / parameter offload): the
generic ``DeepSpeedEngine`` of ``launcher.training.engines`` (the DeepSpeed config from the run config
and the layout, the client AdamW or DeepSpeedCPUAdam, one ``train_step``, DeepSpeed's own checkpoints
and the universal state) with what is the GPT's own:

- the build: ZeRO 0-2 build the GPT whole as DDP does (``base.build_model``: same seed, same init);
  ZeRO-3 builds it already partitioned (``_build_partitioned``): no rank ever holds the whole model, and
  each rank's partitions hold exactly the single-process initial values (``recipes.gpt.init.init_flat``);
  the construction's memory measured (the plan's calibration);
- the evaluation's numerics (``base.mean_over``);
- the memory accounting of ``state_bytes`` as recipes.gpt.plan.memory models it (device memory only,
  each storage once, the largest gradient footprint of the step).

Which layouts this engine gets (tp = pp = 1; no fp16 at ZeRO-0, where DeepSpeed 0.19 never scales the
loss, deepspeedai/DeepSpeed#8393) is the launcher's rule table's business (``launcher.config.rules.RULES``).
"""
from __future__ import annotations

import contextlib
import gc
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from launcher.config.schema import enum_value
from launcher.config.seeding import dropout_seed
from launcher.training.engines import deepspeed as generic
from launcher.training.engines.contract import ModelContract
from launcher.training.engines.engine import Batch
from recipes.common.memory import BuildMeter
from recipes.common.seeding import seed_everything
from recipes.gpt.engines.base import build_model, evaluating, gpt_contract, mean_over
from recipes.gpt.init import init_flat
from recipes.gpt.model import GPT

if TYPE_CHECKING:
    from recipes.gpt.schema import GPTRunConfig

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


class DeepSpeedEngine(generic.DeepSpeedEngine):
    def __init__(self, cfg: GPTRunConfig, ctx: Any) -> None:
        self._grads_peak = 0
        self._grads_last = 0
        super().__init__(cfg, ctx, contract=gpt_contract(cfg))

    def hidden_size(self, cfg: GPTRunConfig, model_fn: Optional[Callable[[], nn.Module]]) -> Optional[int]:
        return None  # the GPT's config names it (build_ds_config reads cfg.model.hidden_size)

    def build(self, deepspeed: Any, cfg: GPTRunConfig, ctx: Any, model_fn: Optional[Callable[[], nn.Module]],
              contract: Optional[ModelContract]) -> Tuple[nn.Module, ModelContract, bool]:
        self.build_meter = BuildMeter(self.device).start()
        model = self._build_partitioned(deepspeed, cfg) if self.stage == 3 else build_model(cfg, self.dp_rank)
        self.build_meter.stop()
        return model, contract, self.stage == 3

    def _build_partitioned(self, deepspeed: Any, cfg: GPTRunConfig) -> GPT:
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

    def eval_loss(self, batches: List[Batch]) -> float:
        loss_sum = torch.zeros((), device=self.device, dtype=torch.float32)
        with evaluating(self.ds):  # DeepSpeed's forward: ZeRO-3 gathers the partitions as in training
            for tokens, labels in batches:
                loss_sum += self.ds(tokens.to(self.device), labels.to(self.device)).float()
        return mean_over(loss_sum, len(batches), world=self.world)

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
            grads.extend(generic.tensors_of(group))
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
                held.extend(generic.tensors_of(entry))
        return held

    def _step_begins(self) -> None:
        self._grads_peak = 0

    def _backward_ends(self) -> None:
        self._grads_peak = max(self._grads_peak, _unique_bytes(self._grad_tensors()))
        self._grads_last = self._grads_peak

    def state_bytes(self) -> Dict[str, int]:
        """{"params", "grads", "optimizer"} bytes of model state in this rank's device memory (see
        _param_tensors, _grad_tensors, _optimizer_tensors for exactly which tensors). "grads" is the
        largest gradient footprint seen after any backward of the last step (0 before the first)."""
        param_tensors = self._param_tensors()
        seen = {t.untyped_storage().data_ptr() for t in param_tensors if t.numel() > 0}
        optimizer = [t for t in self._optimizer_tensors() if t.untyped_storage().data_ptr() not in seen]
        return {"params": _unique_bytes(param_tensors), "grads": self._grads_last,
                "optimizer": _unique_bytes(optimizer)}


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
