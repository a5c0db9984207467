"""What a sweep's runs look like, read from their run dirs: one row per point (status, progress,
the overrides that differ), the results ranked by the objective, and the drawings of them (loss
curves, the objective against each swept key). Shared by `launcher status/results` and `launcher
report`; pure over the run dirs, no torch."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional

from launcher import sweeps
from launcher.archive import registry
from launcher.config import recipe_contract
from launcher.run.rundir import RunDir, SweepDir
from launcher.run.status import STATUSES


def _text(value: Any) -> str:
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def _overrides(run: Dict[str, Any]) -> Dict[str, str]:
    """The run's overrides as launched, with the changes later attempts ran with (``launcher retry
    SWEEP --failed key=value``, from restarts.jsonl) shown as ``old -> new``."""
    rd = RunDir(run["dir"])
    ov = sweeps.parse_overrides(rd.overrides().get("overrides") or [])
    for row in rd.restarts():
        for key, new in (row.get("changes") or {}).items():
            base = ov.get(key, "").split(" -> ")[0]
            ov[key] = f"{base} -> {_text(new)}" if base else f"-> {_text(new)}"
    return ov


def point_rows(runs: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """One row per run: status, attempt, restarts, steps done of the total, last loss, and the overrides
    that differ between the points of its sweep."""
    ovs = [_overrides(r) for r in runs]
    keys = sweeps.swept_keys(ovs)
    if len(runs) == 1:  # one run of a sweep: the keys its sweep varies
        whole = [r for r in registry.list_runs(Path(runs[0]["dir"]).parent.parent, refresh=False,
                                               sweep_ids=[runs[0]["sweep_id"]])
                 if r["sweep_id"] == runs[0]["sweep_id"]]
        keys = sweeps.swept_keys([_overrides(r) for r in whole])
    rows = []
    for r, ov in zip(runs, ovs):
        rd = RunDir(r["dir"])
        st = rd.status()
        metrics = rd.metrics()
        total = _steps(r.get("config") or {})
        rows.append({
            "run_id": r["run_id"], "status": r["status"], "attempt": int(st.attempt or 0) or None,
            "restarts": len(rd.restarts()), "step": metrics[-1].get("step") if metrics else 0, "steps": total,
            "loss": metrics[-1].get("loss") if metrics else r.get("final_loss"), "job_id": r.get("job_id"),
            "error": r.get("error"), **{k: ov.get(k, "") for k in keys}, "_keys": keys,
        })
    return rows


def _steps(config: Dict[str, Any]) -> Optional[int]:
    """The steps a run counts to: its recipe's (the contract's steps_key), None where the recipe counts
    none; a config naming no recipe (a Hydra app's may) counts train.steps where it has them."""
    target = recipe_contract.tree_get(config, "recipe._target_")
    if target is None:
        steps = recipe_contract.tree_get(config, "train.steps")
        return steps if isinstance(steps, int) else None
    return recipe_contract.steps(target, lambda key: recipe_contract.tree_get(config, key))


def counts(runs: List[Dict[str, Any]]) -> Dict[str, int]:
    out = {s: 0 for s in STATUSES}
    for r in runs:
        out[r["status"]] = out.get(r["status"], 0) + 1
    return {k: v for k, v in out.items() if v}


def results_table(runs: List[Dict[str, Any]], objective: Optional[str]):
    """(rows best first, swept keys, objective) of a sweep's runs."""
    ovs = [_overrides(r) for r in runs]
    keys = sweeps.swept_keys(ovs)
    summaries = [RunDir(r["dir"]).status().summary or {} for r in runs]
    if not objective:
        subs = [(r.get("config") or {}).get("submit") for r in runs]
        wanted = {str(s.get("objective") or "final_loss") for s in subs if isinstance(s, dict)}
        if not wanted and any("return_value" in s for s in summaries):  # a Hydra app's runs: what the task returned
            wanted = {"return_value"}
        objective = sorted(wanted)[0] if len(wanted) == 1 else "final_loss"
    rows = [sweeps.result_row(r["run_id"], r["status"], ov, summary, keys, objective)
            for r, ov, summary in zip(runs, ovs, summaries)]
    for row, r in zip(rows, runs):
        row["_dir"] = r["dir"]
    return sweeps.ranked(sweeps.sort_results(rows, objective)), keys, objective


def plain(text: Any) -> str:
    """``text`` drawn as it is: matplotlib reads ``$...$`` as mathtext (a swept string ``a$\\x{$`` would
    crash the drawing), so every ``$`` of a value, key or name is escaped."""
    return str(text).replace("$", r"\$")


def pyplot():
    """matplotlib's pyplot on the Agg backend (files only: the login node may have no display)."""
    import matplotlib  # matplotlib: only when a page draws a plot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # matplotlib: only when a page draws a plot

    return plt


def draw_loss_curves(ax, rows: List[Dict[str, Any]], keys: List[str]) -> None:
    """The loss curve of every run of ``rows`` (results_table's) on ``ax``, dotted when it did not complete."""
    curves = 0
    for r in rows:
        m = [x for x in sweeps.current_curve(RunDir(r["_dir"]).metrics()) if x.get("loss") is not None]
        if m:
            label = f"run {SweepDir.index_of(r['run_id'])}"
            label += (": " + " ".join(f"{k}={r[k]}" for k in keys)) if keys else ""
            ax.plot([x["step"] for x in m], [x["loss"] for x in m], label=plain(label[:60]),
                    linestyle="-" if r["status"] == "completed" else ":")
            curves += 1
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("loss per step (dotted: not completed)")
    if 0 < curves <= 20:
        ax.legend(fontsize=7)
    elif not curves:
        ax.text(0.5, 0.5, "no per-step metrics", ha="center", va="center", transform=ax.transAxes)


def draw_objective(ax, rows: List[Dict[str, Any]], key: str, objective: str) -> None:
    """The objective of every run with one against swept ``key``: numbers on a numeric axis (log scale
    when they span 100x or more), other values as categories."""
    key_obj = sweeps.objective_key(objective)
    direction = "higher" if sweeps.higher_is_better(objective) else "lower"
    pts = [(r[key], r["objective"]) for r in rows if r.get("objective") is not None]
    xs = [sweeps.number(x) for x, _ in pts]
    if pts and all(x is not None for x in xs):
        ax.scatter(xs, [y for _, y in pts])
        if min(xs) > 0 and max(xs) / min(xs) >= 100:
            ax.set_xscale("log")
        distinct = sorted(set(xs))
        if len(distinct) <= 8:  # a grid sweep: ticks at the swept values, written as given
            ax.set_xticks(distinct, [f"{x:g}" for x in distinct], fontsize=8)
            ax.minorticks_off()
    else:
        labels = sorted({str(x) for x, _ in pts})
        ax.scatter([labels.index(str(x)) for x, _ in pts], [y for _, y in pts])
        ax.set_xticks(range(len(labels)), [plain(x) for x in labels], rotation=30, fontsize=8)
    ax.set_xlabel(plain(key))
    ax.set_ylabel(plain(key_obj))
    ax.set_title(plain(f"{key_obj} ({direction} is better) vs {key}"))


def plot(rows: List[Dict[str, Any]], keys: List[str], objective: str, path: Path) -> None:
    """Loss curves of every run, and the objective against each swept key, in one PNG (the same
    drawing `launcher report` embeds, one panel per image)."""
    plt = pyplot()
    n = 1 + len(keys)
    fig, axes = plt.subplots(1, n, figsize=(5.5 * n, 4.2), squeeze=False)
    draw_loss_curves(axes[0][0], rows, keys)
    for ax, k in zip(axes[0][1:], keys):
        draw_objective(ax, rows, k, objective)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
