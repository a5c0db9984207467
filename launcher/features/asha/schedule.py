"""Successive halving over a sweep's points (``sweep=asha``), the rule alone (pure: no files, no jobs).

A rung is a step budget. Every point enters the first rung; at a rung each point still alive reports
its objective (a metrics row key, at that step) and pauses; the rung is decided once every point
that entered it reported or ended without a report (failed, cancelled: the worst value). The best
``keep(n, reduction)`` = max(1, n // reduction) go on to the next rung (promoted), the rest are
pruned. 16 points with rungs [5, 15, 45] and reduction 3: 16 -> 5 -> 1. Ties go to the lower point
index; NaN and a missing report are the worst values. A rung at ``train.steps`` is the end: its
points complete there (their report is recorded, nothing is decided).

Asynchronous (``sweep.asynchronous``): a point that reports goes on at once when it is among the best
``len(reports) // reduction`` of the >= ``reduction`` reports at its rung so far; once the rung is
complete, the points not promoted are pruned.

The node side (launcher.features.asha.rungs) keeps reports and decisions in the sweep dir and calls these.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, Iterable, List, Mapping, Optional, Sequence, Set, Tuple

if TYPE_CHECKING:
    from launcher.config.schema import RunConfig


@dataclass(frozen=True)
class Rule:
    """The scheduler of one sweep, as its points' config says (``sweep.*``, ``train.steps``)."""

    rungs: Tuple[int, ...]
    reduction: int
    mode: str = "min"
    asynchronous: bool = False
    steps: int = 0  # train.steps: a rung there is the end, not a pause

    @classmethod
    def of(cls, cfg: RunConfig) -> Optional[Rule]:
        """The rule of a run config (plain dicts or OmegaConf); None: the sweep has no scheduler."""
        sweep = scheduled(cfg, "asha")
        if sweep is None:
            return None
        return cls(rungs=tuple(int(r) for r in (value_of(sweep, "rungs") or ())),
                   reduction=int(value_of(sweep, "reduction") or 3), mode=mode_of(sweep),
                   asynchronous=bool(value_of(sweep, "asynchronous")), steps=steps_of(cfg))

    @property
    def pause_rungs(self) -> Tuple[int, ...]:
        """The rungs a point pauses at (those before train.steps)."""
        return tuple(r for r in self.rungs if not self.steps or r < self.steps)

    def rung_at(self, step: int) -> Optional[int]:
        """The index of the rung at ``step`` (None: no rung there)."""
        return self.rungs.index(step) if step in self.rungs else None


def mode_of(sweep: Any) -> str:
    """sweep.mode of a scheduled sweep group ("min" or "max"; an enum read as its value)."""
    mode = value_of(sweep, "mode") or "min"
    return str(getattr(mode, "value", mode))


def steps_of(cfg: RunConfig) -> int:
    """train.steps of a run config (0: unset): a scheduler's boundary there is the end, not a pause."""
    return int(value_of(value_of(cfg, "train") or {}, "steps") or 0)


def scheduled(cfg: RunConfig, scheduler: str) -> Any:
    """The config's sweep group when its sweep.scheduler is ``scheduler`` (None: another or none)."""
    sweep = value_of(cfg, "sweep") or {}
    name = value_of(sweep, "scheduler")
    return sweep if name and str(getattr(name, "value", name)) == scheduler else None


def value_of(node: Any, key: str) -> Any:
    """``node[key]`` of a plain dict or an OmegaConf node, or an attribute of a record (None: absent)."""
    if node is None:
        return None
    if hasattr(node, "get"):
        return node.get(key)
    return getattr(node, key, None)


def problems(sweep: Mapping[str, Any], steps: int) -> List[Tuple[str, str, str]]:
    """(key, problem, fix) for each thing wrong with a scheduler's settings (pure: launch refuses them)."""
    out: List[Tuple[str, str, str]] = []
    rungs = [int(r) for r in (sweep.get("rungs") or [])]
    if not rungs:
        out.append(("sweep.rungs", "sweep=asha needs at least one rung (a step budget)",
                    "set sweep.rungs=[5,15,45] (steps, increasing)"))
    if any(r < 1 for r in rungs):
        out.append(("sweep.rungs", f"{rungs}: every rung is a step >= 1", "give steps >= 1"))
    if any(b <= a for a, b in zip(rungs, rungs[1:])):
        out.append(("sweep.rungs", f"{rungs} is not increasing", "list the rungs in increasing order, each once"))
    beyond = [r for r in rungs if r > steps]
    if beyond:
        out.append(("sweep.rungs", f"rung {beyond[0]} is beyond train.steps={steps}",
                    f"keep every rung <= train.steps, or raise train.steps to {max(rungs)}"))
    reduction = int(sweep.get("reduction") or 0)
    if reduction < 2:
        out.append(("sweep.reduction", f"{reduction}: a reduction factor below 2 prunes nothing",
                    "set sweep.reduction to 2 or more"))
    return out


