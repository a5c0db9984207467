"""The public training API of any recipe (docs/training-api.md): Checkpoint / Checkpointer, StepLoop,
MetricsSink; the engines for any model in ``launcher.training.engines``. On the node only: they import
torch, which the login path never does (the names load on first use, so the pure
``launcher.training.ds_config`` imports without torch)."""
from __future__ import annotations

from importlib import import_module
from typing import Any

_HOMES = {"Checkpoint": "checkpoint", "Checkpointer": "checkpoint", "StepLoop": "loop", "MetricsSink": "metrics"}

__all__ = ["Checkpoint", "Checkpointer", "MetricsSink", "StepLoop"]


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{_HOMES[name]}"), name)
