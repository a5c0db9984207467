"""Stragglers: a rank that stays slower than the others, found from the step loop's own timings.

Each rank measures, per step, its own time (the step's wall time less the phases in which it waits for
the other ranks: the gradient reduction in backward, the loss all-reduce) and its data time (waiting for
its batches). In synchronous training every rank's step takes as long as the slowest one's, so the
slow rank is the one that waits least: its own time is the largest. The timings ride on the step's own
all-reduce (a slot per rank, summed: ``RunContext.stop_votes``), so every rank holds every rank's
timings, runs this same pure rule on them, and reaches the same verdict at the same step with no
collective of its own.

A rank is named when the median, over the last ``window`` steps, of its time divided by the median of
the other ranks' that step reaches ``ratio`` (own time or data time); past ``requeue_ratio`` the run
saves and its job is requeued without the rank's node (launcher.runtime.task). Both 0: off.
"""
from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass
from typing import Any, Deque, Dict, List, Mapping, Optional, Sequence

KINDS = ("own", "data")  # what is compared: the rank's own step time, its data time
# the phases of a metrics row (recipes.common.phases: ``time_<phase>_s``) in which a rank waits for the
# others (DDP's and ZeRO's gradient reduction runs inside backward); a row's ``time_own_s`` overrides
WAIT_PHASES = ("backward", "loss_sync", "grad_sync")


def own_and_data(row: Mapping[str, Any], cycle_s: float) -> tuple:
    """A rank's (own, data) seconds of a step from its metrics row and the wall time between its step
    ends (``cycle_s``): the row's ``time_own_s`` where it gives one, else the cycle less its data and
    wait phases."""
    data = float(row.get("time_data_s") or 0.0)
    if row.get("time_own_s") is not None:
        return float(row["time_own_s"]), data
    waits = sum(float(row.get(f"time_{k}_s") or 0.0) for k in WAIT_PHASES)
    return max(0.0, float(cycle_s) - data - waits), data


@dataclass(frozen=True)
class Thresholds:
    ratio: float = 1.5  # named
    requeue_ratio: float = 3.0  # saved and requeued without its node
    window: int = 20  # steps

    @property
    def on(self) -> bool:
        return self.ratio > 0 or self.requeue_ratio > 0


def thresholds_of(cfg: Mapping[str, Any]) -> Thresholds:
    """cluster.health's straggler settings (plain or typed config)."""
    cluster = cfg.get("cluster") or {}
    health = (cluster.get("health") if hasattr(cluster, "get") else None) or {}
    if not bool(health.get("enabled", True)):
        return Thresholds(0.0, 0.0)
    return Thresholds(float(health.get("straggler_ratio", 1.5) or 0.0),
                      float(health.get("straggler_requeue_ratio", 3.0) or 0.0),
                      max(2, int(health.get("straggler_window", 20) or 20)))


@dataclass(frozen=True)
class Finding:
    rank: int
    kind: str  # "own" or "data"
    ratio: float  # the median of its ratios over the window
    requeue: bool  # past requeue_ratio

    def line(self, node: Optional[str] = None, window: int = 0) -> str:
        what = "its own step time (less its waits for the others)" if self.kind == "own" else "its data time"
        at = f" on node {node}" if node else ""
        return (f"rank {self.rank}{at} is a straggler: {what} is {self.ratio:.2f}x the other ranks' median "
                f"over the last {window} steps")


# a median below this counts as this much: tens of milliseconds more (rank 0's own logging in a step of a
# tiny model, a process of a host whose cores other work shares, microseconds of data time) make no
# straggler; a slow node adds far more than this to a step
FLOOR_S = 0.05


def ratios(values: Sequence[float]) -> List[float]:
    """Each rank's value over the other ranks' median (that of all the ranks from three on: one slow
    rank moves it little, and it costs one sort, not one per rank), that median at least FLOOR_S."""
    if len(values) == 2:
        a, b = values
        return [a / max(b, FLOOR_S), b / max(a, FLOOR_S)]
    base = max(statistics.median(values), FLOOR_S) if values else FLOOR_S
    return [v / base for v in values]


class Detector:
    """The rule over a run's steps (the same on every rank): ``feed`` each step's timings of every rank,
    get the straggler it finds (the worst one), if any."""

    def __init__(self, thresholds: Thresholds, world: int) -> None:
        self.t, self.world = thresholds, int(world)
        self._seen: Dict[str, List[Deque[float]]] = {k: [deque(maxlen=thresholds.window) for _ in range(world)]
                                                     for k in KINDS}

    def feed(self, own: Sequence[float], data: Sequence[float]) -> Optional[Finding]:
        if not self.t.on or self.world < 2:
            return None
        worst: Optional[Finding] = None
        low = min(x for x in (self.t.ratio, self.t.requeue_ratio) if x > 0)
        for kind, values in (("own", own), ("data", data)):
            for r, x in enumerate(ratios(values)):
                seen = self._seen[kind][r]
                seen.append(x)
                # (a rank slow over the window is slow in most of its steps: the others are not looked at)
                if x < low or len(seen) < self.t.window:
                    continue
                m = statistics.median(seen)
                named = self.t.ratio > 0 and m >= self.t.ratio
                requeue = self.t.requeue_ratio > 0 and m >= self.t.requeue_ratio
                if (named or requeue) and (worst is None or m > worst.ratio):
                    worst = Finding(r, kind, m, requeue)
        return worst