def objective_problem(objective: str, declared: Sequence[str]) -> Optional[str]:
    """Why ``objective`` is no key a recipe that declares its metrics rows (``declared``: fnmatch
    patterns; empty: undeclared, anything goes) reports; None: it is one."""
    import fnmatch

    if not declared or any(fnmatch.fnmatchcase(objective, d) for d in declared):
        return None
    return f"{objective!r} is no key of the recipe's metrics rows ({', '.join(declared)})"


def keep(n: int, reduction: int) -> int:
    """How many of ``n`` points a rung promotes."""
    return max(1, n // max(1, int(reduction))) if n > 0 else 0


def _score(value: Optional[float], mode: str) -> float:
    """Lower is better; a missing or NaN value is the worst."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return math.inf
    return float(value) if mode == "min" else -float(value)


def ranked(values: Mapping[int, Optional[float]], mode: str = "min") -> List[int]:
    """Points best first (ties: the lower point index)."""
    return sorted(values, key=lambda p: (_score(values[p], mode), p))


@dataclass(frozen=True)
class Decision:
    """A rung decided: who goes on, who is pruned."""

    rung: int  # the rung's index
    promoted: Tuple[int, ...]
    pruned: Tuple[int, ...]
    complete: bool = True  # every entrant reported or ended (asynchronous: partial decisions are not)

    def to_json(self) -> Dict[str, Any]:
        return {"rung": self.rung, "promoted": list(self.promoted), "pruned": list(self.pruned),
                "complete": self.complete}


@dataclass
class State:
    """What the sweep dir holds, read: each rung's reports (point -> value; None: ended without one)
    and the decisions so far (rung -> Decision)."""

    points: Tuple[int, ...]
    reports: Dict[int, Dict[int, Optional[float]]] = field(default_factory=dict)
    ended: Set[int] = field(default_factory=set)  # points whose run ended without reaching its next rung
    decisions: Dict[int, Decision] = field(default_factory=dict)

    def entrants(self, rung: int) -> Tuple[int, ...]:
        """The points that entered rung ``rung`` (None known yet for a rung whose predecessor is undecided
        in the synchronous rule: the promoted ones so far)."""
        if rung == 0:
            return tuple(self.points)
        before = self.decisions.get(rung - 1)
        return tuple(before.promoted) if before is not None else ()


def decide(rule: Rule, state: State, rung: int) -> Optional[Decision]:
    """The decision at pause rung ``rung`` (its index) on what ``state`` holds; None: not yet decidable.
    A decision already made is returned as it was (decisions are never changed)."""
    made = state.decisions.get(rung)
    if made is not None and made.complete:
        return made
    entrants = state.entrants(rung)
    if rung > 0 and (rung - 1) not in state.decisions:
        return None
    reports = state.reports.get(rung, {})
    values: Dict[int, Optional[float]] = {p: reports.get(p) for p in entrants}
    done = {p for p in entrants if p in reports or p in state.ended}
    complete = bool(entrants) and len(done) == len(entrants) and (rung == 0 or state.decisions[rung - 1].complete)
    if not rule.asynchronous:
        if not complete:
            return None
        alive = [p for p in ranked(values, rule.mode) if values[p] is not None]
        promoted = tuple(sorted(alive[:keep(len(entrants), rule.reduction)]))
        return Decision(rung, promoted, tuple(p for p in entrants if p not in promoted))
    # asynchronous: the best len(reports) // reduction of the reports so far go on, never taken back
    already = set(made.promoted) if made is not None else set()
    reported = {p: v for p, v in reports.items() if p in entrants and v is not None}
    if len(reported) >= rule.reduction:
        already |= set(ranked(reported, rule.mode)[:len(reported) // rule.reduction])
    if complete:
        if not already and reported:  # at least one goes on
            already = {ranked(reported, rule.mode)[0]}
        return Decision(rung, tuple(sorted(already)), tuple(p for p in entrants if p not in already))
    return Decision(rung, tuple(sorted(already)), (), complete=False)


def verdict(rule: Rule, state: State, point: int, rung: int) -> str:
    """What a point that reported at pause rung ``rung`` does: "promoted" (goes on), "pruned", or "wait"
    (paused until the rung is decided)."""
    d = decide(rule, state, rung)
    if d is None:
        return "wait"
    if point in d.promoted:
        return "promoted"
    if point in d.pruned:
        return "pruned"
    return "wait"


def decide_all(rule: Rule, state: State) -> List[Decision]:
    """Every pause rung decided on ``state`` in order, each decision added to it (a rung is decided
    only after the one before; asynchronous: the next rung's entrants are the ones promoted so far);
    returns the new or changed ones."""
    out: List[Decision] = []
    for i, _ in enumerate(rule.pause_rungs):
        d = decide(rule, state, i)
        if d is None:
            break
        if state.decisions.get(i) != d:
            state.decisions[i] = d
            out.append(d)
    return out


def counts(state: State, rungs: Sequence[int]) -> List[int]:
    """Points that reported at each rung (the rung table's first column)."""
    return [len(state.reports.get(i, {})) for i, _ in enumerate(rungs)]




def state_from(rows: Iterable[Mapping[str, Any]], points: Sequence[int], ended: Iterable[int] = ()) -> State:
    """The State the scheduler's record (rows of kind report / decision) holds; ``ended``: points whose
    run is final (failed, cancelled, completed...) as the run dirs say."""
    st = State(points=tuple(sorted(points)), ended=set(ended))
    for row in rows:
        kind, rung = row.get("kind"), row.get("rung")
        if rung is None:
            continue
        if kind == "report":
            value = row.get("value")
            st.reports.setdefault(int(rung), {})[int(row["point"])] = None if value is None else float(value)
        elif kind == "decision":
            st.decisions[int(rung)] = Decision(int(rung), tuple(row.get("promoted") or ()),
                                               tuple(row.get("pruned") or ()), bool(row.get("complete", True)))
    return st


def summary(rows: Sequence[Mapping[str, Any]], rule: Rule, points: Sequence[int]) -> Dict[str, Any]:
    """The rung table and the compute (pure): per rung its step, the points that reported, the promoted
    and pruned ones and the best value; the process-seconds the points ran (measured: each start from
    its process's start to its first step, and the step loop's segments, x ranks) against the full
    grid (each point started once: its start's cost + its seconds per step x train.steps)."""
    st = state_from(rows, points)
    table = []
    for i, step in enumerate(rule.rungs):
        reports = st.reports.get(i, {})
        d = st.decisions.get(i)
        best = ranked(reports, rule.mode)[0] if reports else None
        table.append({"rung": i, "step": step, "reported": len(reports), "points": sorted(reports),
                      "promoted": list(d.promoted) if d else None, "pruned": list(d.pruned) if d else None,
                      "decided": bool(d and d.complete), "best_point": best,
                      "best_value": reports.get(best) if best is not None else None})
    # each point: its loop seconds and steps, its starts' cost (process start to the first step)
    loop_s: Dict[int, float] = {}
    steps: Dict[int, int] = {}
    starts: Dict[int, List[float]] = {}
    for row in rows:
        if row.get("kind") in ("report", "end") and row.get("seconds") is not None:
            p, world = int(row["point"]), int(row.get("world") or 1)
            loop_s[p] = loop_s.get(p, 0.0) + float(row["seconds"]) * world
            steps[p] = steps.get(p, 0) + int(row["step"]) - int(row.get("from_step") or 0)
            if row.get("startup_s"):
                starts.setdefault(p, []).append(float(row["startup_s"]) * world)
    spent = sum(loop_s.values()) + sum(sum(v) for v in starts.values())
    # the grid: every point started once and run train.steps at its measured seconds per step
    per_point = {p: (min(starts[p]) if starts.get(p) else 0.0) + loop_s[p] / steps[p] * rule.steps
                 for p in loop_s if steps[p] > 0}
    grid = sum(per_point.values())
    grid_loop = sum(loop_s[p] / steps[p] * rule.steps for p in loop_s if steps[p] > 0)
    # a point not measured at all (it never reached a rung) costs what the measured ones cost on average
    missing = [p for p in points if p not in per_point]
    if per_point and missing:
        grid += grid / len(per_point) * len(missing)
        grid_loop += grid_loop / len(per_point) * len(missing)
    return {"rungs": table, "spent_s": round(spent, 3), "grid_s": round(grid, 3),
            "fraction": round(spent / grid, 4) if grid else None,
            "starts": sum(len(v) for v in starts.values()), "loop_s": round(sum(loop_s.values()), 3),
            "grid_loop_s": round(grid_loop, 3), "steps": sum(steps.values()), "grid_steps": len(points) * rule.steps}


def describe(summ: Mapping[str, Any]) -> List[str]:
    """The rung table and the compute in lines (`launcher status`, `results`)."""
    lines = ["rung  step  reported  promoted  pruned  best"]
    for r in summ["rungs"]:
        prom = "-" if r["promoted"] is None else str(len(r["promoted"]))
        prun = "-" if r["pruned"] is None else str(len(r["pruned"]))
        best = "" if r["best_point"] is None else f"point {r['best_point']}: {r['best_value']:.6g}" \
            if r["best_value"] is not None else f"point {r['best_point']}"
        lines.append(f"{r['rung']:>4}  {r['step']:>4}  {r['reported']:>8}  {prom:>8}  {prun:>6}  {best}")
    if summ.get("grid_s"):
        lines.append(f"compute: {summ['spent_s']:.1f} process-s spent ({summ['starts']} starts), the full grid "
                     f"~{summ['grid_s']:.1f} process-s ({100 * summ['fraction']:.0f}%); steps: {summ['steps']} of "
                     f"{summ['grid_steps']}, {summ['loop_s']:.1f} of ~{summ['grid_loop_s']:.1f} process-s")
    return lines
