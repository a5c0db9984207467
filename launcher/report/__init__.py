"""One self-contained HTML page for a run or a sweep (`launcher report`).

The page must open anywhere a run dir is copied to (a laptop, an air-gapped cluster, an e-mail), so
it carries everything inside: inline CSS, plots as base64 PNG data URIs, no script, font or link to
anything outside itself. Every text taken from the archive (configs, errors, hostnames, overrides)
is user data and is escaped; only markup this package builds (``Html``) goes in as it is.

Three layers: ``read_run`` / ``read_sweep`` gather what the archive holds (gather), ``*_plots`` draw
it with matplotlib (plots; Agg, never torch), and ``run_page`` / ``sweep_page`` (run_html, sweep_html,
over markup) are pure functions of those two. ``run_report`` / ``sweep_report`` put them together.
"""
from __future__ import annotations

from launcher.report.gather import (
                                    calibration_rows,
                                    calibration_view,
                                    plan_vs_measured,
                                    planned_layout,
                                    rank_grid,
                                    read_run,
                                    read_sweep,
                                    rel_error,
                                    steady_mean,
                                    topology_rows,
)
from launcher.report.markup import (
                                    CSS,
                                    Html,
                                    Plot,
                                    details,
                                    esc,
                                    fmt_bytes,
                                    fmt_pct,
                                    img,
                                    is_num,
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
from launcher.report.plots import PHASE_ORDER, SERIES, figure_png, phase_series, run_plots, series, sweep_plots
from launcher.report.run_html import GRID_MAX_RANKS, run_page, run_report
from launcher.report.sweep_html import anchor, rungs_section, sweep_page, sweep_report

__all__ = [
    "CSS", "GRID_MAX_RANKS", "PHASE_ORDER", "SERIES", "Html", "Plot",
    "anchor", "calibration_rows", "calibration_view", "details", "esc", "figure_png", "fmt_bytes", "fmt_pct",
    "img", "is_num", "join", "kv_table", "page", "phase_series", "plan_vs_measured", "planned_layout",
    "plots_block", "pre", "rank_grid", "read_run", "read_sweep", "rel_error", "run_page", "run_plots",
    "run_report", "rungs_section", "section", "series", "status_span", "steady_mean", "sweep_page",
    "sweep_plots", "sweep_report", "table", "tag", "topology_rows",
]
