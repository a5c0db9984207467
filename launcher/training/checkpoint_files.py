"""What each rank's part of a checkpoint holds (launcher.training.checkpoint): the file names, and
every RNG state of a process (torch, CUDA, Python, NumPy and an engine's RNG tracker's streams):
saved, restored, or re-derived from a seed (a resume on another layout)."""
from __future__ import annotations

import random
from typing import Any, Dict

import torch

RNG_FILE = "rng_rank_{rank:05d}.pt"
META_FILE = "meta.json"
DONE_FILE = "done_rank_{rank:05d}"
STATE_FILE = "state.pt"  # a Checkpoint's objects (rank 0)
RANK_STATE_FILE = "state_rank_{rank:05d}.pt"  # a Checkpoint's per-rank objects (every rank)


def rng_state(tracker: Any = None) -> Dict[str, Any]:
    """This process's RNG states; ``tracker``: an RNG tracker whose streams are saved too (state_dict)."""
    state: Dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if tracker is not None:
        state["tracker"] = tracker.state_dict()
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:
        pass
    return state


def set_rng_state(state: Dict[str, Any], tracker: Any = None) -> None:
    """Restore ``rng_state``'s states (and ``tracker``'s streams, when saved: a checkpoint from before
    the engine had a tracker leaves it freshly seeded)."""
    torch.set_rng_state(state["torch"])
    if tracker is not None and "tracker" in state:
        tracker.load_state_dict(state["tracker"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])


def reseed(seed: int) -> None:
    """Seed torch (every device), Python's and NumPy's generators from ``seed``."""
    torch.manual_seed(seed)
    random.seed(seed)
    try:
        import numpy as np
    except ImportError:
        return
    np.random.seed(seed % 2**32)
