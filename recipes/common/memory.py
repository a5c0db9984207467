"""Memory of this process: resident host memory (current and peak) and device memory, and what a model's
construction used.

Host memory is the kernel's account of the process (``/proc/self/status``): ``VmRSS`` now, ``VmHWM``
the peak since the process started or since ``reset_host_peak`` (writing 5 to ``/proc/self/clear_refs``,
Linux >= 4.0). Where /proc is missing the peak falls back to ``getrusage``'s ``ru_maxrss`` (never
reset), the current value to the peak. Device memory is torch's caching allocator's account on CUDA
(``memory_allocated`` / ``max_memory_allocated``, tensors only: not the allocator's cached blocks nor
the CUDA context); None on other devices (on CPU the device IS the host memory).

``BuildMeter`` brackets a construction (an engine building its model: parameters created and
initialised): the resident memory before, the peak during it (the kernel's high-water mark, reset at
the start; where it cannot be reset, the largest of samples taken every 2 ms by a thread) and the
resident memory after. ``host_peak_build_bytes`` = peak - before: what the construction itself used
at most, whatever was resident before (the interpreter, torch, DeepSpeed) not counted.
"""
from __future__ import annotations

import resource
import threading
from typing import Any, Dict, Optional

import torch

_STATUS = "/proc/self/status"
_CLEAR_REFS = "/proc/self/clear_refs"


def _status_kib(key: str) -> Optional[int]:
    try:
        with open(_STATUS) as fh:
            for line in fh:
                if line.startswith(key + ":"):
                    return int(line.split()[1])  # "VmRSS:   123456 kB"
    except (OSError, ValueError, IndexError):
        return None
    return None


def _maxrss_bytes() -> int:
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # KiB on Linux


def host_rss_bytes() -> int:
    """Resident host memory of this process now, bytes."""
    kib = _status_kib("VmRSS")
    return kib * 1024 if kib is not None else _maxrss_bytes()


def host_peak_bytes() -> int:
    """The most resident host memory this process had since it started or since ``reset_host_peak``."""
    kib = _status_kib("VmHWM")
    return kib * 1024 if kib is not None else _maxrss_bytes()


def reset_host_peak() -> bool:
    """Restart the peak (``host_peak_bytes``) from the current resident memory; False where the
    kernel does not allow it (no /proc, or a sandbox that refuses the write)."""
    try:
        with open(_CLEAR_REFS, "w") as fh:
            fh.write("5")
    except OSError:
        return False
    hwm, rss = _status_kib("VmHWM"), _status_kib("VmRSS")
    return hwm is not None and rss is not None and hwm <= rss + 64  # (a page or few may come in between)


def _cuda(device: Any) -> Optional[torch.device]:
    dev = torch.device(device)
    return dev if dev.type == "cuda" and torch.cuda.is_available() else None


def device_bytes(device: Any) -> Optional[int]:
    """Bytes of tensors allocated on ``device`` now (CUDA), None on other devices."""
    dev = _cuda(device)
    return int(torch.cuda.memory_allocated(dev)) if dev is not None else None


def device_peak_bytes(device: Any) -> Optional[int]:
    """The most bytes of tensors allocated on ``device`` since the start or ``reset_device_peak``."""
    dev = _cuda(device)
    return int(torch.cuda.max_memory_allocated(dev)) if dev is not None else None


def reset_device_peak(device: Any) -> None:
    dev = _cuda(device)
    if dev is not None:
        torch.cuda.reset_peak_memory_stats(dev)


class _Sampler(threading.Thread):
    """The largest resident memory seen every ``interval`` seconds (where the peak cannot be reset)."""

    def __init__(self, interval: float = 0.002) -> None:
        super().__init__(daemon=True, name="rss-sampler")
        self.interval = interval
        self.peak = host_rss_bytes()
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.wait(self.interval):
            self.peak = max(self.peak, host_rss_bytes())

    def stop(self) -> int:
        self._done.set()
        self.join()
        self.peak = max(self.peak, host_rss_bytes())
        return self.peak


class BuildMeter:
    """Host (and device) memory around a construction: ``start()`` ... ``stop()``, or ``with``.

    ``record()`` -> {host_rss_before_build_bytes, host_rss_after_build_bytes, host_peak_build_bytes
    (peak during it - before), host_peak_source ("hwm": the kernel's high-water mark, or "sampled")}
    and on CUDA device_after_build_bytes, device_peak_build_bytes (peak - allocated before)."""

    def __init__(self, device: Any = "cpu") -> None:
        self.device = device
        self._record: Dict[str, Any] = {}
        self._sampler: Optional[_Sampler] = None

    def start(self) -> BuildMeter:
        reset_device_peak(self.device)
        self._device_before = device_bytes(self.device)
        if not reset_host_peak():
            self._sampler = _Sampler()
            self._sampler.start()
        self._before = host_rss_bytes()
        return self

    def stop(self) -> Dict[str, Any]:
        peak = self._sampler.stop() if self._sampler is not None else host_peak_bytes()
        after = host_rss_bytes()
        rec: Dict[str, Any] = {
            "host_rss_before_build_bytes": self._before,
            "host_rss_after_build_bytes": after,
            "host_peak_build_bytes": max(0, max(peak, after) - self._before),
            "host_peak_source": "sampled" if self._sampler is not None else "hwm",
        }
        dev_after, dev_peak = device_bytes(self.device), device_peak_bytes(self.device)
        if dev_after is not None and dev_peak is not None:
            rec["device_after_build_bytes"] = dev_after
            rec["device_peak_build_bytes"] = max(0, dev_peak - (self._device_before or 0))
        self._record = rec
        return rec

    def record(self) -> Dict[str, Any]:
        return dict(self._record)

    def __enter__(self) -> BuildMeter:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


class StepPeak:
    """The peak host (and device) memory over the steps after ``start()``: ``record()`` ->
    {host_peak_step_bytes (resident, absolute), device_peak_step_bytes (CUDA)}. The host peak is the
    kernel's high-water mark reset at ``start()``; where it cannot be reset, the process's lifetime
    peak (``host_peak_step_source`` says which)."""

    def __init__(self, device: Any = "cpu") -> None:
        self.device = device
        self.reset_ok = False

    def start(self) -> StepPeak:
        self.reset_ok = reset_host_peak()
        reset_device_peak(self.device)
        return self

    def record(self) -> Dict[str, Any]:
        rec: Dict[str, Any] = {"host_peak_step_bytes": host_peak_bytes(),
                               "host_peak_step_source": "hwm" if self.reset_ok else "lifetime"}
        dev = device_peak_bytes(self.device)
        if dev is not None:
            rec["device_peak_step_bytes"] = dev
        return rec

