"""GPT training recipe, data parallel: ``main(cfg, ctx) -> summary dict``.

The launcher runtime has already initialised torch.distributed (gloo on CPU, nccl on GPU)
when ``main`` runs; every rank is a data-parallel replica (tp = pp = 1 in this recipe).
"""
from __future__ import annotations

import contextlib
import math
import time
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
from torch import nn

from recipes.common.data import grad_accum_steps, micro_batches
from recipes.common.seeding import derive_seed, seed_everything
from recipes.gpt.model import GPT, count_parameters

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _str(value: Any) -> str:
    """Enum or str -> its plain string value."""
    return str(getattr(value, "value", value))


def lr_at(step: int, *, lr: float, min_lr_ratio: float, warmup_steps: int, total_steps: int) -> float:
    """Learning rate at 1-based ``step``: linear warmup to ``lr`` over ``warmup_steps``,
    then cosine decay reaching ``lr * min_lr_ratio`` at ``total_steps``."""
    min_lr = lr * min_lr_ratio
    if warmup_steps > 0 and step <= warmup_steps:
        return lr * step / warmup_steps
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, max(0.0, (step - warmup_steps) / decay_steps))
    return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_optimizer(model: nn.Module, optim: Any) -> torch.optim.AdamW:
    """AdamW; no weight decay on biases and norm weights (every parameter with ndim < 2)."""
    name = _str(getattr(optim, "name", "adamw")).lower()
    if name != "adamw":
        raise ValueError(f"optim.name={name!r} is not supported by recipes.gpt (only 'adamw')")
    decay, no_decay = [], []
    for param in model.parameters():  # tied weights appear once
        if param.requires_grad:
            (decay if param.ndim >= 2 else no_decay).append(param)
    groups = [
        {"params": decay, "weight_decay": float(optim.weight_decay)},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(
        groups,
        lr=float(optim.lr),
        betas=(float(optim.beta1), float(optim.beta2)),
        eps=float(optim.eps),
    )


def _grad_scaler(precision: Any, device_type: str) -> torch.amp.GradScaler:
    static = float(precision.loss_scale) > 0
    return torch.amp.GradScaler(
        device_type,
        init_scale=float(precision.loss_scale) if static else 2.0 ** int(precision.initial_scale_power),
        growth_interval=int(precision.loss_scale_window),
    )


def main(cfg: Any, ctx: Any) -> Dict[str, Any]:
    """Train the GPT of ``cfg.model`` for ``cfg.train.steps`` steps; return a summary."""
    tp, pp = int(cfg.parallelism.tp), int(cfg.parallelism.pp)
    if tp * pp != 1:
        raise ValueError(
            f"parallelism.tp * parallelism.pp must be 1 for recipes.gpt.train "
            f"(data parallel only), got tp={tp}, pp={pp}"
        )
    world, rank = int(ctx.world_size), int(ctx.rank)
    dist_on = dist.is_available() and dist.is_initialized()
    if world > 1 and not dist_on:
        raise RuntimeError(f"world_size={world} but torch.distributed is not initialised")
    if dist_on and dist.get_world_size() != world:
        raise RuntimeError(
            f"ctx.world_size={world} but the process group has {dist.get_world_size()} ranks"
        )
    dp = world
    if cfg.parallelism.dp is not None and int(cfg.parallelism.dp) != dp:
        raise ValueError(f"parallelism.dp={cfg.parallelism.dp} but the job has {dp} ranks (tp=pp=1)")
    gbs, mbs = int(cfg.train.global_batch_size), int(cfg.train.micro_batch_size)
    accum = grad_accum_steps(gbs, mbs, dp)
    assert accum * dp * mbs == gbs
    steps = int(cfg.train.steps)
    seq_len, vocab = int(cfg.model.seq_len), int(cfg.model.vocab_size)

    dtype_name = _str(cfg.precision.dtype)
    if dtype_name not in _DTYPES:
        raise ValueError(f"precision.dtype must be one of {sorted(_DTYPES)}, got {dtype_name!r}")
    device = torch.device(ctx.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    device_type = device.type

    # Same init on every rank: seed before construction.
    seed_everything(int(cfg.seed))
    model = GPT(cfg.model, recompute=_str(cfg.train.recompute)).to(device)
    n_params = count_parameters(model)
    # Dropout masks should differ between replicas: reseed per rank after init.
    torch.manual_seed(derive_seed(int(cfg.seed), "dropout", rank))
    model.train()
    ddp: Optional[nn.parallel.DistributedDataParallel] = None
    if world > 1:
        ddp = nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device_type == "cuda" else None
        )
    runner: nn.Module = ddp if ddp is not None else model

    optimizer = build_optimizer(model, cfg.optim)
    params: List[nn.Parameter] = [p for g in optimizer.param_groups for p in g["params"]]
    grad_clip = float(cfg.optim.grad_clip)

    amp_dtype = _DTYPES[dtype_name]
    if amp_dtype is torch.float32:
        autocast = contextlib.nullcontext
    else:
        if not torch.amp.is_autocast_available(device_type):
            raise ValueError(f"precision.dtype={dtype_name} needs autocast, unavailable on {device_type}")

        def autocast():
            return torch.autocast(device_type=device_type, dtype=amp_dtype)

    scaler = _grad_scaler(cfg.precision, device_type) if dtype_name == "fp16" else None
    static_scale = float(cfg.precision.loss_scale) if scaler is not None else 0.0
    min_scale = float(cfg.precision.min_loss_scale)

    data_seed = cfg.data.seed if cfg.data.seed is not None else derive_seed(int(cfg.seed), "data")
    data_seed, branching = int(data_seed), int(cfg.data.branching)
    fail_at = cfg.train.fail_at_step
    fail_rank = int(cfg.train.fail_rank)
    log_interval = int(cfg.train.log_interval)
    sync_cuda = device_type == "cuda"

    if ctx.is_main:
        print(
            f"[gpt] params={n_params:,} world={world} dp={dp} grad_accum={accum} "
            f"gbs={gbs} mbs={mbs} seq={seq_len} dtype={dtype_name} "
            f"recompute={model.recompute} device={device}",
            flush=True,
        )

    losses: List[float] = []
    tokens_per_s: List[float] = []
    for step in range(1, steps + 1):
        if fail_at is not None and step == int(fail_at) and rank == fail_rank:
            raise RuntimeError(f"injected failure at step {step} on rank {rank}")
        t0 = time.perf_counter()
        lr = lr_at(
            step,
            lr=float(cfg.optim.lr),
            min_lr_ratio=float(cfg.optim.min_lr_ratio),
            warmup_steps=int(cfg.optim.warmup_steps),
            total_steps=steps,
        )
        for group in optimizer.param_groups:
            group["lr"] = lr

        batches = micro_batches(
            data_seed, step - 1, gbs, mbs, dp, rank, vocab, seq_len, branching
        )
        loss_sum = torch.zeros((), device=device, dtype=torch.float32)
        for k, (tokens, labels) in enumerate(batches):
            tokens = tokens.to(device, non_blocking=True)
            labels = labels.to(device, non_blocking=True)
            sync = ddp is None or k == accum - 1
            with contextlib.nullcontext() if sync else ddp.no_sync():
                with autocast():
                    loss = runner(tokens, labels=labels) / accum
                (scaler.scale(loss) if scaler is not None else loss).backward()
            loss_sum += loss.detach()

        if scaler is not None:
            scaler.unscale_(optimizer)
        if grad_clip > 0:
            grad_norm = torch.nn.utils.clip_grad_norm_(params, grad_clip)
        else:
            grad_norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update(static_scale if static_scale > 0 else None)
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        if world > 1:
            dist.all_reduce(loss_sum, op=dist.ReduceOp.SUM)
            loss_sum /= world
        loss_value, norm_value = torch.stack([loss_sum, grad_norm.float()]).tolist()
        if scaler is not None and static_scale <= 0 and scaler.get_scale() < min_scale:
            scaler.update(min_scale)
        if sync_cuda:
            torch.cuda.synchronize(device)
        step_time = time.perf_counter() - t0

        tps = gbs * seq_len / step_time
        losses.append(loss_value)
        tokens_per_s.append(tps)
        ctx.log_metrics(
            step,
            loss=loss_value,
            tokens_per_s=tps,
            samples_per_s=gbs / step_time,
            step_time_s=step_time,
            lr=lr,
            grad_norm=norm_value,
        )
        if ctx.is_main and log_interval > 0 and step % log_interval == 0:
            print(
                f"[gpt] step {step}/{steps} loss {loss_value:.4f} lr {lr:.3e} "
                f"grad_norm {norm_value:.3f} {tps:,.0f} tok/s {step_time * 1e3:.1f} ms",
                flush=True,
            )

    timed = tokens_per_s[2:] if len(tokens_per_s) > 2 else tokens_per_s
    return {
        "steps": steps,
        "final_loss": losses[-1] if losses else None,
        "first_loss": losses[0] if losses else None,
        "mean_tokens_per_s": sum(timed) / len(timed) if timed else None,
        "params": n_params,
        "world_size": world,
        "grad_accum": accum,
    }
