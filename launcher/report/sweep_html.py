"""A sweep's page of `launcher report` (``sweep_page``: pure, of the data ``read_sweep`` gathered and
the plots ``sweep_plots`` drew): the points best first, an ASHA or PBT schedule's record, each point.
"""
from __future__ import annotations

from typing import Any, Dict, List, Sequence

from launcher import sweeps
from launcher.report.gather import read_sweep
from launcher.report.markup import Html, Plot, join, kv_table, page, plots_block, pre, section, status_span, table, tag
from launcher.report.plots import sweep_plots


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
