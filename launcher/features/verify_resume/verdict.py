"""Whether a resumed run is the run that never stopped: the comparison of `launcher verify-resume`,
pure (no torch: the tensors are compared by ``tensors.py`` in a process of its own, which hands back
``Diff`` records).

Two runs of one program and config: the reference straight through, the other stopped after step K
by the product's stop path and resumed as a requeue resumes it. What both report is compared step
by step: each metrics row's deterministic numbers (timings, throughput and memory are left out), and,
where the product can read them, every tensor of each step's checkpoint. The verdict is **bitwise**,
**equal within a tolerance** (naming the largest difference) or **diverges**, naming the first step
and the first thing that differs there, with the likely cause from ``CAUSES``."""
from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Sequence

# metrics keys that measure the machine, not the training: never compared
UNCOMPARED = re.compile(r"(^time$|_s$|per_s|tflops|mfu|bytes|rss|memory|^time_|throughput|elapsed|duration)")

# component -> (what it is, what to fix); the order is the order a first difference is named in: the
# state a resume restores before the weights it updates
CAUSES: Dict[str, tuple] = {
    "rng": ("an RNG state",
            "an RNG not restored (dropout, shuffling): leave the RNG to the checkpoint (launcher.training "
            "saves and restores every rank's torch, CUDA, Python and NumPy states; do not seed again after "
            "the resume) or put your own generator in the checkpoint state"),
    "data": ("a rank's own state (the data position)",
             "the data position not restored: pass the sampler or loader to Checkpoint(per_rank=...), or "
             "make each step's batch a function of (seed, step, rank)"),
    "scheduler": ("the learning rate",
                  "the learning-rate scheduler restarted: put it in the checkpoint state "
                  "(Checkpoint(state={..., 'scheduler': sched}))"),
    "optimizer": ("optimizer state",
                  "optimizer state not restored: put the optimizer in the checkpoint state, and build it "
                  "before the resume loads it"),
    "scaler": ("the loss scaler", "the loss scaler not restored: put the GradScaler in the checkpoint state"),
    "weights": ("the weights",
                "the update differs with everything the checkpoint holds equal: state outside the "
                "checkpoint (a module global, a counter) or non-deterministic kernels"),
    "forward": ("the loss (the forward pass)",
                "the step after the resume saw other inputs with equal weights: a data loader that starts "
                "over, an RNG of the program's own not restored (dropout, shuffling), or state in a module "
                "global; make each step's batch and randomness a function of (seed, step, rank), or "
                "checkpoint them"),
    "metric": ("a reported number",
               "a number the program reports differs with its state equal: state outside the checkpoint "
               "(a module global) or non-deterministic kernels"),
    "before": ("a difference before the stop",
               "the two runs differ before any resume: the program is not deterministic (kernels, a "
               "reduction's order, an unseeded RNG); compare within a tolerance (--tolerance)"),
}
# which difference of the first differing step is named: the restored state, then what the step computed
# from the weights it resumed with (a loss row: its forward pass; its learning rate), then what it updated
FIRST_NAMED = ("rng", "data", "forward", "scheduler", "optimizer", "scaler", "weights", "metric")


@dataclass(frozen=True)
class Diff:
    """One compared value of one step that is not bitwise equal."""

    step: int
    where: str  # "metrics" or the checkpoint file
    key: str  # the metrics key, or the tensor's path in the file
    component: str  # a key of CAUSES
    max_abs: float  # the largest absolute difference (inf: shapes, types or presence differ)
    max_rel: float  # the same relative to the reference's magnitude

    def within(self, tol: float) -> bool:
        return self.max_rel <= tol or self.max_abs <= tol


@dataclass
class Verdict:
    kind: str  # "bitwise", "tolerance" or "diverges"
    stopped_at: List[int]  # the steps the interrupted runs stopped after
    steps: int
    compared: str  # what was compared
    tolerance: float = 0.0
    first_step: Optional[int] = None
    component: Optional[str] = None
    detail: str = ""
    cause: str = ""
    largest: Optional[Dict[str, Any]] = None
    equal_before: str = ""
    diffs: List[Dict[str, Any]] = field(default_factory=list)  # the first step's differences (a few)
    notes: List[str] = field(default_factory=list)  # what was left out of the comparison, and why

    def line(self) -> str:
        """The verdict in one line (what the command prints and `launcher show` repeats)."""
        at = ", ".join(str(k) for k in self.stopped_at)
        if self.kind == "bitwise":
            return f"bitwise: resumed after step {at}, every step to {self.steps} equal ({self.compared})"
        if self.kind == "tolerance":
            big = self.largest or {}
            return (f"equal within {self.tolerance:g}: resumed after step {at}; the largest difference "
                    f"{big.get('max_abs', 0):.3g} ({big.get('key')} at step {big.get('step')}; {self.compared})")
        return (f"diverges at step {self.first_step}: {self.detail}"
                + (f"; {self.equal_before}" if self.equal_before else "") + f" (resumed after step {at})")

    def to_json(self) -> Dict[str, Any]:
        return asdict(self)


def _num(v: Any) -> Optional[float]:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v)


