"""Population-based training over a sweep's points (``sweep=pbt``), the rule alone (pure: no files, no jobs).

The points of ``launch -m`` are the population. Every ``interval`` steps (a generation's boundary:
interval, 2 x interval, ... < train.steps) each member reports its objective and pauses; once every
member reported (or ended: the worst value), the generation is decided here: the members ranked
(ties: the lower index; NaN and a missing report are the worst), the bottom ``max(1, floor(n x
quantile))`` each **exploit** a member of the top as many (they copy its checkpoint at that step) and
**explore** (the donor's values of the ``explore`` keys, each times a factor of ``factors``). Which
donor and which factors: a ``random.Random`` seeded by (seed, generation, member), so a decision is a
function of the reports alone. Nobody is pruned: every member runs to train.steps.

The node side (launcher.features.pbt.population) keeps reports, decisions and lineages in the sweep dir.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from launcher.features.asha.schedule import mode_of, ranked, scheduled, steps_of, value_of

if TYPE_CHECKING:
    from launcher.config.schema import RunConfig


@dataclass(frozen=True)
class Rule:
    """The scheduler of one PBT sweep, as its points' config says (``sweep.*``, ``train.steps``, ``seed``).
    It has ``rungs`` and ``pause_rungs`` as launcher.features.asha.schedule.Rule has: the step loop pauses
    at them alike."""

    interval: int
    quantile: float = 0.25
    explore: Tuple[str, ...] = ()
    factors: Tuple[float, ...] = (0.8, 1.25)
    mode: str = "min"
    seed: int = 0
    steps: int = 0
    replay: Optional[str] = None  # a sweep dir whose recorded decisions this one follows (launcher reproduce)

    @classmethod
    def of(cls, cfg: RunConfig) -> Optional[Rule]:
        """The rule of a run config (plain dicts or OmegaConf); None: not a PBT sweep."""
        sweep = scheduled(cfg, "pbt")
        if sweep is None:
            return None
        seed = value_of(sweep, "seed")
        return cls(interval=int(value_of(sweep, "interval") or 0), quantile=float(value_of(sweep, "quantile") or 0.25),
                   explore=tuple(str(k) for k in (value_of(sweep, "explore") or ())),
                   factors=tuple(float(f) for f in (value_of(sweep, "factors") or (0.8, 1.25))),
                   mode=mode_of(sweep),
                   seed=int(seed if seed is not None else (value_of(cfg, "seed") or 0)),
                   steps=steps_of(cfg),
                   replay=value_of(sweep, "replay") or None)

    @property
    def pause_rungs(self) -> Tuple[int, ...]:
        """The generations' boundaries (steps), each < train.steps."""
        return boundaries(self.interval, self.steps)

    @property
    def rungs(self) -> Tuple[int, ...]:
        """The boundaries and train.steps (the last report: every member's end)."""
        return self.pause_rungs + ((self.steps,) if self.steps else ())


def boundaries(interval: int, steps: int) -> Tuple[int, ...]:
    """interval, 2 x interval, ... < steps."""
    return tuple(range(interval, steps, interval)) if interval > 0 else ()


def lookup(tree: Mapping[str, Any], key: str) -> Tuple[bool, Any]:
    """(found, value) of dotted ``key`` in a nested mapping."""
    node: Any = tree
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return False, None
        node = node[part]
    return True, node


def problems(sweep: Mapping[str, Any], steps: int, tree: Mapping[str, Any]) -> List[Tuple[str, str, str]]:
    """(key, problem, fix) for each thing wrong with a PBT sweep's settings (launch refuses them);
    ``tree``: the run's config (an explored key must be a number there)."""
    out: List[Tuple[str, str, str]] = []
    interval = int(sweep.get("interval") or 0)
    if interval <= 0:
        out.append(("sweep.interval", f"{interval}: a generation is a positive number of steps",
                    "set sweep.interval to the steps between exploits (e.g. sweep.interval=2)"))
    elif interval >= steps:
        out.append(("sweep.interval", f"{interval} >= train.steps={steps}: no generation boundary before the end",
                    f"set sweep.interval below train.steps (e.g. {max(1, steps // 3)})"))
    q = float(sweep.get("quantile") if sweep.get("quantile") is not None else 0.25)
    if not 0 < q <= 0.5:
        out.append(("sweep.quantile", f"{q} is outside (0, 0.5]: the bottom and the top share it",
                    "set sweep.quantile in (0, 0.5] (0.25: the bottom quarter exploits the top quarter)"))
    keys = [str(k) for k in (sweep.get("explore") or [])]
    for k in keys:
        found, value = lookup(tree, k)
        if not found:
            out.append((k, f"sweep.explore names {k!r}, which is not a key of the config",
                        "name keys of the config in sweep.explore (e.g. sweep.explore=[optim.lr])"))
        elif isinstance(value, bool) or not isinstance(value, (int, float)):
            out.append((k, f"sweep.explore names {k!r}, whose value {value!r} is not a number to perturb",
                        "explore numeric keys only (e.g. optim.lr)"))
    factors = [float(f) for f in (sweep.get("factors") if sweep.get("factors") is not None else [0.8, 1.25])]
    if keys and (not factors or any(not f > 0 for f in factors)):
        out.append(("sweep.factors", f"{factors}: explore multiplies by one of these, each > 0",
                    "set sweep.factors=[0.8,1.25]"))
    return out


