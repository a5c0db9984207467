"""Where a training step's time goes: seconds per phase (data, forward, backward, gradient sync,
optimizer, ...), measured where each phase runs.

On CUDA each span is a pair of CUDA events recorded on the stream, so measuring adds no
synchronisation and a phase's time is the device's; ``take`` reads only the spans the device has
finished (after the engine's one host read of the step, all of them) and leaves any other for the
next step's take: it never waits. Elsewhere the wall clock (CPU ops run synchronously). A phase
that runs several times in a step (per micro batch) is summed. Phases that overlap (DDP's gradient
all-reduce runs inside backward) are not separable and are counted where they run."""
from __future__ import annotations

import contextlib
import time
from typing import Any, Dict, Iterator, List, Tuple

import torch


class Phases:
    def __init__(self, device: Any) -> None:
        self.cuda = getattr(device, "type", str(device)) == "cuda"
        self._spans: List[Tuple[str, Any, Any]] = []

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                yield
            finally:
                end.record()
                self._spans.append((name, start, end))
        else:
            t0 = time.perf_counter()
            try:
                yield
            finally:
                self._spans.append((name, t0, time.perf_counter()))

    def take(self) -> Dict[str, float]:
        """Seconds per phase of the spans finished since the last take (on CUDA a span whose end
        event the device has not reached yet is kept for the next take, read one step late)."""
        out: Dict[str, float] = {}
        later: List[Tuple[str, Any, Any]] = []
        for name, a, b in self._spans:
            if self.cuda and not b.query():
                later.append((name, a, b))
                continue
            dt = a.elapsed_time(b) / 1e3 if self.cuda else b - a
            out[name] = out.get(name, 0.0) + dt
        self._spans = later
        return out


def step_row(phases: Dict[str, float], step_time: float) -> Dict[str, float]:
    """The metrics row's ``time_<phase>_s`` keys, and ``time_other_s``: the step's time no phase covers."""
    row = {f"time_{k}_s": v for k, v in phases.items()}
    row["time_other_s"] = max(0.0, step_time - sum(phases.values()))
    return row
