"""A run's page of `launcher report` (``run_page``: pure, of the data ``read_run`` gathered and the
plots ``run_plots`` drew): header and errors, metrics (or a Hydra app's result, or the recipe's own
section), planned against measured, the layout as a rank grid, topology, software, seeds, config.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Sequence, Tuple

from launcher import sweeps
from launcher.archive.compare import flatten
from launcher.config import recipe_contract
from launcher.report.gather import calibration_rows, plan_vs_measured, rank_grid, read_run, topology_rows
from launcher.report.markup import (
    Html,
    Plot,
    details,
    esc,
    fmt_bytes,
    fmt_pct,
    join,
    kv_table,
    page,
    plots_block,
    pre,
    section,
    status_span,
    table,
    tag,
)
from launcher.report.plots import run_plots
from launcher.run.rundir import RunDir
from launcher.run.status import RunStatus

GRID_MAX_RANKS = 256  # the picture of the mesh; beyond this the rank table alone says it


def run_page(data: Dict[str, Any], plots: Sequence[Plot]) -> str:
    meta, st = data["meta"], data["status"]
    hydra_app = meta.get("kind") == "hydra_app"
    summary = st.summary or {}
    run_id = meta.get("run_id") or Path(data["run_dir"]).name
    body: List[Any] = [_run_header(data)]
    if hydra_app:
        body.append(section("Result", _hydra_result(meta, st, summary)))
    elif data.get("recipe_section") and data["recipe_section"].replaces_metrics:  # the recipe's own
        body.append(section(data["recipe_section"].title, Html(data["recipe_section"].html)))
    else:
        if data.get("recipe_section"):
            body.append(section(data["recipe_section"].title, Html(data["recipe_section"].html)))
        body.append(section("Metrics", plots_block(plots) if plots else tag(
            "p", "No per-step metrics: this run has no metrics.jsonl (it did not train a step, or its recipe "
                 "logs none).")))
        if summary:
            body.append(details("status.json summary", pre(json.dumps(summary, indent=2, sort_keys=True))))
    layout = meta.get("layout") or {}
    if data["plan"] or data["states"]:
        body.append(section("Planned and measured", _plan_section(data, layout, summary)))
    grid = rank_grid(layout, data["rank_records"], data["meshes"]) if layout else []
    if grid:
        body.append(section("Layout", _layout_section(layout, grid)))
    if data["topology"]:
        body.append(section("Topology", table(("node", "hostname", "CPU", "cores", "memory", "GPUs", "GPU model",
                                                "IB devices"), topology_rows(data["topology"]))))
    if data["software"] or data["runtime"]:
        parts = [(f"{where} ({name})", data[key]) for where, name, key in (
            ("launcher side", RunDir.SOFTWARE, "software"), ("on the node", RunDir.RUNTIME, "runtime")) if data[key]]
        body.append(section("Software", join(Html(tag("h3", h) + kv_table(sorted(d.items()))) for h, d in parts)))
    if data["seeds"]:
        body.append(section("Seeds", kv_table(sorted(flatten(data["seeds"]).items()))))
    body.append(section("Config", _config_section(data)))
    return page(f"run {run_id}", body)


def _run_header(data: Dict[str, Any]) -> Html:
    meta, st, job = data["meta"], data["status"], data["job"]
    layout = meta.get("layout") or {}
    pairs: List[Tuple[str, Any]] = [
        ("run id", meta.get("run_id")), ("status", status_span(st.state.value)),
        ("exit code", st.exit_code), ("run dir", data["run_dir"]), ("sweep dir", data["sweep_dir"]),
        ("job", job.get("job_id")), ("backend", meta.get("backend")), ("created", meta.get("created")),
        ("started", st.started), ("ended", st.ended), ("attempt", st.attempt),
        ("restarts", len(data["restarts"]) or None), ("reproduces", meta.get("reproduces")),
        ("tags", ", ".join(map(str, meta.get("tags") or [])) or None),
    ]
    if layout:
        pairs.append(("layout", f"engine {layout.get('engine')}, world {layout.get('world_size')} = dp "
                                f"{layout.get('dp')} x pp {layout.get('pp')} x tp {layout.get('tp')}, ZeRO "
                                f"{layout.get('zero')}, micro batch {layout.get('micro_batch_size')}, grad accum "
                                f"{layout.get('grad_accum')}, {layout.get('nodes')} node(s)"))
    out = kv_table((k, v) for k, v in pairs if v is not None and v != "")
    if st.error:
        out = Html(out + tag("h3", "error") + pre(st.error))
    for rank, text in sorted(data["rank_errors"].items()):
        out = Html(out + details(f"rank {rank} traceback", pre(text)))
    return out


def _hydra_result(meta: Dict[str, Any], st: RunStatus, summary: Dict[str, Any]) -> Html:
    app, hy = meta.get("app") or {}, meta.get("hydra") or {}
    value = repr(summary["return_value"]) if "return_value" in summary else "(none recorded)"
    return kv_table([("returned", value), ("task function", app.get("task_function")),
                     ("config name", app.get("config_name")), ("job number", hy.get("job_num")),
                     ("output dir", st.output_dir or hy.get("sweep_dir"))])


def _plan_section(data: Dict[str, Any], layout: Dict[str, Any], summary: Dict[str, Any]) -> Html:
    rows = plan_vs_measured(data["plan"], layout, summary, data["states"], data["metrics"])
    cells = []
    for r in rows:
        show = fmt_bytes if r["kind"] == "bytes" else (lambda v: sweeps.fmt(float(v)))
        shown = [show(v) if v is not None else "not recorded" for v in (r["planned"], r["measured"])]
        cells.append([r["quantity"], *shown, fmt_pct(r["error"])])
    out = Html(table(("quantity", "planned (plan.json)", "measured", "error (measured vs planned)"), cells)
               + tag("p", "Memory: the plan's figure is for the pipeline stage that needs the most; step time, "
                          "tokens/s, TFLOP/s and MFU are means over the steps after the first two.", cls="note"))
    view = data.get("calibration")
    if view:
        cal = view["calibration"]
        cells = []
        for r in calibration_rows(view, data["metrics"], data["states"]):
            show = fmt_bytes if r["kind"] == "bytes" else (lambda v: sweeps.fmt(float(v)))
            cells.append([r["quantity"], *[show(v) if v is not None else "not recorded"
                                           for v in (r["before"], r["after"], r["measured"])],
                          fmt_pct(r["error_before"]), fmt_pct(r["error_after"])])
        out = Html(out + tag("h3", "before and after calibration")
                   + table(("quantity", "planned, uncalibrated", "planned, calibrated", "measured",
                            "error before", "error after"), cells)
                   + tag("p", f"Calibration from {view['source']}: " + ", ".join(
                       f"{k} {v:.4g}" for k, v in cal.as_dict().items()) + ". Errors: (measured - planned) / "
                       "planned; docs/calibration.md.", cls="note"))
    if data["states"]:
        per_rank = [[s.get("rank"), s.get("pp_stage"), s.get("dp_rank"), fmt_bytes(s.get("params")),
                     fmt_bytes(s.get("grads")), fmt_bytes(s.get("optimizer")),
                     fmt_bytes(sum(s.get(k) or 0 for k in ("params", "grads", "optimizer"))),
                     fmt_bytes(s.get("activation_bytes"))]
                    for s in sorted(data["states"], key=lambda s: s.get("rank", 0))]
        out = Html(out + tag("h3", "model state held per rank (ranks/state_<r>.json)")
                   + table(("rank", "pp stage", "dp rank", "params", "grads", "optimizer", "total",
                            "activations (peak, step 1)"), per_rank))
    return out


def _layout_section(layout: Dict[str, Any], grid: List[Dict[str, Any]]) -> Html:
    mesh_col = any(g["mesh_agrees"] is not None for g in grid)
    headers = ["rank", "dp", "pp", "tp", "node", "host"] + (["mesh_<r>.json"] if mesh_col else [])
    rows = [[g["rank"], g["dp"], g["pp"], g["tp"], g["node"], g["host"]]
            + ([{True: "agrees", False: "DIFFERS", None: ""}[g["mesh_agrees"]]] if mesh_col else []) for g in grid]
    out = table(headers, rows)
    if len(grid) > GRID_MAX_RANKS:
        return out
    # the mesh as a picture: one block per data-parallel replica, pipeline stages down, tensor ranks across
    by = {(g["dp"], g["pp"], g["tp"]): g for g in grid}
    dp, pp, tp = (int(layout.get(k) or 1) for k in ("dp", "pp", "tp"))
    blocks = []
    for d in range(dp):
        head = tag("tr", join([tag("th", "")] + [tag("th", f"tp {t}") for t in range(tp)]))
        body = join(tag("tr", join([tag("th", f"pp {p}")] + [
            tag("td", Html(esc(f"rank {by[(d, p, t)]['rank']}") + Html("<br>") + esc(by[(d, p, t)]["host"])))
            for t in range(tp)])) for p in range(pp))
        blocks.append(Html(tag("h3", f"dp {d}") + tag("table", Html(head + body), cls="grid")))
    return Html(out + join(blocks))


def _config_section(data: Dict[str, Any]) -> Html:
    ov = data["overrides"] or {}
    out = kv_table([("overrides", " ".join(map(str, ov.get("overrides") or [])) or "(none)"),
                    ("group choices", ", ".join(f"{k}={v}" for k, v in (ov.get("choices") or {}).items()))])
    text = data["config_text"]
    return Html(out + details("resolved config (config.yaml)", pre(text if text is not None else "(no config.yaml)")))


def run_report(run_dir: Path) -> str:
    data = read_run(Path(run_dir))
    if data["meta"].get("kind") == "hydra_app":
        return run_page(data, [])
    hook = recipe_contract.of(data["recipe"], strict=False).report  # the recipe's own section (its contract's)
    data["recipe_section"] = hook(Path(run_dir)) if hook is not None else None
    if data["recipe_section"] is not None and data["recipe_section"].replaces_metrics:
        return run_page(data, [])
    return run_page(data, run_plots(data["metrics"]))
