"""GPT training recipe: ``main(cfg, ctx) -> summary dict``.

The launcher runtime has already initialised torch.distributed (gloo on CPU, nccl on GPU)
when ``main`` runs. The run's layout (``ctx.layout``, archived at launch) fixes the engine (ddp,
deepspeed, megatron), dp/tp/pp, the micro batch and the gradient accumulation; the engine computes
each optimizer step; this loop owns everything that must not differ between engines: the data each
step sees, the learning-rate schedule, fault injection and the metrics.
"""
from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING, Any, Dict, List, Optional

import torch

from launcher.config.schema import warmup_steps
from launcher.training import Checkpointer, StepLoop
from launcher.training.engines.engine import dtype_name
from recipes.common.activations import ActivationMeter
from recipes.common.data import Prefetch, SampleLog, eval_batches, train_batches
from recipes.common.faults import inject_fault
from recipes.common.memory import StepPeak, device_peak_bytes, host_rss_bytes
from recipes.common.phases import Phases, step_row
from recipes.common.schedule import lr_at
from recipes.gpt.engines import build_engine
from recipes.gpt.plan.flops import step_flops as model_step_flops
from recipes.gpt.schema import ModelSpec

if TYPE_CHECKING:
    from recipes.gpt.schema import GPTRunConfig


