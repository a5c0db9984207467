"""Pure functions of one top-level section of a config, computed once per distinct section.

A sweep's points share most of their config's top-level sections (only ``seed`` differs in a seed
sweep), and launch walks every point's config several times (its YAML text, the secrets in it, its
redaction, its control characters): ~0.3-0.6 ms a walk, per point. Each such walk is a function of
one section at a time; here its result is kept by the section's pickled content (a few microseconds
to make) and reused for every point holding the same section. Results are shared: a caller copies
what it changes."""
from __future__ import annotations

import pickle
from typing import Any, Callable, Dict, Tuple, TypeVar

T = TypeVar("T")

MAX_KEPT = 8192  # a launch's distinct sections: a few per swept key; past this the memo starts afresh
_kept: Dict[Tuple[str, bytes], Any] = {}
_MISSING = object()


def once(kind: str, fn: Callable[..., T], key: Any, value: Any, *extra: Any) -> T:
    """``fn(key, value, *extra)``, computed once per distinct (``kind``, key, value, extra) in this
    process; computed each time where they cannot be pickled."""
    try:
        memo = (kind, pickle.dumps((key, value, extra), protocol=pickle.HIGHEST_PROTOCOL))
    except Exception:
        return fn(key, value, *extra)
    got = _kept.get(memo, _MISSING)
    if got is _MISSING:
        if len(_kept) >= MAX_KEPT:
            _kept.clear()
        got = _kept[memo] = fn(key, value, *extra)
    return got
