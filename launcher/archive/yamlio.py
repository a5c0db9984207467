"""YAML text of archived configs, through libyaml when PyYAML has it (a sweep writes and indexes one
config per point: the C emitter and parser are ~10x faster than PyYAML's pure-Python ones).

Loading is bounded: YAML aliases let 1 KB of text stand for billions of values (each ``*a`` repeats
a whole subtree), which the parser shares but every reader that walks or JSON-dumps the config (the
run index) expands. ``load`` refuses a document whose expansion holds more than ``MAX_VALUES``."""
from __future__ import annotations

from typing import Any, Dict

import yaml

from launcher import by_section

_DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

# a resolved config of the largest recipe holds a few thousand values; this is far beyond any real one
MAX_VALUES = 1_000_000


class TooLarge(yaml.YAMLError):
    """A document whose aliases expand beyond MAX_VALUES values, or refer to themselves."""


def dump(obj: Any) -> str:
    """Block-style YAML, keys in their order (as yaml.safe_dump(obj, sort_keys=False)). A mapping's
    top-level entries are emitted one by one (a block mapping's text is its entries' texts in a row),
    each distinct one once per process (launcher.by_section: the representer is Python even with
    libyaml's emitter, ~0.6 ms a config); an object two entries share is written out in each."""
    if not isinstance(obj, dict) or len(obj) < 2:
        return _dump(obj)
    return "".join(by_section.once("yaml", _entry, k, v) for k, v in obj.items())


def _entry(key: Any, value: Any) -> str:
    return _dump({key: value})


def _dump(obj: Any) -> str:
    return yaml.dump(obj, Dumper=_DUMPER, sort_keys=False, allow_unicode=False)


def safe_load(text: str) -> Any:
    """``yaml.safe_load`` through libyaml where PyYAML has it: the small files a launch reads whole (each
    group's options, the source tree's config files scanned for secrets), unbounded as PyYAML's."""
    return yaml.load(text, Loader=_LOADER)


def safe_load_all(text: str) -> list:
    """``yaml.safe_load_all`` through libyaml where PyYAML has it (every document of ``text``)."""
    return list(yaml.load_all(text, Loader=_LOADER))


def load(text: str, max_values: int = MAX_VALUES) -> Any:
    """The document in ``text`` (safe types only); TooLarge when its aliases expand beyond
    ``max_values`` values."""
    obj = yaml.load(text, Loader=_LOADER)
    if "*" in text:  # an alias can only be written with '*': text without one expands to itself
        try:
            expanded_size(obj, max_values)
        except RecursionError:  # nested deeper than Python recurses (libyaml allows 1000 levels)
            raise TooLarge("the document nests too deep to be read") from None
    return obj


def expanded_size(obj: Any, limit: int) -> int:
    """How many values ``obj`` holds once every shared subtree is counted each time it appears
    (what a JSON dump writes), counted once per distinct subtree; TooLarge past ``limit`` or on a
    subtree that holds itself."""
    sizes: Dict[int, int] = {}
    busy = set()

    def size(node: Any) -> int:
        if not isinstance(node, (dict, list)):
            return 1
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in busy:
            raise TooLarge("a YAML alias refers to the node that holds it (a recursive document)")
        busy.add(key)
        children = node.items() if isinstance(node, dict) else ((None, v) for v in node)
        n = 1
        for _, v in children:
            n += size(v)
            if n > limit:
                raise TooLarge(f"the document's aliases expand it to more than {limit:,} values")
        busy.discard(key)
        sizes[key] = n
        return n

    return size(obj)
