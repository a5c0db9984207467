"""Backends: where jobs run. One module per scheduler, each defining ``BACKEND``.

A backend owns everything that differs between schedulers: its submitit executor and parameters,
which points share one submission (its grouping key), the script it submitted, whether ``launch``
waits for it by default, the state of its jobs (mapped onto ``launcher.status.Status``), cancel and
log paths, and the node side of its jobs (``Backend.detect``, ``place``, ``node_name``, addresses,
the seal after a job). Nothing outside this package asks which scheduler a run uses: adding one is adding a
module here (``cluster.backend`` names it).
"""
from __future__ import annotations

import importlib
import os
import pkgutil
from functools import lru_cache
from typing import Any, List, Mapping, Optional

from launcher.backends.base import Backend, JobState, TaskPlace

__all__ = ["Backend", "JobState", "TaskPlace", "names", "get", "every", "of", "running"]


@lru_cache(maxsize=1)
def _names() -> tuple:
    return tuple(sorted(m.name for m in pkgutil.iter_modules(__path__) if m.name != "base"
                        and not m.name.startswith("_")))


def names() -> List[str]:
    """Every backend ``cluster.backend`` may name."""
    return list(_names())


def get(name: str) -> Backend:
    if name not in _names():
        raise ValueError(f"cluster.backend={name!r} is not a backend; choose one of {', '.join(_names())}")
    return importlib.import_module(f"{__name__}.{name}").BACKEND


def every() -> List[Backend]:
    """Every backend (the doctor's scheduler words are all of theirs)."""
    return [importlib.import_module(f"{__name__}.{name}").BACKEND for name in _names()]


def of(cfg: Any) -> Backend:
    """The backend of a run config (its ``cluster.backend``)."""
    from launcher.schema import enum_value  # omegaconf (through launcher.schema): naming backends needs no config

    return get(enum_value(cfg.cluster.backend))


def running(environ: Optional[Mapping[str, str]] = None) -> Optional[Backend]:
    """On the node: the backend whose job this process is part of (the first that detects itself in
    ``environ``, this process's environment by default); None outside any backend's job."""
    environ = os.environ if environ is None else environ
    return next((b for b in map(get, _names()) if b.detect(environ)), None)
