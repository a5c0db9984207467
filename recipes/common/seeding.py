"""Seeding the RNGs of a rank (the torch part). The seeds themselves (derive_seed, data_seed,
dropout_seed, seed_plan) are pure and live in ``launcher.config.seeding``."""
from __future__ import annotations

import random


def seed_everything(seed: int) -> None:
    """Seed python ``random``, numpy (when importable) and torch (CPU and every CUDA device)."""
    seed = int(seed)
    random.seed(seed)
    try:
        import numpy as np
    except ImportError:  # numpy is optional
        pass
    else:
        np.random.seed(seed & 0xFFFFFFFF)
    import torch

    torch.manual_seed(seed)  # also seeds every CUDA device (lazily)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)
