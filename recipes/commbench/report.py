"""The benchmark's section of ``launcher report`` (its contract's ``report``): bus bandwidth and time
per operation against message size, one line per op, and each op's peak. Drawn with the report's own
helpers (launcher.report); imported only when a commbench run's page is made.
"""
from __future__ import annotations

from typing import Any, Dict, List, Sequence

from launcher.config.recipe_contract import ReportSection
from launcher.report import Html, Plot, figure_png, kv_table, plots_block, table, tag


def section(bench: Dict[str, Any]) -> ReportSection:
    """The run's Communication section, from its results (commbench.json)."""
    return ReportSection("Communication", _section(bench, plots(bench)))


def plots(bench: Dict[str, Any]) -> List[Plot]:
    """recipes/commbench: bus bandwidth and time per operation against message size, one line per op."""
    rows = [r for r in bench.get("rows") or [] if r.get("bytes")]
    ops = sorted({str(r.get("op")) for r in rows})
    where = f"{bench.get('world_size')} ranks, {_node_count(bench)} node(s), {bench.get('backend')}"
    out = []
    for key, title, unit in (("busbw_gbs", "bus bandwidth", "GB/s"), ("time_us", "time per operation", "us")):
        def draw(ax, key=key, title=title, unit=unit):
            for op in ops:
                pts = sorted((r["bytes"], r[key]) for r in rows if r.get("op") == op and r.get(key) is not None)
                scope = {r.get("scope") for r in rows if r.get("op") == op}
                ax.plot([b for b, _ in pts], [v for _, v in pts], marker=".",
                        label=f"{op} ({'/'.join(map(str, scope))})")
            ax.set_xscale("log", base=2)
            if key == "time_us":
                ax.set_yscale("log")
            ax.set_xlabel("message size (bytes)")
            ax.set_ylabel(unit)
            ax.set_title(f"{title}, {where}", fontsize=9)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)

        out.append((f"{title} vs message size", figure_png(draw, size=(5.6, 3.6))))
    return out


def _node_count(bench: Dict[str, Any]) -> Any:
    nodes = bench.get("nodes")
    return len(set(map(str, nodes))) if isinstance(nodes, list) else nodes


def _section(bench: Dict[str, Any], plots: Sequence[Plot]) -> Html:
    rows = [r for r in bench.get("rows") or [] if r.get("bytes")]
    peaks = []
    for op in sorted({str(r.get("op")) for r in rows}):
        mine = [r for r in rows if r.get("op") == op]
        best = max(mine, key=lambda r: r.get("busbw_gbs") or 0)
        peaks.append((op, best.get("scope"), best.get("bytes"), f"{best.get('busbw_gbs') or 0:.4g}",
                      f"{best.get('algbw_gbs') or 0:.4g}", f"{best.get('time_us') or 0:.1f}"))
    info = kv_table([("world size", bench.get("world_size")), ("nodes", _node_count(bench)),
                     ("backend", bench.get("backend")), ("dtype", bench.get("dtype")),
                     ("hosts", ", ".join(map(str, bench.get("hosts") or []))),
                     ("skipped", ", ".join(map(str, bench.get("skipped") or [])) or "none")])
    return Html(info + plots_block(plots) + tag("h3", "peak bus bandwidth per operation") +
                table(["op", "scope", "at bytes", "busbw GB/s", "algbw GB/s", "time us"], peaks))
