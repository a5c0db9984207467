"""Fit the planner's calibration (``cluster.calibration``) from measured runs of one cluster.

For each run: the planner's *uncalibrated* step time split as the calibration scales it
(``recipes.gpt.plan.timing.StepParts``: compute C, communication M, offload R) and its activation bytes
(the pipeline stage that holds the most), against what the run measured: the median step time
over the steps after the first two (metrics.jsonl ``step_time_s``; the first steps allocate and warm
up) and the largest ``activation_bytes`` any rank recorded (ranks/state_<r>.json: the peak of live
saved-for-backward bytes in the first step, recipes/common/activations.py).

    measured step  ~  compute_scale * C + comm_scale * M + R + step_overhead_s

is solved by non-negative least squares over the runs, each equation divided by the run's measured step
time (so the fit minimises the relative errors: a slow layout does not outweigh the others; three
unknowns: every active set is tried, the best non-negative solution kept). Constants the runs cannot
tell apart stay at their neutral value (1, 1, 0) and the fit says why: fewer runs than constants (kept
in the order compute_scale, comm_scale, step_overhead_s), no run with communication, or columns
proportional to each other.
``activation_scale`` is the s minimising sum ((s * planned - measured) / measured)^2 over the runs
that recorded activations: s = sum(p/m) / sum((p/m)^2).

Pure functions, no torch: ``read_sample`` reads a run dir, ``fit`` fits, ``rows`` tabulates,
``replace_block`` puts the result into a cluster YAML file's text (launcher/cli/plan_cmd.py writes it).
"""
from __future__ import annotations

import dataclasses
import decimal
import json
import math
import re
import statistics
from dataclasses import dataclass
from itertools import combinations
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple

import yaml

from launcher import sweeps
from launcher.config import recipe_contract
from launcher.config.errors import ConfigErrors
from launcher.config.layout import Layout
from launcher.config.schema import enum_value, typed
from launcher.run.rundir import RunDir
from recipes.gpt.plan.estimate import estimate
from recipes.gpt.plan.memory import stage_activation_bytes
from recipes.gpt.plan.spec import Calibration, ClusterSpec, LayoutSpec
from recipes.gpt.plan.timing import StepParts
from recipes.gpt.schema import ModelSpec

if TYPE_CHECKING:
    from recipes.gpt.schema import GPTRunConfig

STEP_UNKNOWNS = ("compute_scale", "comm_scale", "step_overhead_s")
NEUTRAL = {"compute_scale": 1.0, "comm_scale": 1.0, "step_overhead_s": 0.0}
WARMUP_STEPS = 2  # steps left out of the measured step time
HARDWARE_KEYS = ("gpu.peak_tflops", "intra_node_bandwidth", "inter_node_bandwidth")
_RANK_TOL = 1e-9


class CalibrationError(ValueError):
    """Input the calibration cannot use; the message names the run and what is missing."""


@dataclass(frozen=True)
class Sample:
    """One measured run and the planner's uncalibrated estimate for it."""

    run_id: str
    run_dir: str
    layout: str  # "dp2 tp1 pp1 zero0 mb2x4 ddp"
    parts: StepParts
    measured_step_s: float
    steps_measured: int  # steps the median is over
    planned_activation_bytes: int
    measured_activation_bytes: Optional[int]  # None: the run recorded none (before activation_bytes existed)
    cluster_name: str
    cluster_choice: Optional[str]  # the run's hydra choice for `cluster` (overrides.yaml), if recorded
    hardware: Tuple[Tuple[str, Any], ...] = ()

    @property
    def planned_step_s(self) -> float:
        return self.parts.step_time(Calibration())


@dataclass(frozen=True)
class Fit:
    calibration: Calibration
    fitted: Tuple[str, ...]  # the constants fitted (the others stayed neutral)
    notes: Tuple[str, ...]  # why a constant was not fitted


# ---- measurements --------------------------------------------------------------------------------------


