"""YAML text of archived configs, through libyaml when PyYAML has it (a sweep writes and indexes one
config per point: the C emitter and parser are ~10x faster than PyYAML's pure-Python ones)."""
from __future__ import annotations

from typing import Any

import yaml

_DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def dump(obj: Any) -> str:
    """Block-style YAML, keys in their order (as yaml.safe_dump(obj, sort_keys=False))."""
    return yaml.dump(obj, Dumper=_DUMPER, sort_keys=False, allow_unicode=False)


def load(text: str) -> Any:
    return yaml.load(text, Loader=_LOADER)
