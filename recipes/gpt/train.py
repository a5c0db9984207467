"""GPT training recipe: ``main(cfg, ctx) -> summary dict``.

The launcher runtime has already initialised torch.distributed (gloo on CPU, nccl on GPU)
when ``main`` runs. The run's layout (``ctx.layout``, archived at launch) fixes the engine (ddp,
deepspeed, megatron), dp/tp/pp, the micro batch and the gradient accumulation; the engine computes
each optimizer step; this loop owns everything that must not differ between engines: the data each
step sees, the learning-rate schedule, fault injection and the metrics.
"""
from __future__ import annotations

import math
import time
from typing import Any, Dict, List

import torch

from launcher.plan.flops import step_flops as model_step_flops
from launcher.plan.params import ModelSpec
from launcher.schema import warmup_steps
from launcher.seeding import data_seed as run_data_seed
from recipes.common.data import micro_batches
from recipes.common.metrics import MetricsSink, peak_memory_bytes
from recipes.gpt.engines import build_engine
from recipes.gpt.engines.base import dtype_name


def lr_at(step: int, *, lr: float, min_lr_ratio: float, warmup_steps: int, total_steps: int) -> float:
    """Learning rate at 1-based ``step``: linear warmup to ``lr`` over ``warmup_steps``,
    then cosine decay reaching ``lr * min_lr_ratio`` at ``total_steps``."""
    min_lr = lr * min_lr_ratio
    if warmup_steps > 0 and step <= warmup_steps:
        return lr * step / warmup_steps
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, max(0.0, (step - warmup_steps) / decay_steps))
    return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


def main(cfg: Any, ctx: Any) -> Dict[str, Any]:
    """Train the GPT of ``cfg.model`` for ``cfg.train.steps`` steps; return a summary."""
    layout = ctx.layout
    engine = build_engine(cfg, ctx)
    dp, dp_rank = engine.dp, engine.dp_rank
    gbs, mbs, accum = layout.global_batch_size, layout.micro_batch_size, layout.grad_accum
    steps = int(cfg.train.steps)
    seq_len, vocab = int(cfg.model.seq_len), int(cfg.model.vocab_size)
    data_seed = run_data_seed(int(cfg.seed), cfg.data.seed)
    branching = int(cfg.data.branching)
    fail_at, fail_rank = cfg.train.fail_at_step, int(cfg.train.fail_rank)
    log_interval = int(cfg.train.log_interval)
    device = torch.device(ctx.device)
    sync_cuda = device.type == "cuda"
    # model FLOPs per step, the planner's count (recomputation not counted: MFU measures useful work)
    step_flops = model_step_flops(ModelSpec.from_cfg(cfg.model), gbs, recompute="none")
    peak = float(cfg.cluster.gpu.peak_tflops) * 1e12 * int(ctx.world_size)
    sink = MetricsSink(cfg, ctx)

    if ctx.is_main:
        print(
            f"[gpt] engine={engine.describe()} params={engine.num_params:,} world={ctx.world_size} dp={dp} "
            f"grad_accum={accum} gbs={gbs} mbs={mbs} seq={seq_len} dtype={dtype_name(cfg)} "
            f"recompute={cfg.train.recompute} device={device}",
            flush=True,
        )

    losses: List[float] = []
    tokens_per_s: List[float] = []
    try:
        for step in range(1, steps + 1):
            if fail_at is not None and step == int(fail_at) and ctx.rank == fail_rank:
                raise RuntimeError(f"injected failure at step {step} on rank {ctx.rank}")
            t0 = time.perf_counter()
            lr = lr_at(step, lr=float(cfg.optim.lr), min_lr_ratio=float(cfg.optim.min_lr_ratio),
                       warmup_steps=warmup_steps(cfg), total_steps=steps)
            batches = micro_batches(data_seed, step - 1, layout, dp_rank, vocab, seq_len, branching)
            loss, grad_norm = engine.train_step(batches, lr)
            if sync_cuda:
                torch.cuda.synchronize(device)
            step_time = time.perf_counter() - t0
            tps = gbs * seq_len / step_time
            losses.append(loss)
            tokens_per_s.append(tps)
            row = dict(loss=loss, tokens_per_s=tps, samples_per_s=gbs / step_time, step_time_s=step_time,
                       lr=lr, grad_norm=grad_norm, tflops=step_flops / step_time / 1e12 / int(ctx.world_size))
            if peak > 0:
                row["mfu"] = step_flops / step_time / peak
            mem = peak_memory_bytes(device)
            if mem is not None:
                row["peak_memory_bytes"] = mem
            sink.log(step, row)
            if ctx.is_main and log_interval > 0 and step % log_interval == 0:
                print(f"[gpt] step {step}/{steps} loss {loss:.4f} lr {lr:.3e} grad_norm {grad_norm:.3f} "
                      f"{tps:,.0f} tok/s {step_time * 1e3:.1f} ms", flush=True)
    finally:
        sink.close()

    # what this rank holds, for the planner's exactness check (launcher.plan.memory)
    ctx.rundir.write_state(ctx.rank, {"rank": ctx.rank, "pp_stage": layout.coords(ctx.rank)[1], "dp_rank": dp_rank,
                                      **engine.state_bytes()})
    timed = tokens_per_s[2:] if len(tokens_per_s) > 2 else tokens_per_s
    return {
        "steps": steps,
        "final_loss": losses[-1] if losses else None,
        "first_loss": losses[0] if losses else None,
        "mean_tokens_per_s": sum(timed) / len(timed) if timed else None,
        "params": engine.num_params,
        "world_size": int(ctx.world_size),
        "dp": dp,
        "grad_accum": accum,
        "state_bytes": engine.state_bytes(),
    }
