"""Sweeps as a whole (pure functions, no I/O): how the points of a launch split into arrays under the
scheduler's limits, the job name a submission carries, which overrides a sweep varies, and the
results table (`launcher results`), sorted best first by an objective.
"""
from __future__ import annotations

import csv
import io
import math
import re
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

# ---- arrays under the scheduler's limits --------------------------------------------------------


MAX_JOB_COUNT = "MaxJobCount"


@dataclass(frozen=True)
class ArrayLimits:
    """What one launch may submit: the most tasks one array holds (Slurm's MaxArraySize: the max array
    index + 1), the most jobs one user may have queued (MaxSubmitJobs; every array task counts as a
    job), and how many that user has queued already. None: no limit."""

    max_array_size: Optional[int] = None
    max_submit_jobs: Optional[int] = None
    queued: int = 0
    # which limit max_submit_jobs is, as the refusal names it (MAX_JOB_COUNT: the controller's, all users;
    # "MaxSubmitJobs of association a, sacctmgr", ...)
    bound: str = "MaxSubmitJobs"

    @property
    def room(self) -> float:
        """Jobs that may be queued now (inf: no limit). slurmctld refuses an array that would bring
        the jobs it holds up to MaxJobCount, so that bound leaves one more."""
        if self.max_submit_jobs is None:
            return math.inf
        return int(self.max_submit_jobs) - int(self.queued) - (1 if self.bound == MAX_JOB_COUNT else 0)

    def with_overrides(self, max_array_size: Optional[int], max_submit_jobs: Optional[int]) -> ArrayLimits:
        """cluster.max_array_size / cluster.max_submit_jobs, when set, replace what the scheduler said."""
        if max_submit_jobs:
            return ArrayLimits(max_array_size or self.max_array_size, max_submit_jobs, self.queued)
        return ArrayLimits(max_array_size or self.max_array_size, self.max_submit_jobs, self.queued, self.bound)


@dataclass(frozen=True)
class Chunk:
    """One submission: points ``start:stop`` of group ``group``, throttled to ``parallelism`` tasks at once."""

    group: int
    start: int
    stop: int
    parallelism: int

    def __len__(self) -> int:
        return self.stop - self.start


class Unschedulable(ValueError):
    """The scheduler would refuse the request whatever the moment: refused before anything is written."""


class TooManyJobs(Unschedulable):
    """The sweep needs more jobs than the scheduler lets this user queue."""


def plan_arrays(sizes: Sequence[int], limits: ArrayLimits, parallelism: Sequence[int]) -> List[Chunk]:
    """Split groups of points (``sizes[g]`` points in group g, ``parallelism[g]`` tasks of it at once)
    into arrays of at most ``limits.max_array_size`` tasks. The throttle of a group split into n arrays
    is shared out between them (each gets k // n, the first k % n one more, at least 1), so a sweep never
    runs more than k tasks at once when k >= n. Raises TooManyJobs, before anything is submitted, when the
    sweep needs more jobs than ``max_submit_jobs - queued``."""
    total = sum(int(n) for n in sizes)
    if total > limits.room:
        room = max(int(limits.room), 0)
        if limits.bound == MAX_JOB_COUNT:
            raise TooManyJobs(
                f"the sweep has {total} points, but the Slurm controller holds at most {limits.max_submit_jobs} "
                f"jobs (MaxJobCount, every user's, ended ones too for a while; each array task counts) and holds "
                f"{limits.queued} now: {room} can be submitted now (slurmctld refuses a submission that would "
                "bring it up to MaxJobCount, so one slot stays free). Nothing was submitted; split the sweep or "
                "wait for queued jobs to end")
        already = f", {limits.queued} already queued or running" if limits.queued else ""
        raise TooManyJobs(
            f"the sweep has {total} points, but the cluster lets one user queue {limits.max_submit_jobs} jobs "
            f"({limits.bound}; each array task counts{already}): {room} can be submitted now. "
            "Nothing was submitted; launch fewer points at once, wait for queued jobs to end, or cancel "
            "some (launcher cancel)")
    size = int(limits.max_array_size) if limits.max_array_size else None
    out: List[Chunk] = []
    for g, n in enumerate(sizes):
        n = int(n)
        if n <= 0:
            continue
        step = size or n
        bounds = [(s, min(s + step, n)) for s in range(0, n, step)]
        k = max(1, int(parallelism[g]))
        share, extra = divmod(k, len(bounds))
        for j, (s, e) in enumerate(bounds):
            out.append(Chunk(g, s, e, max(1, share + (1 if j < extra else 0))))
    return out


def wave_cut(total: int, room: float) -> int:
    """How many of a sweep's ``total`` points are queued now when ``room`` more jobs may be queued
    (launcher.submit.waves): every one when they fit; else the room less one slot, which the wave job
    that queues the rest takes (0: not even one point and that job fit)."""
    if total <= room:
        return int(total)
    return max(int(room) - 1, 0)


def first_points(groups: Sequence[Sequence[Any]], n: int) -> List[List[Any]]:
    """The first ``n`` points of ``groups`` taken in order, group by group (empty groups dropped)."""
    out: List[List[Any]] = []
    for g in groups:
        take = list(g[:max(n, 0)])
        n -= len(take)
        if take:
            out.append(take)
    return out


