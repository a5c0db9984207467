"""This host's GPUs as the local backend sees them, and `cluster=local`'s default process count.

A leaf (nothing of the launcher imported): the local backend (launcher/backends/local.py) and the
config's resolver for conf/cluster/local.yaml (launcher/config/schema.py: ``host_gpus_or``) both read it.
``LAUNCHER_HOST_GPUS=N`` fixes the view at N GPUs (0: none), whatever /dev shows: the pure tests pin
it (tests/unit/conftest.py), and a host that is not this one is checked, planned, dry-run and run
with it: its default process count, and its processes on the CPU where the GPUs it names are not
there (said in one line at submission: LocalBackend.parameters). Set to 0 or fewer GPUs than there
are, the processes use that many (none: the CPU).
"""
from __future__ import annotations

import os
import sys
from typing import Mapping, Optional


def nvidia_gpu_count(dev: str = "/dev") -> int:
    """NVIDIA GPUs this process may use: the ids in CUDA_VISIBLE_DEVICES where it is set, else the
    device files /dev/nvidia0, ... (0 where none, or CUDA_VISIBLE_DEVICES hides them)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", None)
    if visible is not None:
        return len([x for x in visible.split(",") if x.strip() and x.strip() != "-1"])
    try:
        return sum(1 for n in os.listdir(dev) if n.startswith("nvidia") and n[len("nvidia"):].isdigit())
    except OSError:
        return 0


def has_nvidia_gpus(dev: str = "/dev") -> bool:
    """Whether this host shows NVIDIA GPUs (device files /dev/nvidia0, ...) that CUDA_VISIBLE_DEVICES
    does not hide: the local processes then compute on them (torch.cuda.is_available on the node)."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return False
    try:
        return any(n[len("nvidia"):].isdigit() for n in os.listdir(dev) if n.startswith("nvidia"))
    except OSError:
        return False


HOST_GPUS_ENV = "LAUNCHER_HOST_GPUS"


def simulated_gpus(environ: Optional[Mapping[str, str]] = None) -> Optional[int]:
    """LAUNCHER_HOST_GPUS=N: the local backend's view of this host fixed at N GPUs (0: none), whatever
    /dev shows; None where it is unset."""
    value = (os.environ if environ is None else environ).get(HOST_GPUS_ENV)
    if value is None or not value.strip():
        return None
    if not value.strip().isdigit():
        raise ValueError(f"{HOST_GPUS_ENV}={value!r}: the number of GPUs this host is taken to have (0 or more)")
    return int(value)


def detected_gpus() -> int:
    """The NVIDIA GPUs this process may use (0 where it has none), LAUNCHER_HOST_GPUS aside."""
    return nvidia_gpu_count() if has_nvidia_gpus() else 0


def host_gpus() -> int:
    """The GPUs local processes use on this host: LAUNCHER_HOST_GPUS where it is set, else the detected."""
    simulated = simulated_gpus()
    return simulated if simulated is not None else detected_gpus()


def default_processes(without_gpus: int, global_batch: Optional[int] = None,
                      micro_batch: Optional[int] = None) -> int:
    """conf/cluster/local.yaml's ``gpus_per_node``: one process per GPU of this host (``host_gpus``), as
    many of them as the global batch's micro-batches split over evenly (a GPU more would leave the
    batch indivisible: refused); ``without_gpus`` processes on its CPU where it has none. Where it
    takes fewer GPUs than the host has, it says so once (a line to stderr)."""
    gpus = host_gpus()
    if not gpus:
        return int(without_gpus)
    n = gpus
    if global_batch and micro_batch and int(global_batch) % int(micro_batch) == 0:
        micro_batches = int(global_batch) // int(micro_batch)
        n = max(k for k in range(1, gpus + 1) if micro_batches % k == 0)
    if n < gpus:
        say_once(f"cluster=local: {n} of this host's {gpus} GPUs, one process each (train.global_batch_size="
                  f"{global_batch} is {micro_batches} micro-batches of {micro_batch}); to use all {gpus}: "
                  f"cluster.gpus_per_node={gpus} and a batch that is a multiple of {gpus * int(micro_batch)}")
    return n


_SAID: set = set()  # the lines said by this process (a config is resolved many times)


def say_once(line: str) -> None:
    if line not in _SAID:
        _SAID.add(line)
        print(line, file=sys.stderr)