def cut(n: int, quantile: float) -> int:
    """How many members of ``n`` are the bottom (and the top): max(1, floor(n x quantile)); 0 below 2."""
    return 0 if n < 2 else min(n // 2, max(1, int(math.floor(n * quantile + 1e-9))))


@dataclass(frozen=True)
class Change:
    """One member's exploit and explore at a generation: it takes ``donor``'s checkpoint and trains on
    with ``after`` (its values were ``before``)."""

    member: int
    donor: int
    before: Dict[str, Any]
    after: Dict[str, Any]
    factors: Dict[str, float] = field(default_factory=dict)

    def to_json(self) -> Dict[str, Any]:
        return {"member": self.member, "donor": self.donor, "before": dict(self.before), "after": dict(self.after),
                "factors": dict(self.factors)}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Change:
        return cls(int(d["member"]), int(d["donor"]), dict(d.get("before") or {}), dict(d.get("after") or {}),
                   dict(d.get("factors") or {}))


@dataclass(frozen=True)
class Generation:
    """A generation decided: the ranking (best first) and the changes."""

    generation: int
    step: int
    ranking: Tuple[int, ...]
    changes: Tuple[Change, ...]

    def change_of(self, member: int) -> Optional[Change]:
        return next((c for c in self.changes if c.member == member), None)

    def to_json(self) -> Dict[str, Any]:
        return {"generation": self.generation, "step": self.step, "ranking": list(self.ranking),
                "changes": [c.to_json() for c in self.changes]}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Generation:
        return cls(int(d["generation"]), int(d["step"]), tuple(int(p) for p in d.get("ranking") or ()),
                   tuple(Change.from_json(c) for c in d.get("changes") or ()))


def rng(seed: int, generation: int, member: int) -> random.Random:
    """The choices of one member at one generation (a str seed: the same in every process and Python)."""
    return random.Random(f"pbt:{int(seed)}:{int(generation)}:{int(member)}")


def decide(rule: Rule, generation: int, values: Mapping[int, Optional[float]],
           current: Mapping[int, Mapping[str, Any]], alive: Optional[Iterable[int]] = None) -> Generation:
    """The decision at ``generation`` (its index) on every member's reported ``values`` (None: no report)
    and its ``current`` values of the explored keys. ``alive``: the members that can go on (default: all
    that reported); a donor is one of them, and only they exploit."""
    order = ranked(dict(values), rule.mode)
    can = set(values) if alive is None else set(alive)
    k = cut(len(order), rule.quantile)
    top = [p for p in order[:k] if p in can and _number(values.get(p))]
    bottom = [p for p in order[len(order) - k:] if p in can] if k else []
    changes: List[Change] = []
    for m in bottom:
        if not top or m in top:
            continue
        r = rng(rule.seed, generation, m)
        donor = top[r.randrange(len(top))]
        factors = {key: rule.factors[r.randrange(len(rule.factors))] for key in rule.explore}
        after = {key: _times(current[donor][key], f) for key, f in factors.items()}
        changes.append(Change(m, donor, {key: current[m].get(key) for key in rule.explore}, after, factors))
    step = rule.pause_rungs[generation] if generation < len(rule.pause_rungs) else 0
    return Generation(generation, step, tuple(order), tuple(changes))


def _number(v: Any) -> bool:
    return v is not None and not (isinstance(v, float) and math.isnan(v))


def _times(value: Any, factor: float) -> Any:
    """The perturbed value: an int key stays an int (at least 1 away from 0 where it was)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return int(round(value * factor))
    return float(value) * factor


# ---- reading the record ---------------------------------------------------------------------------


def generations(rows: Iterable[Mapping[str, Any]]) -> Dict[int, Generation]:
    """The decided generations a sweep's record holds (rows of kind ``generation``)."""
    return {int(r["generation"]): Generation.from_json(r) for r in rows if r.get("kind") == "generation"}


def lineage_line(member: int, rows: Sequence[Mapping[str, Any]]) -> str:
    """One member's lineage, compact: ``gen 0: from 2@step 2, optim.lr 0.001->0.00125; ...``."""
    parts = []
    for row in rows:
        before, after = row.get("before") or {}, row.get("after") or {}
        vals = ", ".join(f"{k} {_short(before.get(k))}->{_short(v)}" for k, v in after.items())
        parts.append(f"gen {row['generation']}: from {row['donor']}@step {row['step']}" + (f", {vals}" if vals else ""))
    return f"member {member}: " + ("; ".join(parts) if parts else "its own line (no exploit)")


def _short(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def describe(generations_: Mapping[int, Generation], lineages: Mapping[int, Sequence[Mapping[str, Any]]],
             final: Mapping[int, Optional[float]], mode: str = "min") -> List[str]:
    """The generations and every member's lineage in lines (`launcher status`, `results`, `report`)."""
    lines = ["gen  step  ranking (best first)  exploits"]
    for g in sorted(generations_):
        d = generations_[g]
        ex = ", ".join(f"{c.member}<-{c.donor}" for c in d.changes) or "-"
        lines.append(f"{g:>3}  {d.step:>4}  {' '.join(map(str, d.ranking)):<20}  {ex}")
    for m in sorted(lineages):
        end = final.get(m)
        lines.append(lineage_line(m, lineages[m]) + (f"  (final {end:.6g})" if end is not None else ""))
    best = ranked(dict(final), mode)[0] if final else None
    if best is not None and final.get(best) is not None:
        lines.append(f"best: member {best} ({final[best]:.6g})")
    return lines