def measured_step_time(metrics: Sequence[Dict[str, Any]]) -> Tuple[Optional[float], int]:
    """(median step_time_s over the steps after the first two, how many steps that is)."""
    times = [float(r["step_time_s"]) for r in metrics
             if isinstance(r.get("step_time_s"), (int, float)) and math.isfinite(r["step_time_s"])]
    steady = times[WARMUP_STEPS:]
    return (statistics.median(steady) if steady else None), len(steady)


def layout_label(lay: LayoutSpec) -> str:
    return (f"dp{lay.dp} tp{lay.tp} pp{lay.pp} zero{lay.zero} mb{lay.micro_batch_size}x{lay.grad_accum} "
            f"{lay.engine}" + (" sp" if lay.sequence_parallel else "")
            + (f" {lay.recompute}" if lay.recompute != "none" else ""))


def read_sample(run_dir: Path) -> Sample:
    """The planner's uncalibrated estimate and the measurements of the run in ``run_dir``."""

    rd = RunDir(run_dir)
    if not rd.exists():
        raise CalibrationError(f"{run_dir} is not a run directory (no {RunDir.RUN})")
    meta = rd.run() or {}
    run_id = str(meta.get("run_id") or rd.path.name)
    try:
        cfg = typed(rd.config())
    except FileNotFoundError:
        raise CalibrationError(f"run {run_id} has no {RunDir.CONFIG}") from None
    except Exception as e:  # a config this schema cannot read
        raise CalibrationError(f"run {run_id}: its {RunDir.CONFIG} does not fit the schema: {e}") from None
    target = str(cfg.recipe._target_ or "")
    if recipe_contract.of(target, strict=False).planner is None:
        raise CalibrationError(f"run {run_id} ran {target!r}: the planner models only the recipes whose contract "
                               "names it (launcher.config.recipe_contract)")
    metrics = sweeps.current_curve(rd.metrics())
    if not metrics:
        raise CalibrationError(f"run {run_id} has no metrics ({RunDir.METRICS}): it trained no step")
    measured, n = measured_step_time(metrics)
    if measured is None:
        raise CalibrationError(f"run {run_id} has {len(metrics)} step(s) of metrics; the calibration needs at "
                               f"least {WARMUP_STEPS + 1} (the first {WARMUP_STEPS} are warm-up)")
    try:
        lay, parts, planned_act = planned(cfg, meta.get("layout"))
    except (ConfigErrors, TypeError, ValueError, KeyError) as e:
        raise CalibrationError(f"run {run_id} names no layout the planner can estimate: {e}") from None
    acts = measured_activation_bytes(rd.states().values())
    choice = ((rd.overrides() or {}).get("choices") or {}).get("cluster")
    hw = tuple((k, _dig(cfg.cluster, k)) for k in HARDWARE_KEYS)
    return Sample(run_id=run_id, run_dir=str(rd.path), layout=layout_label(lay), parts=parts,
                  measured_step_s=measured, steps_measured=n, planned_activation_bytes=planned_act,
                  measured_activation_bytes=acts, cluster_name=str(cfg.cluster.name),
                  cluster_choice=str(choice) if choice else None, hardware=hw)


def planned(cfg: GPTRunConfig, layout_json: Optional[Dict[str, Any]] = None) -> Tuple[LayoutSpec, StepParts, int]:
    """The planner's uncalibrated estimate for a run config: (its layout, the step time's parts, the
    activation bytes of the pipeline stage that holds the most). ``layout_json``: the layout archived
    in run.json (what the job ran with), else the config's."""

    recompute, dtype = enum_value(cfg.train.recompute), enum_value(cfg.precision.dtype)
    lay = (LayoutSpec.of(Layout.from_json(layout_json), recompute, dtype) if layout_json
           else LayoutSpec.from_cfg(cfg))
    m = ModelSpec.from_cfg(cfg.model)
    cluster = dataclasses.replace(ClusterSpec.from_cfg(cfg.cluster), calibration=Calibration())
    est = estimate(m, cluster, lay)
    return lay, est.timing.parts, max(act for _, _, act in stage_activation_bytes(m, lay))


