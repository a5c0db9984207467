"""A row of the rule table (``Rule``), the rule kinds, and the rows generated from the schema's bounds.

Every rule is a row (key, predicate, problem, fix) over ``launcher.config.layout.Facts``: its predicate
says when the rule is broken, its key names the config key at fault, its fix says what to change; a
row made by ``each_row`` reports one error per offending key. The bound rows (a numeric key below its
minimum, above its maximum, nan or inf) are generated here from the bounds ``launcher.config.schema``
declares with each key: ``shared_bound_rows`` for the keys every recipe shares, ``bound_rows`` for
those a recipe's schema adds, ``own_rows`` for a recipe's contract. The table itself (``RULES``) and
the queries over it are launcher.config.rules'. Pure (no torch).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from operator import attrgetter
from typing import Any, Callable, List, Optional, Sequence, Tuple, Union

from launcher.config import recipe_contract, schema
from launcher.config.errors import ConfigError
from launcher.config.layout import Facts

Text = Union[str, Callable[[Facts], str]]

# Rule kinds: a broken VALUE or SHAPE rule means no layout can be built from the config (the other
# rules are not evaluated then); LAYOUT rules are what the planner's search filters candidates with;
# RUN rules concern the rest of the run config.
VALUE, SHAPE, LAYOUT, RUN = "value", "shape", "layout", "run"
ALL_KINDS = (VALUE, SHAPE, LAYOUT, RUN)


@dataclass(frozen=True)
class Rule:
    key: str
    broken: Callable[[Facts], bool]
    problem: Text
    fix: Text
    kind: str = LAYOUT
    # a row over many keys (unknown keys, control characters): (key, problem) of each offender; the
    # row's own ``key`` then only describes it
    # (a third item, where given, is that offender's own fix)
    each: Optional[Callable[[Facts], List[Tuple[str, ...]]]] = None

    def error(self, f: Facts) -> ConfigError:
        text = lambda t: t(f) if callable(t) else t  # noqa: E731
        return ConfigError(self.key, text(self.problem), text(self.fix))

    def errors(self, f: Facts) -> List[ConfigError]:
        if self.each is None:
            return [self.error(f)]
        fix = self.fix(f) if callable(self.fix) else self.fix
        return [ConfigError(key, problem, *(own or [fix])) for key, problem, *own in self.each(f)]


def each_row(key: str, find: Callable[[Facts], List[Tuple[str, ...]]], fix: Text) -> Rule:
    return Rule(key, lambda f: bool(find(f)), "", fix, RUN, each=find)


# ---- bound rows, generated from the bounds launcher.config.schema declares ---------------------------------

# Keys Facts holds as attributes (the search sets them on candidates without a config): their rows
# read the attribute. Sizes are VALUE rows (nothing divides by them before they hold); the others
# and every key read from ``Facts.values`` are RUN rows.
_FACT_ATTR = {
    "cluster.nodes": "nodes", "cluster.gpus_per_node": "gpus_per_node", "parallelism.tp": "tp",
    "parallelism.pp": "pp", "parallelism.dp": "dp", "train.micro_batch_size": "micro_batch_size",
    "train.global_batch_size": "global_batch_size", "train.steps": "steps", "zero.stage": "zero",
    "optim.lr": "lr", "optim.warmup_steps": "warmup_steps", "train.fail_at_step": "fail_at_step",
    "train.fail_rank": "fail_rank",
}
_SIZES = frozenset(k for k in _FACT_ATTR if k.split(".")[0] != "optim" and k not in (
    "train.fail_at_step", "train.fail_rank"))
_FLOAT_MAX = sys.float_info.max


def _bound_row(leaf: schema.Leaf, sizes: frozenset = frozenset()) -> Rule:
    """The row for one numeric key of the schema: within its declared bounds; a float also finite
    (nan and inf refused), an int also a 64-bit one; null only where the schema allows it. ``sizes``:
    a recipe's size keys (its contract's), read from Facts by their dotted path, VALUE rows."""
    b = leaf.bounds or schema.Bounds()
    is_float = leaf.type is float
    top = _FLOAT_MAX if is_float else schema.INT64_MAX
    lo = b.gt if b.gt is not None else (b.ge if b.ge is not None else -top - (0 if is_float else 1))
    hi = b.lt if b.lt is not None else (b.le if b.le is not None else top)
    lo_open, hi_open, optional, key = b.gt is not None, b.lt is not None, leaf.optional, leaf.key
    attr = _FACT_ATTR.get(key) or (key if key in sizes else None)
    if attr is not None:
        get = attrgetter(attr)  # typed: a number, or None (null)
        if not lo_open and not hi_open:  # the common case, kept cheap for the search's VALUE rows
            def broken(f: Facts) -> bool:
                v = get(f)
                return (not optional) if v is None else not (lo <= v <= hi)
        else:
            def broken(f: Facts) -> bool:
                v = get(f)
                return (not optional) if v is None else not _within(v, lo, lo_open, hi, hi_open)
        kind = VALUE if key in _SIZES or key in sizes else RUN
    else:
        def get(f: Facts) -> Any:
            return f.values.get(key)

        def broken(f: Facts) -> bool:  # absent (no config) or not a number (Hydra's type check): not ours
            v = get(f)
            return isinstance(v, (int, float)) and not isinstance(v, bool) and not _within(v, lo, lo_open, hi, hi_open)
        kind = RUN

    desc = b.describe() if leaf.bounds else ""

    def problem(f: Facts) -> str:
        v = get(f)
        if v is None:
            return "must be set (it may not be null)"
        if is_float and not (-_FLOAT_MAX <= v <= _FLOAT_MAX):
            what = f"a finite number {desc}".rstrip()
        elif not is_float and not (-top - 1 <= v <= top):
            what = f"a 64-bit integer {desc}".rstrip()
        elif not is_float and b.ge == 1 and b.le is None and b.lt is None:
            what = "a positive integer"
        else:
            what = desc
        return f"must be {what}{(' ' + b.why) if b.why else ''}, got {v!r}"

    if b.fix:
        fix = b.fix
    elif b.ge is not None and b.le is None and b.lt is None:
        fix = f"set {key}={schema.show_number(b.ge)} or more"
    else:
        fix = f"set {key} to a value {desc or 'that fits'}"
    return Rule(key, broken, problem, fix, kind)


def _within(v: Any, lo: Any, lo_open: bool, hi: Any, hi_open: bool) -> bool:
    return (lo < v if lo_open else lo <= v) and (v < hi if hi_open else v <= hi)


def shared_bound_rows(kind: str) -> Tuple[Rule, ...]:
    """The bound rows of ``kind`` of the keys every recipe shares (RunConfig's)."""
    rows = (_bound_row(leaf) for leaf in schema.leaves() if leaf.type in (int, float))
    return tuple(r for r in rows if r.kind == kind)


def bound_rows(run_schema: type, sizes: Sequence[str] = ()) -> Tuple[Rule, ...]:
    """The bound rows of the numeric keys a recipe's schema (a RunConfig subclass) adds; ``sizes``:
    those read from Facts (VALUE rows). A contract lists them with its rules (``table`` adds those of
    a schema's keys its rules leave out)."""
    shared = {leaf.key for leaf in schema.leaves()}
    return tuple(_bound_row(leaf, frozenset(sizes)) for leaf in schema.leaves_of(run_schema)
                 if leaf.key not in shared and leaf.type in (int, float))


def own_rows(spec: recipe_contract.RecipeSpec) -> Tuple[Rule, ...]:
    """A contract's rows, and the bound rows of its schema's keys it does not list itself."""
    listed = {r.key for r in spec.rules}
    auto = bound_rows(spec.schema, spec.sizes) if spec.schema is not None else ()
    return tuple(spec.rules) + tuple(r for r in auto if r.key not in listed)
