"""Dropout RNG streams for a tensor-parallel model (Megatron's CudaRNGStatesTracker, on CPU and GPU).

Dropout (torch's ``nn.Dropout``, the dropout inside ``F.scaled_dot_product_attention``) draws from
the default generator of the tensor's device. With tensor parallelism that is wrong both ways: a
replicated activation needs the *same* mask on every tensor-parallel rank (else the replicas diverge),
a split one (a rank's own heads, or its sequence chunk under sequence parallelism) needs a *different*
one (else the ranks repeat each other's masks). A ``RNGTracker`` keeps one generator state per named
stream; ``fork(name)`` swaps it in as the device's default generator state for the dropout inside, and
swaps the default state back after (the stream's advanced state is kept for the next fork).

Streams (``dropout_tracker``; seeds from ``launcher.config.seeding.tracker_seeds``, archived in seeds.json):

    replicated      derive_seed(seed, 'dropout', dp_rank, pp_rank)            same on every tp rank
    model_parallel  derive_seed(seed, 'dropout', dp_rank, pp_rank, tp_rank)   distinct per tp rank

Which stream a dropout site uses (``residual_stream``): the attention-probability dropout acts on the
rank's heads, always ``model_parallel``; the embedding and residual dropouts (after a row-parallel
layer's reduction) act on the full, replicated activation, ``replicated`` - but with sequence
parallelism on the rank's sequence chunk, ``model_parallel``.

Activation recomputation re-runs a forward: ``checkpoint`` restores the streams to their state at the
original forward for the recomputation (as Megatron's CheckpointFunction does), so the masks and the
gradients are the same as without recomputation.

A module takes part by having an ``rng`` attribute (None: the default generator, as plain torch);
``attach(module, tracker)`` sets it on every such submodule. ``state_dict``/``load_state_dict``: the
streams' states, saved in each rank's RNG checkpoint file so a resumed run draws the masks an
uninterrupted one would.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Iterator, Optional, Union

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as _torch_checkpoint

from launcher.config.seeding import tracker_seeds

REPLICATED = "replicated"
MODEL_PARALLEL = "model_parallel"


def residual_stream(sequence_parallel: bool) -> str:
    """The stream of a dropout on the residual stream (embedding, attention output, MLP output)."""
    return MODEL_PARALLEL if sequence_parallel else REPLICATED


class RNGTracker:
    """Named generator states for one device (CPU: the CPU default generator; CUDA: the device's)."""

    def __init__(self, device: Union[str, torch.device] = "cpu") -> None:
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.seeds: Dict[str, int] = {}
        self.states: Dict[str, torch.Tensor] = {}

    # -- the device's default generator state
    def _get(self) -> torch.Tensor:
        if self.device.type == "cuda":
            return torch.cuda.get_rng_state(self.device)
        return torch.get_rng_state()

    def _set(self, state: torch.Tensor) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_rng_state(state, self.device)
        else:
            torch.set_rng_state(state)

    def add(self, name: str, seed: int) -> None:
        """A new stream ``name`` seeded with ``seed``; the default generator is left as it was."""
        if name in self.states:
            raise ValueError(f"RNG stream {name!r} exists already")
        outer = self._get()
        try:
            if self.device.type == "cuda":
                with torch.cuda.device(self.device):
                    torch.cuda.manual_seed(int(seed))
            else:
                torch.manual_seed(int(seed))
            self.states[name] = self._get()
        finally:
            self._set(outer)
        self.seeds[name] = int(seed)

    @contextlib.contextmanager
    def fork(self, name: str) -> Iterator[None]:
        """Draw from stream ``name`` inside; the default generator continues unchanged after."""
        if name not in self.states:
            raise KeyError(f"no RNG stream {name!r} (streams: {sorted(self.states)})")
        outer = self._get()
        self._set(self.states[name])
        try:
            yield
        finally:  # also when a recomputation stops early by raising
            self.states[name] = self._get()
            self._set(outer)

    def get_states(self) -> Dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.states.items()}

    def set_states(self, states: Dict[str, torch.Tensor]) -> None:
        if set(states) != set(self.states):
            raise ValueError(f"RNG streams {sorted(states)} do not match {sorted(self.states)}")
        self.states = {k: v.clone() for k, v in states.items()}

    def state_dict(self) -> Dict[str, Any]:
        return {"seeds": dict(self.seeds), "states": self.get_states()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore saved streams; they must be the streams of this tracker, from the same seeds (the
        same run seed and place in the mesh)."""
        if dict(state["seeds"]) != self.seeds:
            raise ValueError(f"saved dropout RNG streams {state['seeds']} are not this rank's {self.seeds}")
        self.set_states(state["states"])

    def __repr__(self) -> str:
        return f"RNGTracker({self.device}, {self.seeds})"


def dropout_tracker(seed: int, dp_rank: int, pp_rank: int, tp_rank: int,
                    device: Union[str, torch.device] = "cpu") -> RNGTracker:
    """The replicated and model-parallel dropout streams of one rank (``launcher.config.seeding.tracker_seeds``)."""
    tracker = RNGTracker(device)
    for name, value in tracker_seeds(seed, dp_rank, pp_rank, tp_rank).items():
        tracker.add(name, value)
    return tracker


def attach(module: nn.Module, tracker: Optional[RNGTracker]) -> Optional[RNGTracker]:
    """Make every submodule with an ``rng`` attribute (a dropout site, or a recomputed region) draw
    from ``tracker``; returns it."""
    for sub in module.modules():
        if hasattr(sub, "rng"):
            sub.rng = tracker
    return tracker


def fork(tracker: Optional[RNGTracker], name: str) -> Any:
    """``tracker.fork(name)``, or nothing (the default generator) without a tracker."""
    return contextlib.nullcontext() if tracker is None else tracker.fork(name)


def dropout(module: nn.Dropout, x: torch.Tensor, tracker: Optional[RNGTracker], name: str) -> torch.Tensor:
    """``module(x)`` drawing its mask from stream ``name`` (no swap when nothing is drawn)."""
    if tracker is None or not module.training or module.p == 0:
        return module(x)
    with tracker.fork(name):
        return module(x)


def checkpoint(fn: Callable[..., Any], *args: Any, tracker: Optional[RNGTracker] = None) -> Any:
    """``torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)``; with a tracker, the
    recomputation draws from the streams as they were at the forward (and leaves them as it found them)."""
    if tracker is None:
        return _torch_checkpoint(fn, *args, use_reentrant=False)
    saved = tracker.get_states()

    @contextlib.contextmanager
    def recompute() -> Iterator[None]:
        current = tracker.get_states()
        tracker.set_states(saved)
        try:
            yield
        finally:
            tracker.set_states(current)

    return _torch_checkpoint(fn, *args, use_reentrant=False,
                             context_fn=lambda: (contextlib.nullcontext(), recompute()))


__all__ = ["MODEL_PARALLEL", "REPLICATED", "RNGTracker", "attach", "checkpoint", "dropout", "dropout_tracker",
           "fork", "residual_stream"]
