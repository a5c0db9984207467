"""Rule rows every training recipe of this package is held to (light: the login side imports it):
the global batch splitting into dp x micro batches, the warm-up within the run."""
from __future__ import annotations

from launcher.config.rules import RUN, SHAPE, Rule

BATCH_SPLITS = Rule(
    "train.global_batch_size", lambda f: f.per_step is not None and f.grad_accum is None,
    lambda f: (f"{f.global_batch_size} is not a multiple of dp*micro_batch_size = {f.derived_dp}*"
               f"{f.micro_batch_size} = {f.per_step}"),
    lambda f: (f"set train.global_batch_size to a multiple of {f.per_step} (e.g. "
               f"{max(f.per_step, f.global_batch_size // f.per_step * f.per_step)}) or change "
               "train.micro_batch_size"),
    SHAPE)

WARMUP_WITHIN_STEPS = Rule(
    "optim.warmup_steps", lambda f: f.warmup_steps > f.steps,
    lambda f: f"{f.warmup_steps} is outside [0, train.steps={f.steps}]", "lower optim.warmup_steps", RUN)
