"""What `launcher report`'s pages show: a run dir read (``read_run``), a sweep's runs read
(``read_sweep``), and what is worked out from them (pure): the planner's estimate against the
measurement, before and after calibration, the rank grid, the nodes' topology.

Missing files give empty values: a page shows what the archive has.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from launcher import sweep_view, sweeps
from launcher.archive import atomic
from launcher.config import recipe_contract
from launcher.config.layout import Layout
from launcher.config.schema import typed
from launcher.report.markup import is_num
from launcher.run.rundir import RunDir, SweepDir

# ---- what the page says (pure) ---------------------------------------------------------------------


def rel_error(planned: Any, measured: Any) -> Optional[float]:
    """(measured - planned) / planned; None unless both are numbers and planned is not 0."""
    if not (is_num(planned) and is_num(measured)) or not planned:
        return None
    return (float(measured) - float(planned)) / float(planned)



def steady_mean(values: Sequence[float]) -> Optional[float]:
    """Mean over the steps after the first two (warm-up: allocation, autotuning), as the shipped
    training recipe's summary computes mean_tokens_per_s; all of them for a run of two steps or fewer."""
    vals = [float(v) for v in values if is_num(v)]
    vals = vals[2:] if len(vals) > 2 else vals
    return sum(vals) / len(vals) if vals else None