def main(cfg: GPTRunConfig, ctx: Any) -> Dict[str, Any]:
    """Train the GPT of ``cfg.model`` for ``cfg.train.steps`` steps; return a summary."""
    layout = ctx.layout
    engine = build_engine(cfg, ctx)
    dp, dp_rank = engine.dp, engine.dp_rank
    gbs, mbs, accum = layout.global_batch_size, layout.micro_batch_size, layout.grad_accum
    steps = int(cfg.train.steps)
    seq_len, vocab = int(cfg.model.seq_len), int(cfg.model.vocab_size)
    log_interval = int(cfg.train.log_interval)
    device = torch.device(ctx.device)
    # model FLOPs per step, the planner's count (recomputation not counted: MFU measures useful work)
    step_flops = model_step_flops(ModelSpec.from_cfg(cfg.model), gbs, recompute="none")
    peak = float(cfg.cluster.gpu.peak_tflops) * 1e12 * int(ctx.world_size)
    phases = engine.phases = Phases(device)  # the step's time by phase, into each metrics row
    loop = StepLoop(cfg, ctx, Checkpointer(cfg, ctx, engine))  # resumed: loop.start (0 on a fresh start)
    start = loop.start
    if ctx.is_main:
        if start or ctx.attempt > 1:
            print(f"[gpt] attempt {ctx.attempt}: resumed from the checkpoint after step {start}" if start else
                  f"[gpt] attempt {ctx.attempt}: no checkpoint yet, starting again from step 1", flush=True)
        print(
            f"[gpt] engine={engine.describe()} params={engine.num_params:,} world={ctx.world_size} dp={dp} "
            f"grad_accum={accum} gbs={gbs} mbs={mbs} seq={seq_len} dtype={dtype_name(cfg)} "
            f"recompute={cfg.train.recompute} device={device}",
            flush=True,
        )

    tokens_per_s: List[float] = []
    activation_bytes: Optional[int] = None  # measured in this attempt's first step (ActivationMeter)
    step_peak = StepPeak(device).start()  # host (and CUDA) peak over this attempt's steps
    data = train_batches(cfg, layout, dp_rank, seq_len=seq_len, vocab_size=vocab)
    prefetch = Prefetch(data, last=steps, pin=device.type == "cuda")
    samples = SampleLog(ctx, start, bool(cfg.data.log_samples))
    eval_every = int(cfg.data.eval_every)
    val = eval_batches(cfg, layout, dp_rank, seq_len=seq_len, vocab_size=vocab) if eval_every > 0 else None
    try:
        for step in loop:  # saves when due; on a stop signal saves, then raises ctx.interrupted
            inject_fault(cfg, ctx, step, tag="gpt")
            t0 = time.perf_counter()
            lr = lr_at(step, lr=float(cfg.optim.lr), min_lr_ratio=float(cfg.optim.min_lr_ratio),
                       warmup_steps=warmup_steps(cfg), total_steps=steps)
            with phases("data"):  # waiting for the batches made while the last step trained
                batches = prefetch.get(step)
            samples.write(step, data.sample_ids)
            # the first step of an attempt also measures the peak of live saved-for-backward bytes
            meter = ActivationMeter() if step == start + 1 else None
            with meter if meter is not None else contextlib.nullcontext():
                loss, grad_norm = engine.train_step(batches, lr)
            # no synchronize: train_step returns after its one host read, which waits for the step's
            # device work (work an engine queues after it is counted in the next step's time)
            step_time = time.perf_counter() - t0
            tps = gbs * seq_len / step_time
            tokens_per_s.append(tps)
            row = dict(loss=loss, tokens_per_s=tps, samples_per_s=gbs / step_time, step_time_s=step_time,
                       lr=lr, grad_norm=grad_norm, tflops=step_flops / step_time / 1e12 / int(ctx.world_size))
            if peak > 0:
                row["mfu"] = step_flops / step_time / peak
            row.update(step_row(phases.take(), step_time))
            if val is not None and (step % eval_every == 0 or step == steps):  # after the step's timing
                row["eval_loss"] = engine.eval_loss(val)
            if meter is not None:
                activation_bytes = row["activation_bytes"] = meter.peak_bytes
            mem = device_peak_bytes(device)
            if mem is not None:
                row["peak_memory_bytes"] = mem
            loop.log(**row, host_rss_bytes=host_rss_bytes())
            if ctx.is_main and log_interval > 0 and step % log_interval == 0:
                print(f"[gpt] step {step}/{steps} loss {loss:.4f} lr {lr:.3e} grad_norm {grad_norm:.3f} "
                      f"{tps:,.0f} tok/s {step_time * 1e3:.1f} ms", flush=True)
            if ctx.is_main and "eval_loss" in row:
                print(f"[gpt] step {step}/{steps} eval_loss {row['eval_loss']:.4f}", flush=True)
    finally:
        prefetch.close()
        loop.close()

    # what this rank holds during a step, for the planner's exactness check (recipes.gpt.plan.memory)
    # and its calibration (activation_bytes: the peak of live saved-for-backward bytes in this
    # attempt's first step); an attempt that resumed at the last step ran none (no gradients): the
    # earlier record stands. With it, the memory the model's construction used (recipes.common.memory)
    # and the peak over the steps
    if start < steps:
        built = engine.build_meter.record() if engine.build_meter is not None else {}
        ctx.rundir.write_state(ctx.rank, {"rank": ctx.rank, "pp_stage": layout.coords(ctx.rank)[1],
                                          "dp_rank": dp_rank, **engine.state_bytes(),
                                          "activation_bytes": activation_bytes, **built, **step_peak.record()})
    losses = loop.values("loss")
    evals = loop.values("eval_loss")
    timed = tokens_per_s[2:] if len(tokens_per_s) > 2 else tokens_per_s
    return {
        "steps": steps,
        "resumed_from": start,
        "final_loss": losses[-1] if losses else None,
        "final_eval_loss": evals[-1] if evals else None,
        "first_loss": losses[0] if losses else None,
        "mean_tokens_per_s": sum(timed) / len(timed) if timed else None,
        "params": engine.num_params,
        "world_size": int(ctx.world_size),
        "dp": dp,
        "grad_accum": accum,
        "state_bytes": engine.state_bytes(),
        # seconds this attempt's loop waited on its saves (the final one included): what a save costs
        "checkpoint_blocked_s": round(loop.checkpoint.blocked_s, 3) if loop.checkpoint is not None else None,
    }
