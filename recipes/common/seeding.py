"""Reproducible seeding: one run seed, stable named sub-seeds."""
from __future__ import annotations

import hashlib
import random

_SEED_MASK = 0x7FFFFFFF  # 31 bits: valid for python, numpy and torch alike


def derive_seed(base_seed: int, *names: object) -> int:
    """A stable 31-bit seed derived from ``base_seed`` and ``names``.

    Uses sha256 (not Python's ``hash()``, which is salted per process), so the same
    inputs give the same seed on every rank, node and run.
    """
    key = "\x1f".join([str(int(base_seed))] + [str(n) for n in names])
    digest = hashlib.sha256(key.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") & _SEED_MASK


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
