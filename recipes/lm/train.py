"""The lm recipe: any ``nn.Module`` trained as a causal LM, ``main(cfg, ctx) -> summary dict``.

``model._target_`` and its own arguments (the ``model`` group, recipes/lm/schema.py) build the module
with hydra.utils.instantiate inside the engine's ``model_fn``; the engine the layout names
(launcher.training.engines: ddp, fsdp, deepspeed) decides its device, initialisation and sharding and
computes each optimizer step. This loop is the GPT's (recipes/gpt/train.py): the data of each step
through recipes.common.data.train_batches (shape ``lm.seq_len``, ``lm.vocab_size``), the lr
schedule, fault injection, the metrics, checkpoints (launcher.training.Checkpointer) the eval loss on the
data's validation split (``data.eval_every`` > 0) and the sample ids of each step (``data.log_samples``).
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable, Dict, List

import torch
from omegaconf import OmegaConf

from launcher.config.schema import warmup_steps
from launcher.training import Checkpointer, StepLoop
from launcher.training.engines import build_engine
from recipes.common.data import Prefetch, SampleLog, eval_batches, train_batches
from recipes.common.faults import inject_fault
from recipes.common.memory import device_peak_bytes, host_rss_bytes
from recipes.common.phases import Phases, step_row
from recipes.common.schedule import lr_at
from recipes.lm.schema import NOT_ARGUMENTS

if TYPE_CHECKING:
    from recipes.lm.schema import LMRunConfig

TAG = "lm"


def model_fn(model_cfg: Any) -> Callable[[], torch.nn.Module]:
    """The module ``model._target_`` names, built with its own arguments (``model.name`` is the run's,
    not the module's); plain containers, so a factory gets dicts and lists, never OmegaConf nodes."""
    spec = {k: v for k, v in OmegaConf.to_container(model_cfg, resolve=True).items() if k not in NOT_ARGUMENTS}

    def build() -> torch.nn.Module:
        from hydra.utils import instantiate  # Hydra's own: _target_, _partial_, nested _target_s

        return instantiate(spec, _convert_="all")

    return build


def main(cfg: LMRunConfig, ctx: Any) -> Dict[str, Any]:
    """Train ``cfg.model`` for ``cfg.train.steps`` steps on the engine of ``ctx.layout``; return a summary."""
    layout = ctx.layout
    engine = build_engine(cfg, ctx, model_fn(cfg.model))
    dp_rank = engine.dp_rank
    gbs, steps, log_interval = layout.global_batch_size, int(cfg.train.steps), int(cfg.train.log_interval)
    seq_len, vocab = int(cfg.lm.seq_len), int(cfg.lm.vocab_size)
    device = torch.device(ctx.device)
    phases = engine.phases = Phases(device)
    loop = StepLoop(cfg, ctx, Checkpointer(cfg, ctx, engine))
    start = loop.start
    if ctx.is_main:
        if start or ctx.attempt > 1:
            print(f"[{TAG}] attempt {ctx.attempt}: resumed from the checkpoint after step {start}" if start else
                  f"[{TAG}] attempt {ctx.attempt}: no checkpoint yet, starting again from step 1", flush=True)
        print(f"[{TAG}] model={cfg.model._target_} engine={engine.describe()} params={engine.num_params:,} "
              f"world={ctx.world_size} dp={engine.dp} grad_accum={layout.grad_accum} gbs={gbs} "
              f"mbs={layout.micro_batch_size} seq={seq_len} device={device}", flush=True)

    tokens_per_s: List[float] = []
    data = train_batches(cfg, layout, dp_rank, seq_len=seq_len, vocab_size=vocab)
    prefetch = Prefetch(data, last=steps, pin=device.type == "cuda")
    samples = SampleLog(ctx, start, bool(cfg.data.log_samples))
    every = int(cfg.data.eval_every)  # the validation micro batches: the same samples at every evaluation
    val = eval_batches(cfg, layout, dp_rank, seq_len=seq_len, vocab_size=vocab) if every > 0 else None
    try:
        for step in loop:  # saves when due; on a stop signal saves, then raises ctx.interrupted
            inject_fault(cfg, ctx, step, tag=TAG)
            t0 = time.perf_counter()
            lr = lr_at(step, lr=float(cfg.optim.lr), min_lr_ratio=float(cfg.optim.min_lr_ratio),
                       warmup_steps=warmup_steps(cfg), total_steps=steps)
            with phases("data"):
                batches = prefetch.get(step)
            samples.write(step, data.sample_ids)
            loss, grad_norm = engine.train_step(batches, lr)
            # no synchronize: train_step returns after its one host read, which waits for the step's
            # device work (work an engine queues after it is counted in the next step's time)
            step_time = time.perf_counter() - t0
            tokens_per_s.append(gbs * seq_len / step_time)
            row = dict(loss=loss, tokens_per_s=tokens_per_s[-1], samples_per_s=gbs / step_time,
                       step_time_s=step_time, lr=lr, grad_norm=grad_norm, **step_row(phases.take(), step_time))
            if val is not None and (step % every == 0 or step == steps):  # after the step's timing
                row["eval_loss"] = engine.eval_loss(val)
            mem = device_peak_bytes(device)
            if mem is not None:
                row["peak_memory_bytes"] = mem
            loop.log(**row, host_rss_bytes=host_rss_bytes())
            if ctx.is_main and log_interval > 0 and step % log_interval == 0:
                print(f"[{TAG}] step {step}/{steps} loss {loss:.4f} lr {lr:.3e} grad_norm {grad_norm:.3f} "
                      f"{tokens_per_s[-1]:,.0f} tok/s {step_time * 1e3:.1f} ms"
                      + (f" eval_loss {row['eval_loss']:.4f}" if "eval_loss" in row else ""), flush=True)
    finally:
        prefetch.close()
        loop.close()

    losses = loop.values("loss")
    timed = tokens_per_s[2:] if len(tokens_per_s) > 2 else tokens_per_s
    evals = loop.values("eval_loss")
    return {
        "steps": steps,
        "resumed_from": start,
        "final_loss": losses[-1] if losses else None,
        "first_loss": losses[0] if losses else None,
        "final_eval_loss": evals[-1] if evals else None,
        "mean_tokens_per_s": sum(timed) / len(timed) if timed else None,
        "params": engine.num_params,
        "world_size": int(ctx.world_size),
        "dp": engine.dp,
        "grad_accum": layout.grad_accum,
        "state_bytes": engine.state_bytes(),
    }
