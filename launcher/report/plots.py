"""The plots of `launcher report`'s pages, drawn with matplotlib (Agg; never torch) as PNG bytes: a
run's per-step series and its step time by phase, a sweep's loss curves and objective per swept key.
"""
from __future__ import annotations

import io
from typing import Any, Callable, Dict, List, Sequence, Tuple

from launcher import sweeps
from launcher.report.markup import Plot, is_num
from launcher.sweep_view import draw_loss_curves, draw_objective, plain, pyplot

# the per-step series a run page plots, when metrics.jsonl has them: (key, title)
SERIES: Tuple[Tuple[str, str], ...] = (
    ("loss", "loss"), ("lr", "learning rate"), ("grad_norm", "gradient norm"),
    ("tokens_per_s", "tokens/s"), ("mfu", "MFU"), ("step_time_s", "step time (s)"),
)


def series(metrics: Sequence[Dict[str, Any]], key: str) -> List[Tuple[float, float]]:
    """(step, value) of ``key`` where a row has a number for it."""
    return [(r.get("step"), r[key]) for r in metrics if is_num(r.get(key)) and is_num(r.get("step"))]


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


def sweep_plots(data: Dict[str, Any]) -> List[Plot]:
    """The loss curves of every point, and the objective against each swept key: the drawing of
    `launcher results --plot`, one panel per image."""
    rows, keys, objective = data["rows"], data["keys"], data["objective"]
    out = [("loss per step, every point", figure_png(lambda ax: draw_loss_curves(ax, rows, keys), size=(7, 4.2)))]
    for k in keys:
        out.append((f"{sweeps.objective_key(objective)} vs {k}",
                    figure_png(lambda ax, k=k: draw_objective(ax, rows, k, objective), size=(5, 3.6))))
    return out
