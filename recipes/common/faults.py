"""Fault injection on demand (train.fail_*): the failures a cluster produces, for the drills."""
from __future__ import annotations

import os
import signal
import time
from typing import TYPE_CHECKING, Any

import torch

from launcher.config.errors import ConfigError
from launcher.config.faults import faults
from launcher.config.schema import enum_value
from launcher.config.sections import SLOW_S
from launcher.runtime.env import node_name

if TYPE_CHECKING:
    from launcher.config.schema import RunConfig


def inject_fault(cfg: RunConfig, ctx: Any, step: int, tag: str = "train") -> None:
    """Each fault of train.fail_* and train.faults (launcher.config.faults) that fires on this attempt:
    its mode at its step on its rank; the failures a cluster produces, on demand. (One function: a hang
    drill's stuck frame, which the hang watch and doctor name, is this one.)"""
    for fault in faults(cfg.train):
        if not fault.on(ctx.attempt):
            continue
        if ctx.rank != fault.rank or (fault.node and fault.node != node_name()):
            # the ranks the fault does not hit: with train.fail_peers=abort, a collective that fails ends the
            # process as ProcessGroupNCCL's watchdog does (no Python handler runs: the launcher's
            # requeue must come from outside the ranks)
            if enum_value(cfg.train.get("fail_peers", "error")) == "abort":
                ctx.abort_on_error = True
            continue
        if fault.mode == "slow" and step >= fault.at_step:  # every step from its own on
            time.sleep(SLOW_S)
            continue
        if step != fault.at_step:
            continue
        mode = fault.mode
        if mode == "exception":
            raise RuntimeError(f"injected failure at step {step} on rank {ctx.rank}")
        if mode == "sleep":
            print(f"[{tag}] rank {ctx.rank}: injected hang at step {step}", flush=True)
            while True:
                time.sleep(3600)
        if mode == "config_error":  # a failure no restart fixes: the run must fail at once
            raise ConfigError(f"{fault.key}.mode" if fault.listed else "train.fail_mode",
                              f"injected config error at step {step} on rank {ctx.rank}",
                              f"set {fault.key}.mode to another value, or remove that entry" if fault.listed
                              else "set train.fail_mode to another value, or train.fail_at_step=null")
        if mode == "cuda_error":  # what a GPU with an uncorrectable ECC error raises (the node's fault)
            print(f"[{tag}] rank {ctx.rank}: injected CUDA error at step {step} on node {node_name()}", flush=True)
            raise RuntimeError(f"CUDA error: uncorrectable ECC error encountered (injected at step {step} on rank "
                               f"{ctx.rank})")
        if mode == "gpu_held":  # torch's words for a GPU whose memory another process holds
            print(f"[{tag}] rank {ctx.rank}: injected CUDA out of memory at step {step} on node {node_name()}",
                  flush=True)
            raise torch.OutOfMemoryError(
                "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which "
                "1.25 GiB is free. Process 4242 has 61.40 GiB memory in use. Including non-PyTorch memory, this "
                "process has 16.50 GiB memory in use. Of the allocated memory 15.20 GiB is allocated by PyTorch, "
                f"and 310.00 MiB is reserved by PyTorch but unallocated. (injected at step {step} on rank {ctx.rank})")
        if mode == "stop":  # stopped, not dead: its sockets stay open and its peers wait in the collective
            print(f"[{tag}] rank {ctx.rank}: injected SIGSTOP at step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)
        if mode == "kill":
            print(f"[{tag}] rank {ctx.rank}: injected SIGKILL at step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if mode == "oom":  # one allocation larger than the host's memory (or the GPU's)
            size = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * 4
            torch.empty(size, dtype=torch.uint8, device=ctx.device)
        # kill_in_save: the checkpointer (launcher.training.checkpoint) dies while writing this step's checkpoint