def job_name(names: Sequence[str], sweep_id: str) -> str:
    """The job name of a submission: the name its points share, else the sweep's."""
    distinct = sorted({str(n) for n in names})
    return distinct[0] if len(distinct) == 1 else f"sweep-{sweep_id}"


# ---- what a sweep varies ------------------------------------------------------------------------


def parse_overrides(overrides: Sequence[str]) -> Dict[str, str]:
    """Hydra override strings -> {key: value text} (``+key``/``++key`` count as ``key``; ``~key`` deletes)."""
    out: Dict[str, str] = {}
    for o in overrides:
        key, sep, value = str(o).partition("=")
        key = key.lstrip("+")
        if key.startswith("~"):
            out[key[1:]] = "<deleted>"
        elif sep and key:
            out[key] = value
    return out


def swept_keys(points: Sequence[Dict[str, str]]) -> List[str]:
    """The override keys whose value differs between points (or that only some points set), in the
    order they first appear."""
    keys: List[str] = []
    for p in points:
        keys.extend(k for k in p if k not in keys)
    return [k for k in keys if len({p.get(k) for p in points}) > 1]


# ---- results ------------------------------------------------------------------------------------

# a larger value is better when the key names a rate or a score; anything else (losses, times,
# memory, perplexity) is minimised
_RATES = ("per_s", "throughput", "tflops", "mfu")
_SCORES = {"acc", "accuracy", "score", "reward", "f1", "bleu", "auc", "precision", "recall"}


def higher_is_better(objective: str) -> bool:
    """Whether a larger ``objective`` is better: throughput-like keys (``*_per_s``: tokens/samples per
    second, ``throughput``, ``tflops``, ``mfu``) and scores (a word of the key is accuracy, acc, f1, score,
    reward, ...) are maximised; everything else (losses, times) minimised. A leading ``+`` or ``-``
    forces the direction (``+final_loss``: maximise, ``-mfu``: minimise)."""
    key = objective.strip()
    if key[:1] in "+-" and key:
        return key[0] == "+"
    low = key.lower()
    words = set(re.split(r"[^a-z0-9]+", low))
    return any(r in low for r in _RATES) or bool(words & _SCORES)


def objective_key(objective: str) -> str:
    return objective.strip().lstrip("+-")


def number(value: Any) -> Optional[float]:
    if isinstance(value, bool) or value is None:
        return None
    try:
        f = float(value)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def result_row(run_id: str, status: str, overrides: Dict[str, str], summary: Dict[str, Any],
               keys: Sequence[str], objective: str) -> Dict[str, Any]:
    """One point of the results table: its swept override values, status, final metrics and objective."""
    row: Dict[str, Any] = {"run_id": run_id, "status": status}
    for k in keys:
        row[k] = overrides.get(k, "")
    row["final_loss"] = summary.get("final_loss")
    row["tokens_per_s"] = summary.get("mean_tokens_per_s")
    row["steps"] = summary.get("steps")
    key = objective_key(objective)
    value = summary.get(key)
    if value is None and key == "tokens_per_s":  # the table's name for the summary's mean
        value = summary.get("mean_tokens_per_s")
    row["objective"] = number(value)
    return row


def sort_results(rows: List[Dict[str, Any]], objective: str) -> List[Dict[str, Any]]:
    """Best first: completed runs with an objective value, by value (direction: higher_is_better),
    then runs with a value that did not complete, then those without one (in their original order)."""
    sign = -1.0 if higher_is_better(objective) else 1.0

    def key(ir):
        i, r = ir
        v = r.get("objective")
        if v is None:
            return (2, 0.0, i)
        return (0 if r.get("status") == "completed" else 1, sign * float(v), i)

    return [r for _, r in sorted(enumerate(rows), key=key)]


def columns(keys: Sequence[str]) -> List[str]:
    return ["rank", "run_id", *keys, "status", "final_loss", "tokens_per_s", "steps", "objective"]


def ranked(rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Rows numbered 1.. in their (sorted) order; rows without an objective get no rank."""
    out, n = [], 0
    for r in rows:
        if r.get("objective") is not None:
            n += 1
            out.append({**r, "rank": n})
        else:
            out.append({**r, "rank": ""})
    return out


def to_csv(rows: List[Dict[str, Any]], keys: Sequence[str]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=columns(keys), extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({k: ("" if r.get(k) is None else r.get(k)) for k in columns(keys)})
    return buf.getvalue()


def current_curve(metrics: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The per-step rows the run's latest attempt stands on: after the last place where the step went
    back (an attempt that started again from an earlier step appended after the previous one's rows)."""
    start = 0
    for i in range(1, len(metrics)):
        if (metrics[i].get("step") or 0) <= (metrics[i - 1].get("step") or 0):
            start = i
    # rows before ``start`` up to the step it restarted from are still part of the curve
    first = metrics[start].get("step") or 0 if metrics else 0
    return [r for r in metrics[:start] if (r.get("step") or 0) < first] + list(metrics[start:])


def fmt(value: Any) -> str:
    """A table cell: floats to 4 significant digits (large ones with thousands separators)."""
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"
    return str(value)
