"""One self-contained HTML page for a run or a sweep (`launcher report`).

The page must open anywhere a run dir is copied to (a laptop, an air-gapped cluster, an e-mail), so
it carries everything inside: inline CSS, plots as base64 PNG data URIs, no script, font or link to
anything outside itself. Every text taken from the archive (configs, errors, hostnames, overrides)
is user data and is escaped; only markup this module builds (``Html``) goes in as it is.

Three layers: ``read_run`` / ``read_sweep`` gather what the archive holds, ``*_plots`` draw it with
matplotlib (Agg; never torch), and ``run_page`` / ``sweep_page`` are pure functions of those two.
"""
from __future__ import annotations

import base64
import html
import io
import json
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from launcher import sweep_view, sweeps
from launcher.archive import atomic
from launcher.archive.compare import flatten
from launcher.config import recipe_contract
from launcher.config.layout import Layout
from launcher.config.schema import typed
from launcher.run.status import RunStatus
from launcher.rundir import RunDir, SweepDir
from launcher.sweep_view import draw_loss_curves, draw_objective, plain, pyplot

Plot = Tuple[str, bytes]  # (title, PNG bytes)

# the per-step series a run page plots, when metrics.jsonl has them: (key, title)
SERIES: Tuple[Tuple[str, str], ...] = (
    ("loss", "loss"), ("lr", "learning rate"), ("grad_norm", "gradient norm"),
    ("tokens_per_s", "tokens/s"), ("mfu", "MFU"), ("step_time_s", "step time (s)"),
)
GRID_MAX_RANKS = 256  # the picture of the mesh; beyond this the rank table alone says it

CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",sans-serif;margin:1.5em auto;max-width:1200px;color:#222;
padding:0 1em}
h1{font-size:1.4em}h2{font-size:1.15em;border-bottom:1px solid #ccc;padding-bottom:.2em;margin-top:1.6em}
h3{font-size:1em}
table{border-collapse:collapse;margin:.5em 0;font-size:.9em}
th,td{border:1px solid #ccc;padding:.2em .5em;text-align:left;vertical-align:top}
th{background:#f3f3f3}
td.num{text-align:right;font-variant-numeric:tabular-nums}
pre{background:#f7f7f7;border:1px solid #ddd;padding:.5em;overflow:auto;max-height:40em;font-size:.85em}
.plots{display:flex;flex-wrap:wrap;gap:.5em}.plots figure{margin:0}
figcaption{font-size:.85em;color:#555}
.grid td{text-align:center;min-width:4em}
.status-completed{color:#176a1d}.status-failed,.status-timeout,.status-cancelled{color:#a31515}
.note{color:#666;font-size:.85em}
"""


# ---- markup (pure) ---------------------------------------------------------------------------------


class Html(str):
    """Markup this module built: inserted as it is. Anything else passes through ``esc``."""


def esc(value: Any) -> Html:
    if isinstance(value, Html):
        return value
    return Html(html.escape("" if value is None else str(value), quote=True))


def join(parts: Iterable[Any]) -> Html:
    return Html("".join(esc(p) for p in parts))


def tag(name: str, body: Any = "", **attrs: Any) -> Html:
    """<name attrs>body</name>; attribute values escaped (``cls`` is ``class``)."""
    a = "".join(f' {"class" if k == "cls" else k}="{esc(v)}"' for k, v in attrs.items() if v is not None)
    return Html(f"<{name}{a}>{esc(body)}</{name}>")


def table(headers: Optional[Sequence[Any]], rows: Iterable[Sequence[Any]], cls: Optional[str] = None,
          row_head: bool = False) -> Html:
    """A table (no header row when ``headers`` is None; ``row_head``: each row's first cell is its
    heading); numbers right-aligned, every cell escaped unless it is ``Html``."""
    def cell(i: int, v: Any) -> Html:
        if row_head and i == 0:
            return tag("th", _cell(v))
        return tag("td", _cell(v), cls="num" if _is_num(v) else None)

    head = tag("tr", join(tag("th", h) for h in headers)) if headers else ""
    body = join(tag("tr", join(cell(i, v) for i, v in enumerate(row))) for row in rows)
    return tag("table", Html(head + body), cls=cls)


def kv_table(pairs: Iterable[Tuple[Any, Any]]) -> Html:
    return table(None, pairs, row_head=True)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _cell(v: Any) -> Any:
    if isinstance(v, Html):
        return v
    if isinstance(v, float):
        return sweeps.fmt(v)
    if isinstance(v, (dict, list)):
        return json.dumps(v, sort_keys=True)
    return "" if v is None else v


def section(title: str, body: Any, anchor: Optional[str] = None) -> Html:
    return Html(tag("h2", title, id=anchor) + esc(body))


def details(summary: str, body: Any, open_: bool = False) -> Html:
    return tag("details", Html(tag("summary", summary) + esc(body)), open="open" if open_ else None)


def pre(text: Any) -> Html:
    return tag("pre", text)


def img(png: bytes, alt: str) -> Html:
    """A PNG embedded in the page (no file or URL to lose)."""
    data = base64.b64encode(png).decode("ascii")
    return Html(f'<img src="data:image/png;base64,{data}" alt="{esc(alt)}">')


def plots_block(plots: Sequence[Plot]) -> Html:
    figs = (tag("figure", Html(img(png, title) + tag("figcaption", title))) for title, png in plots)
    return tag("div", join(figs), cls="plots")


def page(title: str, body: Iterable[Any]) -> str:
    return ("<!DOCTYPE html>\n" + tag("html", Html(
        tag("head", Html('<meta charset="utf-8">' + tag("title", title) + tag("style", Html(CSS))))
        + tag("body", Html(tag("h1", title) + join(body)))), lang="en") + "\n")


def status_span(status: Any) -> Html:
    return tag("span", status or "unknown", cls=f"status-{status}" if status else None)


def rel_error(planned: Any, measured: Any) -> Optional[float]:
    """(measured - planned) / planned; None unless both are numbers and planned is not 0."""
    if not (_is_num(planned) and _is_num(measured)) or not planned:
        return None
    return (float(measured) - float(planned)) / float(planned)


def fmt_bytes(n: Any) -> str:
    return "" if not _is_num(n) else f"{n / 2**20:,.2f} MiB"


def fmt_pct(x: Optional[float]) -> str:
    return "" if x is None else f"{x * 100:+.1f}%"


# ---- what the page says (pure) ---------------------------------------------------------------------


def steady_mean(values: Sequence[float]) -> Optional[float]:
    """Mean over the steps after the first two (warm-up: allocation, autotuning), as the shipped
    training recipe's summary computes mean_tokens_per_s; all of them for a run of two steps or fewer."""
    vals = [float(v) for v in values if _is_num(v)]
    vals = vals[2:] if len(vals) > 2 else vals
    return sum(vals) / len(vals) if vals else None


def series(metrics: Sequence[Dict[str, Any]], key: str) -> List[Tuple[float, float]]:
    """(step, value) of ``key`` where a row has a number for it."""
    return [(r.get("step"), r[key]) for r in metrics if _is_num(r.get(key)) and _is_num(r.get("step"))]


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
        per_rank = [s[part] for s in states if _is_num(s.get(part))]
        add(f"{part} bytes per rank (largest)", "bytes", mem.get(part), max(per_rank) if per_rank else held.get(part))
    acts = [s["activation_bytes"] for s in states if _is_num(s.get("activation_bytes"))]
    add("activation bytes per rank (largest)", "bytes", mem.get("activations"), max(acts) if acts else None)
    peaks = [r["peak_memory_bytes"] for r in metrics if _is_num(r.get("peak_memory_bytes"))]
    add("peak GPU memory per rank (rank 0)", "bytes", mem.get("total"), max(peaks) if peaks else None)
    step_time = est.get("step_time_s")
    add("step time (s)", "num", step_time, steady_mean([r.get("step_time_s") for r in metrics]))
    tokens = ((plan or {}).get("model") or {}).get("tokens_per_step")
    planned_tps = tokens / step_time if _is_num(tokens) and _is_num(step_time) and step_time else None
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
    info = {int(r["rank"]): r for r in ranks if _is_num(r.get("rank"))}
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
                     cpu.get("model") or "", cpu.get("cores"), f"{total / 2**30:,.1f} GiB" if _is_num(total) else "",
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


# ---- plots (matplotlib, Agg) ---------------------------------------------------------------------------


def figure_png(draw: Callable[[Any], None], size: Tuple[float, float] = (4.2, 2.8), dpi: int = 90) -> bytes:
    """PNG bytes of one axes drawn by ``draw(ax)``."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=size)
    try:
        draw(ax)
        fig.tight_layout()
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=dpi)
    finally:
        plt.close(fig)
    return buf.getvalue()


def run_plots(metrics: Sequence[Dict[str, Any]]) -> List[Plot]:
    """One small plot per series of SERIES the metrics hold (none for a run without metrics)."""
    out = []
    for key, title in SERIES:
        pts = series(metrics, key)
        if not pts:
            continue

        def draw(ax, pts=pts, title=title):
            ax.plot([s for s, _ in pts], [v for _, v in pts], marker="." if len(pts) <= 50 else None)
            ax.set_xlabel("step")
            ax.set_title(title)
            ax.grid(alpha=0.3)

        out.append((title, figure_png(draw)))
    phases = phase_series(metrics)
    if phases:
        steps = [int(m["step"]) for m in metrics if "step" in m]

        def stacked(ax, phases=phases, steps=steps):
            ax.stackplot(steps, *[[1e3 * v for v in vals] for vals in phases.values()],
                         labels=[plain(p) for p in phases])
            ax.set_xlabel("step")
            ax.set_ylabel("ms")
            ax.set_title("step time by phase")
            ax.legend(fontsize=6, loc="upper right")
            ax.grid(alpha=0.3)

        out.append(("step time by phase", figure_png(stacked)))
    return out


PHASE_ORDER = ("data", "forward", "backward", "forward_backward", "grad_sync", "optimizer", "loss_sync", "other")


def phase_series(metrics: Sequence[Dict[str, Any]]) -> Dict[str, List[float]]:
    """recipes/common/phases.py's ``time_<phase>_s`` per step (0 where a step lacks one), in the
    order a step runs them; empty when the rows hold none."""
    names = {k[len("time_"):-len("_s")] for m in metrics for k in m if k.startswith("time_") and k.endswith("_s")}
    ordered = [n for n in PHASE_ORDER if n in names] + sorted(names - set(PHASE_ORDER))
    rows = [m for m in metrics if "step" in m]
    return {n: [float(m.get(f"time_{n}_s") or 0.0) for m in rows] for n in ordered} if names else {}


# ---- the run page (pure) -------------------------------------------------------------------------------


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


def sweep_plots(data: Dict[str, Any]) -> List[Plot]:
    """The loss curves of every point, and the objective against each swept key: the drawing of
    `launcher results --plot`, one panel per image."""
    rows, keys, objective = data["rows"], data["keys"], data["objective"]
    out = [("loss per step, every point", figure_png(lambda ax: draw_loss_curves(ax, rows, keys), size=(7, 4.2)))]
    for k in keys:
        out.append((f"{sweeps.objective_key(objective)} vs {k}",
                    figure_png(lambda ax, k=k: draw_objective(ax, rows, k, objective), size=(5, 3.6))))
    return out


def anchor(run_id: str) -> str:
    return "run-" + "".join(c if c.isalnum() or c in "-_" else "_" for c in str(run_id))


def sweep_page(data: Dict[str, Any], plots: Sequence[Plot]) -> str:
    rows, keys, objective = data["rows"], data["keys"], data["objective"]
    title = "sweep " + ", ".join(data["sweep_ids"])
    direction = "higher" if sweeps.higher_is_better(objective) else "lower"
    head = kv_table([("sweep dir", ", ".join(data["sweep_dirs"])),
                     ("points", f"{len(rows)}: " + ", ".join(f"{k} {v}" for k, v in data["counts"].items())),
                     ("swept keys", ", ".join(keys) or "(none differ)"),
                     ("objective", f"{sweeps.objective_key(objective)} ({direction} is better)")])
    returned = any("return_value" in p["summary"] for p in data["points"])
    by_id = {p["run_id"]: p for p in data["points"]}
    cols = sweeps.columns(keys) + (["returned"] if returned else []) + ["error"]
    cells = []
    for r in rows:
        p = by_id[r["run_id"]]
        link = tag("a", r["run_id"], href="#" + anchor(r["run_id"]))
        row = [link if c == "run_id" else status_span(r["status"]) if c == "status" else r.get(c) for c in cols[:-1]]
        if returned:
            row[-1] = repr(p["summary"]["return_value"]) if "return_value" in p["summary"] else ""
        cells.append(row + [_first_line(p["error"])])
    body: List[Any] = [head, section(f"Points, best first by {sweeps.objective_key(objective)}", table(cols, cells)),
                       section("Plots", plots_block(plots))]
    if data.get("rungs"):
        body.insert(1, rungs_section(data["rungs"]))
    per_point = []
    for p in data["points"]:
        pairs = [("status", status_span(p["status"])), ("exit code", p["exit_code"]), ("run dir", p["dir"]),
                 ("overrides", " ".join(map(str, p["overrides"])) or "(none)"),
                 ("step", f"{p['step']}/{p['steps']}" if p["steps"] else p["step"])]
        pairs += [(k, v) for k, v in sorted(p["summary"].items())]
        shown = kv_table((k, v) for k, v in pairs if v is not None)
        block = Html(tag("h3", p["run_id"], id=anchor(p["run_id"])) + shown)
        if p["error"]:
            block = Html(block + pre(p["error"]))
        per_point.append(block)
    body.append(section("Each point", join(per_point)))
    return page(title, body)


def rungs_section(summ: Dict[str, Any]) -> Html:
    """sweep=asha: each rung (points that reported, promoted, pruned, the best) and the compute spent."""
    if summ.get("scheduler") == "pbt":  # each generation's ranking and exploits, each member's lineage
        return section("Population-based training (sweep=pbt)", Html(pre("\n".join(summ["lines"]))))
    rows = [[r["rung"], r["step"], r["reported"], "" if r["promoted"] is None else len(r["promoted"]),
             "" if r["pruned"] is None else len(r["pruned"]),
             "" if r["best_point"] is None else f"{r['best_point']}: {sweeps.fmt(r['best_value'])}"]
            for r in summ["rungs"]]
    spent = kv_table([("compute spent", f"{summ['spent_s']:.1f} process-s ({summ['starts']} starts)"),
                      ("the full grid (estimated)", f"{summ['grid_s']:.1f} process-s"),
                      ("steps run", f"{summ['steps']} of {summ['grid_steps']}: {summ['loop_s']:.1f} of "
                                    f"~{summ['grid_loop_s']:.1f} process-s"),
                      ("fraction", "" if summ["fraction"] is None else f"{100 * summ['fraction']:.0f}%")])
    return section("Successive halving (sweep=asha)",
                   Html(table(["rung", "step", "reported", "promoted", "pruned", "best point"], rows) + spent))


def _first_line(text: Any) -> str:
    line = str(text or "").strip().splitlines()[:1]
    return (line[0][:120] + ("…" if len(line[0]) > 120 else "")) if line else ""


def sweep_report(runs: List[Dict[str, Any]]) -> str:
    data = read_sweep(runs)
    return sweep_page(data, sweep_plots(data))