def measured_activation_bytes(states: Any) -> Optional[int]:
    """The largest ``activation_bytes`` of the ranks' state records (None: none recorded)."""
    acts = [s["activation_bytes"] for s in states if isinstance(s.get("activation_bytes"), int)]
    return max(acts) if acts else None


def cluster_file(choice: str) -> Path:
    """conf/cluster/<choice>.yaml of the conf/ `launch` composes from (launcher.app.CONF_DIR)."""
    from launcher.app import CONF_DIR  # launcher.app loads Hydra: reading run dirs (report) does without it

    return Path(CONF_DIR) / "cluster" / f"{choice}.yaml"


def file_calibration(path: Path) -> Optional[Tuple[Calibration, Dict[str, Any]]]:
    """The ``calibration:`` block of a cluster YAML file: (its constants, the whole block), or None when
    the file is missing, has none or only the defaults."""
    try:
        doc = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError):
        return None
    block = doc.get(BLOCK_KEY) if isinstance(doc, dict) else None
    if not isinstance(block, dict):
        return None
    try:
        cal = Calibration.from_cfg(block)
    except (TypeError, ValueError):
        return None
    return None if cal.is_default else (cal, block)


def _dig(node: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        node = node[part]
    return float(node or 0)


def check_one_cluster(samples: Sequence[Sample]) -> None:
    """Every run must be of one cluster: same cluster.name, same config choice, same hardware figures."""
    first = samples[0]
    for s in samples[1:]:
        if s.cluster_name != first.cluster_name:
            raise CalibrationError(
                f"cluster.name: the runs are of different clusters ({first.cluster_name!r} in run {first.run_id}, "
                f"{s.cluster_name!r} in run {s.run_id}); calibrate each cluster from its own runs")
        if s.cluster_choice and first.cluster_choice and s.cluster_choice != first.cluster_choice:
            raise CalibrationError(
                f"cluster: the runs used different cluster configs (cluster={first.cluster_choice} in run "
                f"{first.run_id}, cluster={s.cluster_choice} in run {s.run_id})")
        for (key, a), (_, b) in zip(first.hardware, s.hardware):
            if a != b:
                raise CalibrationError(
                    f"cluster.{key}: {a:g} in run {first.run_id} but {b:g} in run {s.run_id}; the calibration "
                    f"corrects one set of hardware figures, calibrate runs made with the same ones")


# ---- the fit ------------------------------------------------------------------------------------------


def _solve(cols: Sequence[Sequence[float]], y: Sequence[float]) -> Optional[List[float]]:
    """Least squares y ~ sum_j x_j cols[j] (normal equations on unit-norm columns, Gaussian
    elimination with partial pivoting); None when the columns are dependent."""
    k = len(cols)
    if k == 0:
        return []
    norms = [math.sqrt(sum(v * v for v in c)) for c in cols]
    if any(nm == 0 for nm in norms):
        return None
    unit = [[v / nm for v in c] for c, nm in zip(cols, norms)]
    a = [[sum(p * q for p, q in zip(unit[i], unit[j])) for j in range(k)] for i in range(k)]
    b = [sum(p * q for p, q in zip(unit[i], y)) for i in range(k)]
    for col in range(k):
        piv = max(range(col, k), key=lambda r: abs(a[r][col]))
        if abs(a[piv][col]) < 1e-12:
            return None
        a[col], a[piv], b[col], b[piv] = a[piv], a[col], b[piv], b[col]
        for r in range(col + 1, k):
            f = a[r][col] / a[col][col]
            for c in range(col, k):
                a[r][c] -= f * a[col][c]
            b[r] -= f * b[col]
    x = [0.0] * k
    for r in reversed(range(k)):
        x[r] = (b[r] - sum(a[r][c] * x[c] for c in range(r + 1, k))) / a[r][r]
    return [xi / nm for xi, nm in zip(x, norms)]


def nnls(cols: Sequence[Sequence[float]], y: Sequence[float]) -> List[float]:
    """Non-negative least squares for a few unknowns: every active set is solved unconstrained and
    the non-negative solution with the smallest residual kept (exact for the small k used here)."""
    k = len(cols)
    best: Tuple[float, List[float]] = (math.inf, [0.0] * k)
    for size in range(k + 1):
        for subset in combinations(range(k), size):
            sol = _solve([cols[j] for j in subset], y)
            if sol is None or any(v < 0 for v in sol):
                continue
            x = [0.0] * k
            for j, v in zip(subset, sol):
                x[j] = v
            res = sum((yi - sum(x[j] * cols[j][i] for j in range(k))) ** 2 for i, yi in enumerate(y))
            if res < best[0] * (1 - 1e-12):
                best = (res, x)
    return best[1]


def _independent(basis: List[List[float]], col: Sequence[float]) -> Optional[List[float]]:
    """``col`` orthonormalised against ``basis`` (Gram-Schmidt), or None when it lies in its span."""
    norm = math.sqrt(sum(v * v for v in col))
    if norm == 0:
        return None
    v = [c / norm for c in col]
    for q in basis:
        dot = sum(a * b for a, b in zip(q, v))
        v = [a - dot * b for a, b in zip(v, q)]
    rest = math.sqrt(sum(a * a for a in v))
    return None if rest < _RANK_TOL else [a / rest for a in v]


WHAT = {"compute_scale": "compute", "comm_scale": "communication", "step_overhead_s": "fixed per-step"}


def fit_step(samples: Sequence[Sample]) -> Tuple[Dict[str, float], Tuple[str, ...], Tuple[str, ...]]:
    """(compute_scale, comm_scale, step_overhead_s by name; those fitted; notes on those kept neutral)."""
    n = len(samples)
    columns = {
        "compute_scale": [s.parts.compute_s for s in samples],
        "comm_scale": [s.parts.comm_s for s in samples],
        "step_overhead_s": [1.0] * n,
    }
    chosen: List[str] = []
    basis: List[List[float]] = []
    notes: List[str] = []
    for name in STEP_UNKNOWNS:
        col = columns[name]
        neutral = f"{name} kept at {NEUTRAL[name]:g}"
        if not any(col):
            notes.append(f"{neutral}: no run has predicted {WHAT[name]} time")
            continue
        if len(chosen) >= n:
            notes.append(f"{neutral}: {n} run(s) determine at most {n} of the {len(STEP_UNKNOWNS)} step-time "
                         f"constants (calibrate on runs of {len(STEP_UNKNOWNS)} or more layouts to fit it)")
            continue
        q = _independent(basis, col)
        if q is None:
            notes.append(f"{neutral}: in these runs its column is proportional to that of "
                         f"{' / '.join(chosen)} (runs of other layouts tell them apart)")
            continue
        basis.append(q)
        chosen.append(name)
    # every run's equation divided by its measured time: the fit minimises the relative errors, so a
    # slow layout does not outweigh the others
    weight = [1.0 / s.measured_step_s for s in samples]

    def solve() -> Dict[str, float]:
        values = dict(NEUTRAL)
        target = [(s.measured_step_s - s.parts.other_s - sum(NEUTRAL[k] * columns[k][i] for k in STEP_UNKNOWNS
                                                              if k not in chosen)) * weight[i]
                  for i, s in enumerate(samples)]
        cols = [[v * w for v, w in zip(columns[k], weight)] for k in chosen]
        for name, v in zip(chosen, nnls(cols, target)):
            values[name] = v
        return values

    values = solve()
    if values["compute_scale"] <= 0 and "step_overhead_s" in chosen:
        # the per-step constant took all the time: compute must stay in the model (the planner ranks
        # layouts by it), so the fit goes through the origin instead
        chosen.remove("step_overhead_s")
        notes.append("step_overhead_s kept at 0: with it the fit left no compute time (compute_scale 0: these "
                     "runs' step times do not grow with their predicted compute), so compute_scale carries the "
                     "per-step time")
        values = solve()
    if values["compute_scale"] <= 0:
        raise CalibrationError("the fit leaves no compute time (compute_scale 0): these runs' step times do not "
                               "grow with their predicted compute; calibrate on runs of different sizes or layouts")
    return values, tuple(chosen), tuple(notes)


def fit_activation_scale(pairs: Sequence[Tuple[int, int]]) -> Optional[float]:
    """The s minimising sum ((s p - m) / m)^2 over (planned p, measured m): sum(p/m) / sum((p/m)^2)."""
    ratios = [p / m for p, m in pairs if p > 0 and m > 0]
    if not ratios:
        return None
    return sum(ratios) / sum(r * r for r in ratios)


def fit(samples: Sequence[Sample]) -> Fit:
    if not samples:
        raise CalibrationError("no runs to calibrate on")
    values, chosen, notes = fit_step(samples)
    pairs = [(s.planned_activation_bytes, s.measured_activation_bytes) for s in samples
             if s.measured_activation_bytes is not None]
    act = fit_activation_scale(pairs)
    notes = list(notes)
    if act is None:
        act = 1.0
        notes.append("activation_scale kept at 1: no run recorded activation_bytes (ranks/state_<r>.json; runs "
                     "made before the recipe measured them)")
    else:
        chosen = (*chosen, "activation_scale")
    cal = Calibration(compute_scale=values["compute_scale"], comm_scale=values["comm_scale"],
                      step_overhead_s=values["step_overhead_s"], activation_scale=act)
    return Fit(cal, tuple(chosen), tuple(notes))


# ---- what it changes --------------------------------------------------------------------------------------


def rel_error(predicted: Optional[float], measured: Optional[float]) -> Optional[float]:
    """(predicted - measured) / measured: the prediction's error relative to the measurement."""
    if predicted is None or measured is None or not measured:
        return None
    return (float(predicted) - float(measured)) / float(measured)


def rows(samples: Sequence[Sample], cal: Calibration) -> List[Dict[str, Any]]:
    """Per run: planned (uncalibrated) and calibrated step time and activation bytes, measured, errors."""
    out = []
    for s in samples:
        before, after = s.planned_step_s, s.parts.step_time(cal)
        act_before = s.planned_activation_bytes
        act_after = int(round(act_before * cal.activation_scale))
        act = s.measured_activation_bytes
        out.append({
            "run_id": s.run_id, "layout": s.layout,
            "step_time_s": {"planned": before, "calibrated": after, "measured": s.measured_step_s,
                            "error_before": rel_error(before, s.measured_step_s),
                            "error_after": rel_error(after, s.measured_step_s)},
            "activation_bytes": {"planned": act_before, "calibrated": act_after, "measured": act,
                                 "error_before": rel_error(act_before, act), "error_after": rel_error(act_after, act)},
        })
    return out


def mean_abs(values: Sequence[Optional[float]]) -> Optional[float]:
    vals = [abs(v) for v in values if v is not None]
    return sum(vals) / len(vals) if vals else None


# ---- the cluster's YAML file ------------------------------------------------------------------------------

BLOCK_KEY = "calibration"
_TOP = re.compile(rf"^{BLOCK_KEY}\s*:")


def yaml_number(x: float, digits: int = 6) -> str:
    """``x`` to ``digits`` significant digits, written positionally (PyYAML reads 1e-05 as a string)."""
    text = format(decimal.Decimal(repr(float(f"{x:.{digits}g}"))), "f")
    return text if "." in text else text + ".0"


def calibration_block(cal: Calibration, runs: Sequence[str], fitted_at: str) -> str:
    """The top-level ``calibration:`` block of a cluster YAML file (ends with a newline)."""
    lines = [f"{BLOCK_KEY}:",
             f"  # fitted by `launcher plan --calibrate` from {len(runs)} run(s) (docs/calibration.md)"]
    lines += [f"  {k}: {yaml_number(v)}" for k, v in cal.as_dict().items()]
    lines += [f"  runs: {json.dumps(list(runs))}", f"  fitted_at: {json.dumps(fitted_at)}"]
    return "\n".join(lines) + "\n"


def _is_gap(line: str) -> bool:
    """A blank line or a comment at column 0: part of a block only when indented lines follow."""
    return not line.strip() or line.startswith("#")


def replace_block(text: str, block: str) -> str:
    """``text`` (a YAML file) with its top-level ``calibration:`` block replaced by ``block`` (appended
    when it has none); every other byte kept. A block runs from its key to the last indented line
    before the next top-level line."""
    lines = text.splitlines(keepends=True)
    starts = [i for i, line in enumerate(lines) if _TOP.match(line)]
    if len(starts) > 1:
        raise CalibrationError(f"the file has {len(starts)} top-level `{BLOCK_KEY}:` keys (lines "
                               f"{', '.join(str(i + 1) for i in starts)}); leave one")
    if not starts:
        sep = "" if not text or text.endswith("\n") else "\n"
        return text + sep + block
    i = starts[0]
    end = j = i + 1
    while j < len(lines):
        if _is_gap(lines[j]):
            j += 1
            continue
        if lines[j][0] in " \t":
            end = j = j + 1
            continue
        break
    return "".join(lines[:i]) + block + "".join(lines[end:])


def updated_cluster_file(text: str, cal: Calibration, runs: Sequence[str], fitted_at: str) -> str:
    """The cluster file's new text, checked: it parses, its calibration is ``cal`` and every other key is
    what it was."""
    new = replace_block(text, calibration_block(cal, runs, fitted_at))
    try:
        old_doc, new_doc = yaml.safe_load(text) or {}, yaml.safe_load(new) or {}
    except yaml.YAMLError as e:
        raise CalibrationError(f"the cluster file is not YAML this can edit: {e}") from None
    if not isinstance(old_doc, dict) or not isinstance(new_doc, dict):
        raise CalibrationError("the cluster file does not hold a mapping of keys")
    got = new_doc.get(BLOCK_KEY) or {}
    want = {**{k: float(yaml_number(v)) for k, v in cal.as_dict().items()}, "runs": list(runs),
            "fitted_at": fitted_at}
    rest_old = {k: v for k, v in old_doc.items() if k != BLOCK_KEY}
    rest_new = {k: v for k, v in new_doc.items() if k != BLOCK_KEY}
    if got != want or rest_old != rest_new:
        raise CalibrationError("replacing the calibration block would change other keys of the cluster file "
                               "(its layout is unusual); edit it by hand or use --cluster-file")
    return new


def view(run_dir: Path, layout: Dict[str, Any], overrides: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """The cluster's calibration for this run, where it has one, and the planner's uncalibrated estimate
    (``planned``), for `launcher report` (the contract's ``calibration``): the calibration the run was
    launched with (its config's cluster.calibration: plan.json is calibrated), else the one its
    cluster's config file holds now (conf/cluster/<choice>.yaml, written by `launcher plan
    --calibrate`). None without either. Raises what an archive the planner cannot read raises."""
    cfg = typed(RunDir(run_dir).config())
    cal = Calibration.from_cfg(cfg.cluster.calibration)
    source = "this run's config (cluster.calibration, as launched: plan.json is calibrated)"
    if cal.is_default:
        path = cluster_file(str((overrides.get("choices") or {}).get("cluster") or cfg.cluster.name))
        found = file_calibration(path)
        if found is None:
            return None
        cal, block = found
        source = (f"{path} (fitted {block.get('fitted_at') or '?'} from {len(block.get('runs') or [])} run(s)), "
                  f"applied to this run's config")
    _, parts, act = planned(cfg, layout or None)
    return {"calibration": cal, "source": source, "parts": parts, "step_before": parts.step_time(Calibration()),
            "activations_before": act}
