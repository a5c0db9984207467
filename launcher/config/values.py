"""Every value of a run config by its dotted key (``Values``), read lazily, and what the RUN rules
look for in them: keys the schema does not declare, control characters in strings."""
from __future__ import annotations

import difflib
import re
from dataclasses import asdict
from functools import cached_property, lru_cache
from typing import Any, Dict, Iterator, List, Optional, Tuple

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from launcher import by_section
from launcher.config import schema

CONTROL_CHARS = re.compile(r"[\x00-\x1f\x7f]")
SBATCH_OPTION = re.compile(r"^[A-Za-z][A-Za-z0-9_-]*$")


class Values:
    """Every value of a run config by dotted key (``optim.lr``; list items ``cluster.setup[0]``, mapping
    entries ``cluster.env.NAME``), resolved, enums as strings. Read from the config the first time a
    rule asks: building Facts stays cheap, and the planner's search (no config) never pays for it.
    What the RUN rules find in it is computed once and shared by every ``Facts.with_`` copy."""

    def __init__(self, source: Any = None):
        self._source = source

    @cached_property
    def tree(self) -> Dict[str, Any]:
        """The config as plain dicts and lists (interpolations resolved where they resolve)."""
        src = self._source
        if src is None:
            return {}
        if isinstance(src, dict):
            return src
        if isinstance(src, DictConfig):
            try:
                return OmegaConf.to_container(src, resolve=True, enum_to_str=True)
            except OmegaConfBaseException:  # an unresolvable interpolation: pipeline._resolve names it
                return OmegaConf.to_container(src, resolve=False, enum_to_str=True)
        try:
            return asdict(src)
        except TypeError:
            return {}

    @cached_property
    def flat(self) -> Dict[str, Any]:
        tree = self.tree
        if not isinstance(tree, dict) or not tree:
            return dict(_walk(tree, ""))
        out: Dict[str, Any] = {}
        for k, v in tree.items():  # each distinct section walked once (a sweep's points share them)
            out.update(by_section.once("flat", _flat_section, k, v))
        return out

    def get(self, key: str, default: Any = None) -> Any:
        return self.flat.get(key, default) if self._source is not None else default

    @cached_property
    def unknown_keys(self) -> List[Tuple[str, str]]:
        """(key, problem) for every key the schema does not declare (Hydra lets '+key=...' add one)."""
        target = (self.tree.get("recipe") or {}).get("_target_") if isinstance(self.tree.get("recipe"), dict) else None
        # the launcher's schema and the recipe's own groups (its contract's), or another recipe's groups
        # the run kept because its overrides asked for them (schema.own_config)
        cls = schema.schema_for(target, self.tree.keys())
        out: List[Tuple[str, str]] = []
        for k, v in self.tree.items():  # each distinct section read once (a sweep's points share them)
            if k != "hydra":
                out.extend(by_section.once("unknown_keys", _section_unknown_keys, k, v, cls))
        return out

    @cached_property
    def control_chars(self) -> List[Tuple[str, str]]:
        """(key, problem) for every string value, mapping key or list item holding a control
        character: a newline ends the #SBATCH or shell line it is written into and the rest runs."""
        tree = self.tree
        if not isinstance(tree, dict):
            return _control_chars(tree)
        out: List[Tuple[str, str]] = []
        for k, v in tree.items():  # each distinct section read once (a sweep's points share them)
            out.extend(by_section.once("control_chars", _section_control_chars, k, v))
        return out


def _section_control_chars(key: Any, value: Any) -> List[Tuple[str, str]]:
    return _control_chars({key: value})


def _control_chars(tree: Any) -> List[Tuple[str, str]]:
    out: List[Tuple[str, str]] = []

    def bad(text: str) -> Optional[str]:  # the value itself is not echoed: it may be a secret
        m = CONTROL_CHARS.search(text)
        return None if m is None else (f"contains the control character {m.group()!r} (at {m.start()} of "
                                       f"{len(text)} characters)")

    def visit(node: Any, key: str) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                why = bad(str(k))
                if why:
                    out.append((key, f"has a key that {why}: {str(k)!r}"))
                visit(v, f"{key}.{k}" if key else str(k))
        elif isinstance(node, list):
            for i, v in enumerate(node):
                visit(v, f"{key}[{i}]")
        elif isinstance(node, str):
            why = bad(node)
            if why:
                out.append((key, why))

    visit(tree, "")
    return out


def _flat_section(key: Any, value: Any) -> List[Tuple[str, Any]]:
    return list(_walk({key: value}, ""))


def _walk(node: Any, key: str) -> Iterator[Tuple[str, Any]]:
    if isinstance(node, dict) and node:
        for k, v in node.items():
            yield from _walk(v, f"{key}.{k}" if key else str(k))
    elif isinstance(node, list) and node:
        for i, v in enumerate(node):
            yield from _walk(v, f"{key}[{i}]")
    else:
        yield key, node


def _close_keys(key: str, known: Any) -> List[str]:
    return difflib.get_close_matches(key, sorted(known), n=2, cutoff=0.8)


NO_VALUES = Values()


def _section_unknown_keys(key: Any, value: Any, cls: type) -> List[Tuple[str, str]]:
    groups = schema.groups_of(cls)
    leaf_keys = _leaf_keys(cls)
    out: List[Tuple[str, str]] = []

    def visit(k: Any, v: Any, prefix: str) -> None:
        full = f"{prefix}{k}"
        if full not in leaf_keys and full not in groups:
            close = _close_keys(full, leaf_keys)
            out.append((full, "is not a key of the run config (launcher/config/schema.py declares every key; "
                              "a '+' override adds any key without complaint)"
                        + (f"; did you mean {' or '.join(close)}?" if close else "")))
        elif full in groups and isinstance(v, dict):
            for k2, v2 in v.items():
                visit(k2, v2, full + ".")

    visit(key, value, "")
    return out


@lru_cache(maxsize=16)
def _leaf_keys(cls: type) -> frozenset:
    return frozenset(leaf.key for leaf in schema.leaves_of(cls))
