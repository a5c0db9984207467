"""Backends: where jobs run. One module per scheduler, each defining ``BACKEND``.

A backend owns everything that differs between schedulers: its submitit executor and parameters,
which points share one submission (its grouping key), the script it submitted, whether ``launch``
waits for it by default, the state of its jobs (mapped onto ``launcher.run.status.Status``), cancel and
log paths, and the node side of its jobs (``Backend.detect``, ``place``, ``node_name``, addresses,
the seal after a job), and what it can do (its capabilities: ``base.CAPABILITIES``; a setting that needs
one the chosen backend lacks is refused before anything is queued, launcher.config.rules). Nothing outside
this package asks which scheduler a run uses: adding one is adding a module here, or another package's
``launcher.backends`` entry point naming its ``Backend`` (``cluster.backend`` names it).
"""
from __future__ import annotations

import importlib
import os
import pkgutil
from functools import cache, lru_cache
from importlib import metadata
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional

from launcher.backends.base import Backend, JobState, TaskPlace

if TYPE_CHECKING:
    from launcher.config.schema import RunConfig

__all__ = ["Backend", "JobState", "TaskPlace", "names", "get", "every", "of", "running", "register", "unregister"]


ENTRY_POINTS = "launcher.backends"  # a backend outside this package: an entry point naming its Backend
_registered: Dict[str, Backend] = {}


@lru_cache(maxsize=1)
def _found() -> Dict[str, Any]:
    """name -> the module of this package that defines it, or the entry point of another package."""
    found: Dict[str, Any] = {m.name: f"{__name__}.{m.name}" for m in pkgutil.iter_modules(__path__)
                             if m.name != "base" and not m.name.startswith("_")}
    for ep in metadata.entry_points(group=ENTRY_POINTS):
        found.setdefault(ep.name, ep)
    return found


def register(backend: Backend) -> None:
    """Make ``backend`` one ``cluster.backend`` may name (in this process; another package's backend
    is found in every process through its ``launcher.backends`` entry point)."""
    _registered[backend.name] = backend


def unregister(name: str) -> None:
    _registered.pop(name, None)


def names() -> List[str]:
    """Every backend ``cluster.backend`` may name."""
    return sorted({*_found(), *_registered})


def get(name: str) -> Backend:
    if name in _registered:
        return _registered[name]
    where = _found().get(name)
    if where is None:
        raise ValueError(f"cluster.backend={name!r} is not a backend; choose one of {', '.join(names())}")
    if isinstance(where, str):
        return importlib.import_module(where).BACKEND
    return _loaded(name)


@cache
def _loaded(name: str) -> Backend:
    backend = _found()[name].load()
    return backend() if isinstance(backend, type) else backend


def every() -> List[Backend]:
    """Every backend (the doctor's scheduler words are all of theirs)."""
    return [get(name) for name in names()]


def of(cfg: RunConfig) -> Backend:
    """The backend of a run config (its ``cluster.backend``)."""
    from launcher.config.schema import (
        enum_value,  # omegaconf (through launcher.config.schema): naming backends needs no config
    )

    return get(enum_value(cfg.cluster.backend))


def running(environ: Optional[Mapping[str, str]] = None) -> Optional[Backend]:
    """On the node: the backend whose job this process is part of (the first that detects itself in
    ``environ``, this process's environment by default); None outside any backend's job."""
    environ = os.environ if environ is None else environ
    return next((b for b in map(get, names()) if b.detect(environ)), None)
