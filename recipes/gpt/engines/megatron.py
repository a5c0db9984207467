"""Megatron-style model parallelism: dp x pp x tp over a torch DeviceMesh.

- Layout: dp, tp, pp, ZeRO, sequence parallelism and the micro-batches per step are the run's
  ``ctx.layout``, resolved and checked against ``launcher.config.rules.RULES`` at launch (divisibility of
  heads / ffn / vocab / layers / seq_len, ZeRO <= 1, no offload, >= pp micro-batches with pp > 1).
- Mesh (``recipes.gpt.parallel.mesh``): the layout's placement, rank = dp_idx*(pp*tp) + pp_idx*tp +
  tp_idx; TP ranks adjacent (inside a node), PP next, DP outermost. Every rank records its place
  through ``ctx.rundir.write_mesh``.
- Tensor parallelism (``recipes.gpt.parallel.tensor_parallel``): column-parallel qkv (split by heads)
  and fc1, row-parallel proj and fc2, vocab-parallel embedding, head and cross entropy (logits never
  gathered), optional sequence parallelism.
- Pipeline parallelism (``recipes.gpt.parallel.pipeline``): blocks split evenly into stages,
  torch.distributed.pipelining ``PipelineStage`` + ``Schedule1F1B`` over the step's micro-batches;
  with tied embeddings the last stage holds a copy of the word embedding whose gradient is
  all-reduced with the first stage's (Megatron's embedding group).
- Data parallelism: gradients averaged over the dp group in buckets whose all-reduce starts during
  the backward, as soon as the last micro-batch has accumulated into them
  (``recipes.gpt.parallel.grad_buckets``), optionally ZeRO-1 (``ZeroRedundancyOptimizer`` over the
  dp group, its parameters as bucket views: one broadcast per owner after the step).
- Gradient clipping by the global norm: tp-sharded parameters summed over tp, replicated ones
  counted once, summed over stages; loss = mean over the global batch; both from one all-reduce.

Shard-first: the full model is built on the meta device only (no memory), each rank cuts its slices
from it and creates just those, initialised by ``recipes.gpt.init`` (per parameter row, seeded by
name): the sharded run starts from exactly the single-process initialisation, and a model far larger
than one process's memory can start.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from launcher.config.schema import enum_value
from launcher.config.seeding import dropout_seed
from launcher.training.checkpoint import load_on_one_rank
from launcher.training.engines.engine import (
    DTYPES,
    Batch,
    Engine,
    StepStats,
    adamw_kwargs,
    autocast_for,
    dtype_name,
    fused_kwargs,
    grad_reduce_dtype,
    on_cuda,
    optimizer_state_bytes,
    param_groups,
    tensor_bytes,
)
from recipes.common.memory import BuildMeter
from recipes.common.seeding import seed_everything
from recipes.gpt import rng
from recipes.gpt.engines.base import evaluating
from recipes.gpt.engines.megatron_universal import LayoutFreeState
from recipes.gpt.model import GPT, count_parameters
from recipes.gpt.parallel.grad_buckets import GradBuckets
from recipes.gpt.parallel.mesh import build_mesh, placement_record
from recipes.gpt.parallel.pipeline import GPTStage, activation_shape, build_schedule
from recipes.gpt.parallel.tensor_parallel import TPContext, materialize, name_parameters, vocab_parallel_cross_entropy

if TYPE_CHECKING:
    from recipes.gpt.schema import GPTRunConfig


def _all_reduce_coalesced(tensors: List[torch.Tensor], group: Any, scale: Optional[float] = None) -> None:
    """Sum ``tensors`` over ``group`` in one flat all-reduce (then multiply by ``scale``)."""
    if not tensors:
        return
    flat = _flatten_dense_tensors(tensors)
    dist.all_reduce(flat, group=group)
    if scale is not None:
        flat.mul_(scale)
    for t, synced in zip(tensors, _unflatten_dense_tensors(flat, tensors)):
        t.copy_(synced)


class LossScaler:
    """fp16 loss scaling: static (``precision.loss_scale > 0``) or dynamic (DeepSpeed/Megatron
    semantics: halve after ``hysteresis`` consecutive overflows, double after ``loss_scale_window``
    good steps, never below ``min_loss_scale``). Overflow is decided from the global grad norm, so
    every rank skips the same steps."""

    def __init__(self, prec: Any) -> None:
        self.static = float(prec.loss_scale) > 0
        self.scale = float(prec.loss_scale) if self.static else 2.0 ** int(prec.initial_scale_power)
        self.window = int(prec.loss_scale_window)
        self.hysteresis = max(1, int(prec.hysteresis))
        self.min_scale = float(prec.min_loss_scale)
        self._left = self.hysteresis
        self._good = 0

    def update(self, overflow: bool) -> None:
        if self.static:
            return
        if overflow:
            self._good = 0
            self._left -= 1
            if self._left <= 0:
                self.scale = max(self.scale / 2.0, self.min_scale)
                self._left = self.hysteresis
            return
        self._good += 1
        if self._good % self.window == 0:
            self.scale *= 2.0
            self._left = self.hysteresis

    def universal_values(self) -> Tuple[float, int, int]:
        """(scale, good steps since it last changed, overflows left): launcher.training.universal's names."""
        return self.scale, self._good % self.window, self._left

    def set_universal_values(self, scale: float, good: int, left: Optional[int]) -> None:
        """``left`` None: saved by a scaler without hysteresis (torch's): the count starts afresh."""
        self.scale, self._good = float(scale), int(good)
        self._left = int(left) if left is not None else self.hysteresis


