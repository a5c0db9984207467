"""Measured activation memory: the peak of live saved-for-backward bytes during a training step.

``ActivationMeter`` wraps a step (every forward and backward the engine runs in it) in
``torch.autograd.graph.saved_tensors_hooks``. Each tensor autograd saves for backward is packed
through it: the bytes of its storage count once per distinct storage (refcounted by the storage's
data_ptr, so a tensor saved by several ops, or several views of one buffer, count once), and leave
the count when the last saved reference to that storage is unpacked in the backward. The peak over
the step is what the rank held for backward at most, pipeline micro-batches in flight included
(1F1B runs several forwards before their backwards).

Not counted: parameters, and tensors made from one parameter alone (a transpose or view of a
weight, autocast's low-precision copy of it): they are model states, not activations, as in the
planner (recipes.gpt.plan.memory). Recomputed regions (torch.utils.checkpoint) pack into their own
hooks and store nothing here, as the planner assumes.

Costs a Python call per saved tensor: the training loop uses it for the first step of an attempt only.
"""
from __future__ import annotations

from typing import Any, Dict, Optional

import torch
from torch import nn


def _param_derived(t: torch.Tensor) -> bool:
    """A parameter, a view of one, or one op of a parameter alone (transpose, cast)."""
    if isinstance(t, nn.Parameter):
        return True
    base = t._base
    if base is not None and isinstance(base, nn.Parameter):
        return True
    fn = t.grad_fn
    if fn is None:
        return False
    inputs = [f for f, _ in fn.next_functions if f is not None]
    return bool(inputs) and all(isinstance(getattr(f, "variable", None), nn.Parameter) for f in inputs)


class _Saved:
    __slots__ = ("tensor", "key", "live")

    def __init__(self, tensor: torch.Tensor, key: Optional[int]) -> None:
        self.tensor, self.key, self.live = tensor, key, key is not None


class ActivationMeter:
    """``with ActivationMeter() as meter: engine.train_step(...)``; then ``meter.peak_bytes``."""

    def __init__(self) -> None:
        self.live_bytes = 0
        self.peak_bytes = 0
        self._refs: Dict[int, int] = {}
        self._sizes: Dict[int, int] = {}
        self._hooks: Any = None

    def _pack(self, t: torch.Tensor) -> _Saved:
        if _param_derived(t):
            return _Saved(t, None)
        try:
            storage = t.untyped_storage()
            key, size = storage.data_ptr(), storage.nbytes()
        except (RuntimeError, NotImplementedError):  # a tensor without storage (wrapper subclasses)
            return _Saved(t, None)
        if not size:
            return _Saved(t, None)
        n = self._refs.get(key, 0)
        if n == 0:
            self._sizes[key] = size
            self.live_bytes += size
            if self.live_bytes > self.peak_bytes:
                self.peak_bytes = self.live_bytes
        self._refs[key] = n + 1
        return _Saved(t, key)

    def _unpack(self, saved: _Saved) -> torch.Tensor:
        if saved.live:  # (a saved tensor unpacked twice, retain_graph, counts once)
            saved.live = False
            n = self._refs[saved.key] - 1
            if n == 0:
                del self._refs[saved.key]
                self.live_bytes -= self._sizes.pop(saved.key)
            else:
                self._refs[saved.key] = n
        return saved.tensor

    def __enter__(self) -> ActivationMeter:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)
        self._hooks = None
