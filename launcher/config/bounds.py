"""Bounds: where a numeric key of the config schema (launcher.config.sections) must lie.

``num(default, ge=.., gt=.., le=.., lt=..)`` declares a numeric field and puts its ``Bounds`` in the
field's metadata; ``launcher.config.schema.leaves()`` lists them with every key, and
launcher.config.rule_rows generates one rule row per bounded key from them (floats must also be finite).
A new numeric key is checked by declaring its bounds. Pure (stdlib only).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

INT64_MAX = 2**63 - 1  # numpy/torch seeds, and every int a C library reads as int64


@dataclass(frozen=True)
class Bounds:
    """Where a numeric key's value must lie: ``ge``/``gt`` (>=, >) below, ``le``/``lt`` (<=, <) above;
    None = unbounded on that side. ``why`` (appended to the problem) and ``fix`` (replaces the
    default fix) explain a bound that is not obvious."""

    ge: Optional[float] = None
    gt: Optional[float] = None
    le: Optional[float] = None
    lt: Optional[float] = None
    why: str = ""
    fix: str = ""

    def describe(self) -> str:
        """">= 1", "> 0", "in [0, 1)", "in [0, 40]"."""
        lo = self.ge if self.ge is not None else self.gt
        hi = self.le if self.le is not None else self.lt
        if lo is not None and hi is not None:
            return (f"in {'[' if self.ge is not None else '('}{show_number(lo)}, {show_number(hi)}"
                    f"{']' if self.le is not None else ')'}")
        if lo is not None:
            return f"{'>=' if self.ge is not None else '>'} {show_number(lo)}"
        if hi is not None:
            return f"{'<=' if self.le is not None else '<'} {show_number(hi)}"
        return "a number"


def show_number(x: float) -> str:
    if x == INT64_MAX:
        return "2**63-1"
    return str(int(x)) if float(x).is_integer() else str(x)


def num(default: Any, *, ge: Optional[float] = None, gt: Optional[float] = None, le: Optional[float] = None,
        lt: Optional[float] = None, why: str = "", fix: str = "") -> Any:
    """A numeric field and its bounds (``leaves()`` reads them; launcher.config.rules checks them)."""
    return field(default=default, metadata={"bounds": Bounds(ge, gt, le, lt, why, fix)})