class MegatronEngine(LayoutFreeState, Engine):
    def __init__(self, cfg: GPTRunConfig, ctx: Any) -> None:
        layout, m = ctx.layout, cfg.model
        self.tp, self.pp, self.zero = int(layout.tp), int(layout.pp), int(layout.zero)
        self.sequence_parallel = bool(layout.sequence_parallel)
        self.device = torch.device(ctx.device)
        self.rank = int(ctx.rank)

        self.mesh = build_mesh(layout, self.rank, self.device.type)
        self.dp, self.dp_rank = int(layout.dp), self.mesh.dp_rank
        ctx.rundir.write_mesh(self.rank, placement_record(
            self.mesh, {"local_rank": int(ctx.local_rank), "node_rank": int(ctx.node_rank)}))
        self.tp_ctx = TPContext(group=self.mesh.tp_group, rank=self.mesh.tp_rank, size=self.tp,
                                sequence_parallel=self.sequence_parallel)

        # shard-first: the full model exists only on the meta device (no memory); this rank's slices
        # are cut from it, then created and initialised with exactly their part of the full values
        self.recompute = enum_value(cfg.train.recompute)
        self.build_meter = BuildMeter(self.device).start()  # what the model's construction uses
        seed_everything(int(cfg.seed))
        with torch.device("meta"):
            full = GPT(cfg.model, recompute=self.recompute, seed=None)
        name_parameters(full)
        self.num_params = count_parameters(full)
        # every state_dict name of each full parameter (a tied one has two): universal/ holds them all
        self._aliases: Dict[str, List[str]] = {}
        for key, v in full.state_dict(keep_vars=True).items():
            self._aliases.setdefault(getattr(v, "global_name", key), []).append(key)
        self.autocast = autocast_for(cfg, self.device.type)
        act_dtype = DTYPES[dtype_name(cfg)]
        self.stage = GPTStage(full, self.tp_ctx, self.pp, self.mesh.pp_rank, self.recompute, self.autocast, act_dtype)
        del full
        materialize(self.stage, int(cfg.seed), int(m.num_layers), self.device)
        self.build_meter.stop()
        torch.manual_seed(dropout_seed(int(cfg.seed), self.dp_rank))  # dropout masks differ per dp replica
        self.rng_tracker = rng.attach(self.stage, rng.dropout_tracker(int(cfg.seed), *self.mesh.coords, self.device))
        self.stage.train()
        self.params: List[nn.Parameter] = [p for p in self.stage.parameters() if p.requires_grad]
        self.embedding_param = self.stage.embedding_param()

        # what each parameter contributes to the global squared grad norm (counted once per model)
        first_dp = self.dp_rank == 0
        self._norm_counted = []
        for p in self.params:
            counted = first_dp and not getattr(p, "shared_embedding_copy", False)
            if not getattr(p, "tensor_parallel", False):
                counted = counted and self.mesh.tp_rank == 0  # replicated over tp
            self._norm_counted.append(counted)
        self._sp_params = [p for p in self.params if getattr(p, "sequence_parallel", False)]

        # the data-parallel gradient average overlaps the backward, bucket by bucket (as DDP)
        reduce = grad_reduce_dtype(cfg)  # precision.grad_reduce_dtype
        self._dp_sync = (GradBuckets(self.params, self.mesh.dp_group, self.dp,
                                     reduce_dtype=None if reduce == torch.float32 else reduce) if self.dp > 1 else None)
        self.optimizer = self._build_optimizer(cfg.optim)
        self.grad_clip = float(cfg.optim.grad_clip)
        self.scaler: Optional[LossScaler] = LossScaler(cfg.precision) if dtype_name(cfg) == "fp16" else None

        self.micro_batch = int(layout.micro_batch_size)
        self.seq_len = int(m.seq_len)
        self.hidden = int(m.hidden_size)
        self._schedule = None
        self._schedule_mbs = 0
        self._last_grad_bytes = 0
        self.stats = StepStats(ctx, int(ctx.world_size))  # the stats all-reduce carries the stop votes

    # ------------------------------------------------------------------------------ setup

    def _build_optimizer(self, optim: Any) -> torch.optim.Optimizer:
        kw = {**adamw_kwargs(optim), **fused_kwargs(on_cuda(self.params))}  # fused on CUDA
        named = [(n, p) for n, p in self.stage.named_parameters() if p.requires_grad]
        groups = [g for g in param_groups(named, float(optim.weight_decay)) if g["params"]]
        if self.zero == 1:
            from torch.distributed.optim import ZeroRedundancyOptimizer

            # parameters as views of one flat bucket per owner: after step() one broadcast per rank of
            # the dp group, not one per parameter
            return ZeroRedundancyOptimizer(groups, optimizer_class=torch.optim.AdamW,
                                           process_group=self.mesh.dp_group, parameters_as_bucket_view=True, **kw)
        return torch.optim.AdamW(groups, **kw)

    # ------------------------------------------------------------------------------ step

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits, labels, self.tp_ctx, self.stage.vocab_start)

    def _pipe_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = self._loss(logits, labels)
        return loss * self.scaler.scale if self.scaler is not None else loss

    def _get_schedule(self, n_micro: int) -> Any:
        if self._schedule is None or self._schedule_mbs != n_micro:
            self._schedule = build_schedule(self.stage, self.mesh, n_micro, self.micro_batch, self.seq_len,
                                            self.hidden, self.device, self._pipe_loss)
            self._schedule_mbs = n_micro
        return self._schedule

    def _forward_backward(self, batches: List[Batch]) -> torch.Tensor:
        """Run every micro-batch forward and backward; return the sum over micro-batches of
        (micro-batch mean loss / accum) on the last stage (0 elsewhere)."""
        accum = len(batches)
        loss_sum = torch.zeros((), device=self.device, dtype=torch.float32)
        if self.pp == 1:
            scale = self.scaler.scale if self.scaler is not None else 1.0
            for tokens, labels in batches:
                tokens = tokens.to(self.device, non_blocking=True)
                labels = labels.to(self.device, non_blocking=True)
                loss = self._loss(self.stage(tokens), labels) / accum
                (loss * scale if scale != 1.0 else loss).backward()
                loss_sum += loss.detach()
            return loss_sum
        schedule = self._get_schedule(accum)
        if self.stage.is_first:
            tokens = torch.cat([t for t, _ in batches]).to(self.device, non_blocking=True)
            schedule.step(tokens, return_outputs=False)
        elif self.stage.is_last:
            labels = torch.cat([lab for _, lab in batches]).to(self.device, non_blocking=True)
            losses: List[torch.Tensor] = []
            schedule.step(target=labels, losses=losses, return_outputs=False)
            total = torch.stack([x.detach().float() for x in losses]).sum() / accum
            loss_sum = total / self.scaler.scale if self.scaler is not None else total
        else:
            schedule.step(return_outputs=False)
        return loss_sum

    def eval_loss(self, batches: List[Batch]) -> float:
        """Forward only: with pp > 1 each micro batch goes through the stages in turn (the activations
        sent point to point over the pp group, no schedule, no gradients); the last stage's tp rank 0
        holds the loss, and one all-reduce over the world gives every rank the mean."""
        loss_sum = torch.zeros((), device=self.device, dtype=torch.float32)
        group = self.mesh.pp_group
        with evaluating(self.stage):
            for tokens, labels in batches:
                if self.stage.is_first:
                    x = tokens.to(self.device)
                else:
                    x = torch.empty(activation_shape(tokens.shape[0], tokens.shape[1], self.hidden, self.tp_ctx),
                                    dtype=self.stage.act_dtype, device=self.device)
                    dist.recv(x, src=dist.get_global_rank(group, self.mesh.pp_rank - 1), group=group)
                out = self.stage(x)
                if self.stage.is_last:
                    loss_sum += self._loss(out, labels.to(self.device)).float()
                else:
                    dist.send(out.contiguous(), dst=dist.get_global_rank(group, self.mesh.pp_rank + 1), group=group)
        if not (self.stage.is_last and self.mesh.tp_rank == 0):
            loss_sum.zero_()  # counted once per dp replica
        dist.all_reduce(loss_sum)
        return float(loss_sum.item()) / (len(batches) * self.dp)

    def _reduce_grads(self) -> None:
        if self._dp_sync is not None:  # the data-parallel average: started during the backward
            self._dp_sync.finish()
        for p in self.params:  # a stage whose parameters got no gradient still joins the collectives
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if self.sequence_parallel:  # replicated params saw only their sequence chunk
            _all_reduce_coalesced([p.grad for p in self._sp_params], self.mesh.tp_group)
        if self.embedding_param is not None:  # tied word embedding: first stage + last-stage copy
            dist.all_reduce(self.embedding_param.grad, group=self.mesh.embedding_group)

    def train_step(self, batches: List[Batch], lr: float) -> Tuple[float, float]:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        if self._dp_sync is not None:  # the pipeline schedule scales the gradients by 1/micro-batches after
            self._dp_sync.start_step(len(batches), 1.0 / len(batches) if self.pp > 1 else 1.0)  # its backward
        with self._phase("forward_backward"):  # the pipeline schedule interleaves them (1F1B)
            loss_sum = self._forward_backward(batches)
        with self._phase("grad_sync"):
            self._reduce_grads()

        # one all-reduce over the world: [global mean loss, global squared grad norm]
        counted = [p.grad.detach() for p, c in zip(self.params, self._norm_counted) if c]
        sq = (torch.stack(torch._foreach_norm(counted)).float().pow(2).sum() if counted  # one fused kernel
              else torch.zeros((), device=self.device, dtype=torch.float32))
        owns_loss = self.stage.is_last and self.mesh.tp_rank == 0
        loss_part = loss_sum / self.dp if owns_loss else torch.zeros_like(loss_sum)
        stats = self.stats.with_votes(torch.stack([loss_part, sq]))
        with self._phase("loss_sync"):
            dist.all_reduce(stats)
        if self.scaler is None:  # clip on the device and step before the read: the step's one host wait
            with self._phase("optimizer"):
                self._clip(stats[1])
                self._step_optimizer()
        loss_value, sq_value = self.stats.read(stats)
        grad_norm = (math.sqrt(sq_value) if math.isfinite(sq_value)
                     else float("nan") if math.isnan(sq_value) else float("inf"))
        if self.scaler is None:
            return loss_value, grad_norm

        # fp16: whether the step overflowed is known on the host only after the read
        scale = self.scaler.scale
        overflow = not math.isfinite(grad_norm)
        self.scaler.update(overflow)  # an fp16 overflow skips the step on every rank
        with self._phase("optimizer"):
            if not overflow:
                grad_norm /= scale
                coef = 1.0 / scale
                if self.grad_clip > 0 and grad_norm > 0:
                    coef *= min(1.0, self.grad_clip / (grad_norm + 1e-6))  # as torch.nn.utils.clip_grad_norm_
                if coef != 1.0:
                    torch._foreach_mul_([p.grad for p in self.params], coef)
                self.optimizer.step()
            self._last_grad_bytes = tensor_bytes(p.grad for p in self.params)
            self.optimizer.zero_grad(set_to_none=True)
        return loss_value, grad_norm

    def _clip(self, sq: torch.Tensor) -> None:
        """Scale the gradients by min(1, grad_clip / (norm + 1e-6)) computed on the device from the
        all-reduced squared norm ``sq``, in float64 like the host's arithmetic (the same fp32 factor,
        so the same updates); a zero or NaN norm leaves them as they are."""
        if self.grad_clip <= 0:
            return
        norm = sq.double().sqrt()
        coef = torch.where(norm > 0, (self.grad_clip / (norm + 1e-6)).clamp(max=1.0), torch.ones_like(norm))
        torch._foreach_mul_([p.grad for p in self.params], coef.to(self.params[0].grad.dtype))

    def _step_optimizer(self) -> None:
        self.optimizer.step()
        self._last_grad_bytes = tensor_bytes(p.grad for p in self.params)
        self.optimizer.zero_grad(set_to_none=True)

    # ------------------------------------------------------------------------------ checkpoints
    #
    # Sharded by rank: data-parallel rank 0 of each (pp, tp) place writes that shard's parameters
    # (and the optimizer state with ZeRO-0); with ZeRO-1 every rank writes its optimizer partition.

    def _names(self) -> Tuple[str, str]:
        dp_idx, pp_idx, tp_idx = self.mesh.coords
        return f"model_pp{pp_idx}_tp{tp_idx}.pt", f"optim_pp{pp_idx}_tp{tp_idx}_dp{dp_idx}.pt"

    def optimizers(self) -> List[torch.optim.Optimizer]:
        return [self.optimizer]

    def checkpoint_files(self) -> Dict[str, Any]:
        shard, partition = self._names()
        files: Dict[str, Any] = {}
        if self.dp_rank == 0:
            files[shard] = {"model": self.stage.state_dict(),
                            "optimizer": self.optimizer.state_dict() if self.zero == 0 else None,
                            "scaler": dict(vars(self.scaler)) if self.scaler is not None else None}
        if self.zero == 1:
            files[partition] = self.optimizer.optim.state_dict()
        return files

    def load_checkpoint(self, path: Any) -> None:
        shard, partition = self._names()
        # the stage's shard, shared by its data-parallel replicas: read once per dp group (by its dp
        # rank 0, which wrote it) and broadcast, not read by every replica
        state = load_on_one_rank(path / shard, self.device, src=self.mesh.ranks["dp"][0], group=self.mesh.dp_group)
        self.stage.load_state_dict(state["model"])
        if self.zero == 1:
            self.optimizer.optim.load_state_dict(torch.load(path / partition, map_location=self.device,
                                                            weights_only=True))
        else:
            self.optimizer.load_state_dict(state["optimizer"])
        if self.scaler is not None:
            vars(self.scaler).update(state["scaler"])

    # ------------------------------------------------------------------------------ reporting

    def state_bytes(self) -> Dict[str, int]:
        opt = self.optimizer.optim if self.zero == 1 else self.optimizer
        return {
            "params": tensor_bytes(self.params),
            "grads": self._last_grad_bytes,
            "optimizer": optimizer_state_bytes(opt),
        }

    def describe(self) -> str:
        dp_idx, pp_idx, tp_idx = self.mesh.coords
        extra = " sp" if self.sequence_parallel else ""
        return (f"MegatronEngine(dp={self.dp} pp={self.pp} tp={self.tp}{extra} zero={self.zero} "
                f"layers {self.stage.layer_range[0]}..{self.stage.layer_range[1] - 1} on stage {pp_idx})")