def row_diffs(reference: Sequence[Dict[str, Any]], resumed: Sequence[Dict[str, Any]]) -> List[Diff]:
    """The metrics rows' differences, step by step: every number both rows hold (machine measures left
    out, UNCOMPARED); a step one run has and the other has not is a difference of its own."""
    a = {int(r["step"]): r for r in reference if isinstance(r.get("step"), int)}
    b = {int(r["step"]): r for r in resumed if isinstance(r.get("step"), int)}
    out: List[Diff] = []
    for step in sorted(set(a) | set(b)):
        if step not in a or step not in b:
            out.append(Diff(step, "metrics", "(the row)", "metric", math.inf, math.inf))
            continue
        for key in a[step]:
            if key == "step" or UNCOMPARED.search(key):
                continue
            x, y = _num(a[step].get(key)), _num(b[step].get(key))
            if x is None or y is None:
                if (x is None) != (y is None) or a[step].get(key) != b[step].get(key):
                    out.append(Diff(step, "metrics", key, _row_component(key), math.inf, math.inf))
                continue
            if x == y or (math.isnan(x) and math.isnan(y)):
                continue
            d = abs(x - y)
            out.append(Diff(step, "metrics", key, _row_component(key), d, d / max(abs(x), 1e-30)))
    return out


METRICS_ONLY = "metrics rows only"  # the start of ``compared`` where no checkpoint tensor could be read
LOSS_KEYS = ("loss", "train_loss", "train/loss", "lm_loss", "nll")  # a step's own loss: its forward pass


def _row_component(key: str) -> str:
    k = key.lower()
    if k in ("lr", "learning_rate") or k.startswith("lr_") or "learning_rate" in k:
        return "scheduler"
    return "forward" if k in LOSS_KEYS else "metric"


def component_of(file: str, key: str) -> str:
    """What a checkpoint tensor is, from its file and path (the names torch, DeepSpeed and the
    launcher's checkpoints use)."""
    f, k = file.lower(), key.lower()
    if f.startswith("rng") or "rng" in k or "random" in k or "generator" in k:
        return "rng"
    if f.startswith("state_rank") or "sampler" in k or "loader" in k or "data_position" in k:
        return "data"
    if "sched" in k or (("optim" in k or "optim" in f) and k.rstrip("]'\"").endswith(("lr", "initial_lr"))):
        return "scheduler"
    if "scaler" in k or "loss_scale" in k:
        return "scaler"
    if "optim" in k or "optim" in f or "exp_avg" in k or "momentum" in k:
        return "optimizer"
    return "weights"


def decide(rows: Iterable[Diff], tensors: Iterable[Diff], stopped_at: Sequence[int], steps: int, compared: str,
           tolerance: float = 0.0, held: Optional[Iterable[str]] = None) -> Verdict:
    """The verdict from every difference found (``rows``: the metrics', ``tensors``: the checkpoints';
    ``held``: the components the checkpoints hold, where they were read)."""
    rows, tensors = list(rows), list(tensors)
    v = Verdict("bitwise", list(stopped_at), steps, compared, tolerance)
    stop = min(stopped_at) if stopped_at else 0
    # an RNG stream the program never seeded starts elsewhere in each run (NumPy's, Python's) and so
    # differs from the first step on; while every metric up to the stop agrees, the program draws
    # nothing from it that matters: said, not a divergence (one it draws from would move the metrics)
    if not any(d.step <= stop for d in rows):
        unseeded = {(d.where, d.key) for d in tensors if d.step <= stop and d.component == "rng"}
        if unseeded:
            tensors = [d for d in tensors if (d.where, d.key) not in unseeded]
            v.notes.append("unseeded RNG streams differ between the runs from the start and were left out: "
                           + ", ".join(sorted(f"{k} in {w}" for w, k in unseeded)[:6]))
    every = sorted([*rows, *tensors], key=lambda d: d.step)
    if not every:
        return v
    beyond = [d for d in every if not (tolerance > 0 and d.within(tolerance))]
    if not beyond:
        big = max(every, key=lambda d: d.max_abs)
        v.kind, v.largest = "tolerance", {"step": big.step, "key": big.key, "where": big.where,
                                          "max_abs": big.max_abs, "max_rel": big.max_rel}
        return v
    first = beyond[0].step
    at_first = [d for d in beyond if d.step == first]
    v.kind, v.first_step = "diverges", first
    v.diffs = [asdict(d) for d in at_first[:8]]
    kinds = {d.component for d in at_first}
    # the first step after the stop: restored state first (an RNG, a rank's data position), then what
    # the step computed from the weights it resumed with (its loss, its learning rate), then what it updated
    name = "before" if first <= stop else next(c for c in (*FIRST_NAMED, *sorted(kinds)) if c in kinds)
    chosen = at_first[0] if name == "before" else next(d for d in at_first if d.component == name)
    where = "" if chosen.where == "metrics" else f" in {chosen.where}"
    by = f" (by {chosen.max_abs:.3g})" if math.isfinite(chosen.max_abs) else " (missing in one run, or another shape)"
    missing = ""
    if name == "weights" and held is not None and "optimizer" not in set(held):
        # the update differs while all that was saved agreed, and no optimizer state was saved at all:
        # an optimizer with state (Adam's moments, momentum) started over at the resume
        name, missing = "optimizer", "; the checkpoints hold no optimizer state at all"
    what, v.cause = CAUSES[name]
    v.component = name
    v.detail = (f"{what} differs: {chosen.key}{where}{by}" if not missing else
                f"{CAUSES['weights'][0]} differ: {chosen.key}{where}{by}{missing}")
    tensor_steps = {d.step for d in tensors}
    metrics_only = compared.startswith(METRICS_ONLY)
    if first - 1 >= 1 and (first - 1) not in tensor_steps and not metrics_only:
        v.equal_before = f"every checkpoint tensor equal at step {first - 1}"
    elif first - 1 >= 1 and metrics_only:
        v.equal_before = f"the metrics equal to step {first - 1}"
    return v
