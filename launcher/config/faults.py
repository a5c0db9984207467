"""The faults a drill injects, read from the config (pure, no torch): ``train.fail_*`` (one fault) and
``train.faults`` (more, each on its own attempt: e.g. a hold on attempt 1 and another on attempt 2,
so that each of a drill's signals finds the run where it expects it, however fast the machine).

recipes.common.faults fires them in the step; launcher.training.checkpoint dies in a save for
``kill_in_save``; the rules refuse one that can never fire; preflight's short rungs drop those.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, List, Optional, Tuple

from launcher.config.schema import enum_value

SINGLE = "train.fail_at_step"  # the key of train.fail_*'s one fault (its keys have rows of their own)


@dataclass(frozen=True)
class Fault:
    """One injected fault: ``mode`` at step ``at_step`` on rank ``rank``, on attempt ``attempt``
    (None: every attempt). ``key``: the config key that gave it (for messages)."""

    at_step: int
    rank: int = 0
    mode: str = "exception"
    attempt: Optional[int] = None
    key: str = SINGLE
    node: Optional[str] = None  # only where its rank runs on this node (the scheduler's name)

    @property
    def listed(self) -> bool:
        """A train.faults entry (not train.fail_*'s fault)."""
        return self.key != SINGLE

    def on(self, attempt: int) -> bool:
        """Whether it fires on this attempt."""
        return self.attempt is None or int(self.attempt) == int(attempt)

    def override(self) -> str:
        """As one element of a ``train.faults=[...]`` override."""
        items = [f"at_step:{self.at_step}", f"rank:{self.rank}", f"mode:{self.mode}"]
        items += [f"attempt:{self.attempt}"] if self.attempt is not None else []
        return "{" + ",".join(items + ([f"node:{self.node}"] if self.node else [])) + "}"


def _get(x: Any, key: str, default: Any = None) -> Any:
    return x.get(key, default) if hasattr(x, "get") else getattr(x, key, default)


def faults(train: Any) -> List[Fault]:
    """Every fault ``train`` (the config's train section, typed or plain) injects, train.fail_* first."""
    out: List[Fault] = []
    if _get(train, "fail_at_step") is not None:
        attempt = _get(train, "fail_attempt")
        out.append(Fault(int(_get(train, "fail_at_step")), int(_get(train, "fail_rank", 0) or 0),
                         enum_value(_get(train, "fail_mode", "exception")), None if attempt is None else int(attempt)))
    for i, f in enumerate(_get(train, "faults") or []):
        attempt = _get(f, "attempt")
        node = _get(f, "node")
        out.append(Fault(int(_get(f, "at_step")), int(_get(f, "rank", 0) or 0),
                         enum_value(_get(f, "mode", "exception")), None if attempt is None else int(attempt),
                         key=f"train.faults[{i}]", node=str(node) if node else None))
    return out


def requeue_step(train: Any, attempt: int) -> Optional[int]:
    """The step after which this attempt stops as a time-limit signal stops it (mode ``requeue``: the
    checkpoint, the stop, the requeue), if any fault asks for it."""
    steps = [f.at_step for f in faults(train) if f.mode == "requeue" and f.on(attempt)]
    return min(steps) if steps else None


def requeue_faults(step: Optional[int]) -> str:
    """The ``train.faults`` override of one ``requeue`` stop after ``step`` on the first attempt (none:
    ``[]``), spaced so that Hydra's override grammar and a YAML dotlist (an archived run's) both read it."""
    return f"train.faults=[{{at_step: {step}, mode: requeue, attempt: 1}}]" if step else "train.faults=[]"


def listed_problems(train: Any, steps: int, world: int) -> List[Tuple[str, str]]:
    """``train.faults`` entries that can never fire: a step outside 1..steps, a rank the job has not, an
    attempt before the first (train.fail_* has rows of its own, from the schema's bounds)."""
    out: List[Tuple[str, str]] = []
    for f in (f for f in faults(train) if f.listed):
        if f.at_step > steps:
            out.append((f"{f.key}.at_step", f"step {f.at_step} comes after the last step (train.steps={steps}): "
                                            "the fault never fires"))
        if f.at_step < 1:
            out.append((f"{f.key}.at_step", f"step {f.at_step}: steps count from 1, the fault never fires"))
        if not 0 <= f.rank < world:
            out.append((f"{f.key}.rank", f"{f.rank} is not a rank of a {world}-process job"))
        if f.attempt is not None and f.attempt < 1:
            out.append((f"{f.key}.attempt", f"attempt {f.attempt}: attempts count from 1 (null: every attempt)"))
    return out


def kept(train: Any, steps: int, world: int) -> Tuple[str, ...]:
    """The overrides that drop the faults a shorter or smaller run never reaches (preflight's rungs):
    ``train.fail_at_step=null`` and the ``train.faults`` list of those that still fire."""
    every = faults(train)
    fits = [f.at_step <= steps and f.rank < world for f in every]
    out: List[str] = []
    if any(not f.listed and not ok for f, ok in zip(every, fits)):
        out.append(f"{SINGLE}=null")
    listed = [(f, ok) for f, ok in zip(every, fits) if f.listed]
    if not all(ok for _, ok in listed):
        out.append("train.faults=[" + ",".join(f.override() for f, ok in listed if ok) + "]")
    return tuple(out)


def none() -> Iterable[str]:
    """The overrides that inject no fault at all."""
    return ("train.fail_at_step=null", "train.faults=[]")