def planned_layout(plan: Optional[Dict[str, Any]], layout: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """The plan's estimate for the layout the run ran with (plan.json holds the launched one)."""
    entries = (plan or {}).get("layouts") or []
    for e in entries:
        if all(e.get(k) == layout.get(k) for k in ("dp", "tp", "pp", "zero")):
            return e
    return entries[0] if entries else None


def plan_vs_measured(plan: Optional[Dict[str, Any]], layout: Dict[str, Any], summary: Dict[str, Any],
                     states: Sequence[Dict[str, Any]], metrics: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Rows (quantity, kind, planned, measured, error) comparing the planner's estimate with what the
    run measured. Memory: the plan's figure is per GPU for the pipeline stage that needs the most, so it
    is compared with the largest any rank held (ranks/state_<r>.json; else the summary's rank 0)."""
    est = planned_layout(plan, layout) or {}
    mem = est.get("memory_bytes") or {}
    held = summary.get("state_bytes") or {}
    rows: List[Dict[str, Any]] = []

    def add(quantity: str, kind: str, planned: Any, measured: Any) -> None:
        if planned is None and measured is None:
            return
        rows.append({"quantity": quantity, "kind": kind, "planned": planned, "measured": measured,
                     "error": rel_error(planned, measured)})

    for part in ("params", "grads", "optimizer"):
        per_rank = [s[part] for s in states if is_num(s.get(part))]
        add(f"{part} bytes per rank (largest)", "bytes", mem.get(part), max(per_rank) if per_rank else held.get(part))
    acts = [s["activation_bytes"] for s in states if is_num(s.get("activation_bytes"))]
    add("activation bytes per rank (largest)", "bytes", mem.get("activations"), max(acts) if acts else None)
    peaks = [r["peak_memory_bytes"] for r in metrics if is_num(r.get("peak_memory_bytes"))]
    add("peak GPU memory per rank (rank 0)", "bytes", mem.get("total"), max(peaks) if peaks else None)
    step_time = est.get("step_time_s")
    add("step time (s)", "num", step_time, steady_mean([r.get("step_time_s") for r in metrics]))
    tokens = ((plan or {}).get("model") or {}).get("tokens_per_step")
    planned_tps = tokens / step_time if is_num(tokens) and is_num(step_time) and step_time else None
    measured_tps = summary.get("mean_tokens_per_s")
    if measured_tps is None:
        measured_tps = steady_mean([r.get("tokens_per_s") for r in metrics])
    add("throughput (tokens/s)", "num", planned_tps, measured_tps)
    add("TFLOP/s per GPU", "num", est.get("tflops_per_gpu"), steady_mean([r.get("tflops") for r in metrics]))
    add("MFU", "num", est.get("mfu"), steady_mean([r.get("mfu") for r in metrics]))
    return rows


def calibration_rows(view: Dict[str, Any], metrics: Sequence[Dict[str, Any]],
                     states: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Rows (quantity, kind, before, after, measured, error_before, error_after): the planner's estimate
    without and with the cluster's calibration (``view``: calibration_view) against the measurement."""
    cal = view["calibration"]
    measured_step = steady_mean([r.get("step_time_s") for r in metrics])
    acts = [s["activation_bytes"] for s in states if isinstance(s.get("activation_bytes"), int)]
    measured_act = max(acts) if acts else None
    out = []
    for quantity, kind, before, after, measured in (
            ("step time (s)", "num", view["step_before"], view["parts"].step_time(cal), measured_step),
            ("activation bytes per rank (largest)", "bytes", view["activations_before"],
             int(round(view["activations_before"] * cal.activation_scale)), measured_act)):
        out.append({"quantity": quantity, "kind": kind, "before": before, "after": after, "measured": measured,
                    "error_before": rel_error(before, measured), "error_after": rel_error(after, measured)})
    return out


def calibration_view(run_dir: Path, layout: Dict[str, Any], overrides: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """The planner's calibration of this run where its recipe's contract has one (``calibration``: the
    calibration, its source, the step time's parts and the uncalibrated estimate), else None."""
    try:
        cfg = typed(RunDir(run_dir).config())
        view = recipe_contract.of(str(cfg.recipe._target_ or ""), strict=False).calibration
        return view(run_dir, layout, overrides) if view is not None else None
    except Exception:  # an archive the planner cannot read: the page shows what it has
        return None


def rank_grid(layout: Dict[str, Any], ranks: Sequence[Dict[str, Any]],
              meshes: Dict[int, Dict[str, Any]]) -> List[Dict[str, Any]]:
    """One row per rank: its (dp, pp, tp) coordinates (Layout.coords of the archived layout), its node
    index and host (ranks/rank_<r>.json where the job wrote it), and whether ranks/mesh_<r>.json (the
    megatron engine's own record) agrees. Empty without a layout (a Hydra app's run)."""
    try:
        lay = Layout.from_json(layout)
    except (TypeError, ValueError):
        return []
    info = {int(r["rank"]): r for r in ranks if is_num(r.get("rank"))}
    out = []
    for rank in range(lay.world_size):
        dp, pp, tp = lay.coords(rank)
        r = info.get(rank, {})
        mesh = meshes.get(rank)
        agrees = None if mesh is None else (mesh.get("dp"), mesh.get("pp"), mesh.get("tp")) == (dp, pp, tp)
        out.append({"rank": rank, "dp": dp, "pp": pp, "tp": tp,
                    "node": r.get("node_rank", lay.node_of(rank)),
                    "host": r.get("slurmd_nodename") or r.get("hostname") or "", "mesh_agrees": agrees})
    return out


def topology_rows(nodes: Sequence[Dict[str, Any]]) -> List[List[Any]]:
    rows = []
    for n in nodes:
        host, cpu, mem = n.get("host") or {}, n.get("cpu") or {}, n.get("memory") or {}
        gpus = n.get("gpus") or {}
        models = sorted({str(d.get("name")) for d in gpus.get("devices") or [] if d.get("name")})
        total = mem.get("memtotal_bytes")
        rows.append([host.get("slurmd_nodename") or host.get("hostname") or "", host.get("hostname") or "",
                     cpu.get("model") or "", cpu.get("cores"), f"{total / 2**30:,.1f} GiB" if is_num(total) else "",
                     gpus.get("count"), ", ".join(models), len((n.get("infiniband") or {}).get("devices") or [])])
    return rows


# ---- reading a run dir -------------------------------------------------------------------------------


def _per_rank(rd: RunDir, pattern: str) -> Dict[int, Dict[str, Any]]:
    """ranks/<name>_<r>.json files of a run, by rank."""
    out = {}
    for p in sorted(rd.path.glob(pattern.replace("<r>", "*"))):
        rank = p.stem.rsplit("_", 1)[-1]
        data = atomic.read_json(p)
        if rank.isdigit() and isinstance(data, dict):
            out[int(rank)] = data
    return out


def read_run(run_dir: Path) -> Dict[str, Any]:
    """Everything a run page shows, read from the run dir (missing files: empty values)."""
    rd = RunDir(run_dir)
    cfg = rd.path / RunDir.CONFIG
    job = rd.job()
    return {
        "run_dir": str(rd.path), "sweep_dir": str(rd.path.parent),
        "meta": rd.run() or {}, "status": rd.status(), "job": job.to_json() if job else {},
        "metrics": sweeps.current_curve(rd.metrics()),  # the curve the latest attempt stands on
        "plan": rd.plan(), "states": list(_per_rank(rd, RunDir.STATE).values()),
        "rank_records": rd.ranks(), "meshes": _per_rank(rd, RunDir.MESH),
        "topology": rd.topology(), "software": rd.software() or {}, "runtime": rd.runtime() or {},
        "seeds": rd.seeds() or {}, "config_text": cfg.read_text(errors="replace") if cfg.is_file() else None,
        "overrides": rd.overrides(), "restarts": rd.restarts(), "rank_errors": rd.rank_errors(),
        # the recipe (its contract adds its own section to the page)
        "recipe": recipe_contract.tree_get((rd.config() if cfg.is_file() else {}) or {}, "recipe._target_"),
        "calibration": calibration_view(rd.path, (rd.run() or {}).get("layout") or {}, rd.overrides() or {})
        if cfg.is_file() else None,
    }


# ---- a sweep -----------------------------------------------------------------------------------------


def read_sweep(runs: List[Dict[str, Any]]) -> Dict[str, Any]:
    """What a sweep page shows, from the registry rows of its runs (as `launcher status` / `results`
    resolve them): the results table, best first, and each point's status, overrides and summary."""
    rows, keys, objective = sweep_view.results_table(runs, None)
    progress = {p["run_id"]: p for p in sweep_view.point_rows(runs)}
    points = []
    for r in rows:
        rd = RunDir(r["_dir"])
        st = rd.status()
        points.append({"run_id": r["run_id"], "dir": r["_dir"], "status": r["status"], "exit_code": st.exit_code,
                       "error": st.error, "summary": st.summary or {},
                       "overrides": rd.overrides().get("overrides") or [],
                       "step": progress.get(r["run_id"], {}).get("step"),
                       "steps": progress.get(r["run_id"], {}).get("steps")})
    sweep_dirs = sorted({str(Path(r["dir"]).parent) for r in runs})
    from launcher.features.asha import rungs  # sweep=asha's record in the sweep dir (reads files only)

    schedule = rungs.summary(SweepDir(sweep_dirs[0])) if len(sweep_dirs) == 1 else None
    return {"sweep_ids": sorted({r["sweep_id"] for r in runs}), "sweep_dirs": sweep_dirs,
            "counts": sweep_view.counts(runs), "rows": rows, "keys": keys, "objective": objective,
            "points": points, "rungs": schedule}
