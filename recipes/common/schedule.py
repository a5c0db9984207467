"""The learning-rate schedule every recipe of this package shares (pure)."""
from __future__ import annotations

import math


def lr_at(step: int, *, lr: float, min_lr_ratio: float, warmup_steps: int, total_steps: int) -> float:
    """Learning rate at 1-based ``step``: linear warmup to ``lr`` over ``warmup_steps``,
    then cosine decay reaching ``lr * min_lr_ratio`` at ``total_steps``."""
    min_lr = lr * min_lr_ratio
    if warmup_steps > 0 and step <= warmup_steps:
        return lr * step / warmup_steps
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, max(0.0, (step - warmup_steps) / decay_steps))
    return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
