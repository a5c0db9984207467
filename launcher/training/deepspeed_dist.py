"""DeepSpeed in any recipe: hand it the process group the launcher runtime already made.

``deepspeed.init_distributed()`` as DeepSpeed's documentation shows it JIT-compiles, on the CPU
accelerator, the shared-memory all-reduce op (deepspeed_shm_comm: gcc + ninja, 1-4 minutes on a cold
~/.cache/torch_extensions) the first time its comm backend is created, while the run shows no
progress. Training never uses that op: it serves only ``inference_all_reduce``, which falls back to
torch.distributed's all_reduce without it (the same sum). ``init_distributed`` here skips that build;
every training collective goes through torch.distributed as before.
"""
from __future__ import annotations

import importlib
from typing import Any


def init_distributed(ctx: Any) -> Any:
    """``deepspeed.init_distributed`` on the runtime's process group (``ctx.backend``: gloo or nccl),
    without building the inference-only shared-memory op; returns the deepspeed module."""
    import deepspeed

    # (``import deepspeed.comm.torch as m`` would bind torch itself: deepspeed.comm re-exports it)
    ds_torch_comm = importlib.import_module("deepspeed.comm.torch")
    build = getattr(ds_torch_comm, "build_shm_op", None)
    if build is not None:
        ds_torch_comm.build_shm_op = lambda: None
    try:
        deepspeed.init_distributed(dist_backend=str(ctx.backend), dist_init_required=False)
    finally:
        if build is not None:
            ds_torch_comm.build_shm_op = build
    return deepspeed
