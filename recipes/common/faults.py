"""Fault injection on demand (train.fail_*): the failures a cluster produces, for the drills."""
from __future__ import annotations

import os
import signal
import time
from typing import Any

import torch

from launcher.schema import enum_value


def inject_fault(cfg: Any, ctx: Any, step: int, tag: str = "train") -> None:
    """train.fail_mode at train.fail_at_step on train.fail_rank (on attempt train.fail_attempt, or every
    attempt): the failures a cluster produces, on demand."""
    tr = cfg.train
    if tr.fail_at_step is None or step != int(tr.fail_at_step) or ctx.rank != int(tr.fail_rank):
        return
    if tr.fail_attempt is not None and int(tr.fail_attempt) != int(ctx.attempt):
        return
    mode = enum_value(tr.fail_mode)
    if mode == "exception":
        raise RuntimeError(f"injected failure at step {step} on rank {ctx.rank}")
    if mode == "sleep":
        print(f"[{tag}] rank {ctx.rank}: injected hang at step {step}", flush=True)
        while True:
            time.sleep(3600)
    if mode == "kill":
        print(f"[{tag}] rank {ctx.rank}: injected SIGKILL at step {step}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "oom":  # one allocation larger than the host's memory (or the GPU's)
        size = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * 4
        torch.empty(size, dtype=torch.uint8, device=ctx.device)
    # kill_in_save: the checkpointer (launcher.training.checkpoint) dies while writing this step's checkpoint
