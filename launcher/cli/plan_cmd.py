"""`launcher plan [overrides] [--search] [--json] [--top N]`: memory, communication and speed of a layout.

Composes the run config exactly as `launch` does (same conf/, same overrides), then evaluates the
layout it names, or with --search every valid layout for its model, cluster and global batch, ranked
feasible first by predicted step time. Never imports torch; answers in milliseconds.
"""
from __future__ import annotations

import json
import sys
from typing import Any, Dict, List, Optional


TABLE_TOP = 20


def compose(overrides: List[str]) -> Any:
    """The run config for these overrides (Hydra compose API, conf/ of launcher.app)."""
    from hydra import compose as hydra_compose, initialize_config_dir

    from launcher.app import CONF_DIR, normalize_overrides

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return hydra_compose(config_name="config", overrides=normalize_overrides(list(overrides)))


def _fail(msg: str, code: int = 2) -> int:
    print(f"launcher plan: {msg}", file=sys.stderr)
    return code


def build(cfg: Any, do_search: bool, top: Optional[int]) -> Dict[str, Any]:
    """The report: {"model": ..., "cluster": ..., "layouts": [...]}. Raises ValueError for a layout
    that cannot be estimated (world size or batch not divisible)."""
    from launcher import layout as layout_mod
    from launcher.plan.estimate import cluster_json, estimate, model_json
    from launcher.plan.params import ModelSpec
    from launcher.plan.search import search
    from launcher.plan.spec import ClusterSpec, LayoutSpec
    from launcher.schema import enum_value

    m = ModelSpec.from_cfg(cfg.model)
    cluster = ClusterSpec.from_cfg(cfg.cluster)
    gbs = int(cfg.train.global_batch_size)
    report: Dict[str, Any] = {"model": model_json(m, gbs), "cluster": cluster_json(cluster)}
    if do_search:
        z = cfg.zero
        ests = search(m, cluster, gbs, enum_value(cfg.precision.dtype), bool(z.offload_optimizer),
                      bool(z.offload_params), top=top)
        report["layouts"] = [_layout_json(cluster, e) for e in ests]
        report["searched"] = True
        return report
    facts = layout_mod.Facts.from_cfg(cfg)
    errors = layout_mod.check(facts)
    if not layout_mod.buildable(facts):  # no whole layout (sizes, tp*pp vs the world, the batch split)
        raise ValueError("\n".join(f"- {e}" for e in errors))
    est = estimate(m, cluster, LayoutSpec.from_cfg(cfg))
    item = _layout_json(cluster, est)
    if errors:  # other rules broken: the estimate is kept, with the violations as its reasons
        item["feasible"] = False
        item["reasons"] = [str(e) for e in errors] + item["reasons"]
    report["layouts"] = [item]
    report["searched"] = False
    return report


def _layout_json(cluster: Any, est: Any) -> Dict[str, Any]:
    from launcher.plan import checks

    item = est.as_json()
    item["warnings"] = checks.layout_warnings(cluster, est)
    return item


def cmd_plan(args) -> int:
    try:
        cfg = compose(args.overrides)
    except Exception as e:  # Hydra/OmegaConf composition errors: unknown key, bad type, bad group option
        cause = f"\n  ({e.__cause__})" if e.__cause__ is not None else ""
        return _fail(f"cannot compose the config: {e}{cause}")
    try:
        report = build(cfg, args.search, args.top)
    except ValueError as e:
        return _fail(f"the config names no layout that can be estimated:\n{e}")
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    _print_table(report, args.top or TABLE_TOP)
    return 0


def _size(n: float) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{int(n)}B"


def _print_table(report: Dict[str, Any], top: int) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    con = Console()
    if not con.is_terminal:
        con = Console(width=170)
    m, c = report["model"], report["cluster"]
    con.print(
        f"[bold]{escape(str(m['name']))}[/]: {m['params']:,} parameters (formula {m['params_formula']:,}), "
        f"{m['global_batch_size']} x {m['seq_len']} tokens per step, {m['model_flops_per_step']:.3g} model FLOPs per step"
    )
    mem = f"{_size(c['memory_bytes'])} ({_size(c['usable_bytes'])} usable; {escape(c['memory_source'])})" \
        if c["memory_bytes"] else "unknown (no memory check)"
    con.print(
        f"cluster [bold]{escape(str(c['name']))}[/]: {c['nodes']} x {c['gpus_per_node']} GPUs, memory per GPU {mem}, "
        f"peak {c['peak_tflops']:g} TFLOP/s, links {c['intra_node_gbps']:g} / {c['inter_node_gbps']:g} GB/s"
    )
    if c["assumed"]:
        con.print(f"[yellow]assumed (unknown in the cluster config): {', '.join(c['assumed'])}[/]")
    layouts = report["layouts"]
    title = f"{len(layouts)} layout(s)" + (f", best {min(top, len(layouts))} shown" if len(layouts) > top else "")
    table = Table("#", "dp", "tp", "pp", "zero", "mb", "accum", "recompute", "sp", "engine", "mem/GPU", "bubble",
                  "step s", "TFLOP/s", "MFU", "fits", title=title)
    for i, lay in enumerate(layouts[:top], 1):
        zero = str(lay["zero"]) + ("+offload" if lay["offload_optimizer"] else "")
        mfu = f"{lay['mfu']:.1%}" if lay["mfu"] is not None else "-"
        fits = "yes" if lay["feasible"] else "[red]no[/]"
        if lay["warnings"]:
            fits += " [yellow]warn[/]"
        table.add_row(
            str(i), str(lay["dp"]), str(lay["tp"]), str(lay["pp"]), zero, str(lay["micro_batch_size"]),
            str(lay["grad_accum"]), lay["recompute"], "yes" if lay["sequence_parallel"] else "", lay["engine"],
            _size(lay["memory_bytes"]["total"]), f"{lay['bubble']:.0%}", f"{lay['step_time_s']:.3g}",
            f"{lay['tflops_per_gpu']:.1f}", mfu, fits,
        )
    con.print(table)
    if not report.get("searched") and layouts:
        lay = layouts[0]
        con.print("memory per GPU: " + ", ".join(f"{k} {_size(v)}" for k, v in lay["memory_bytes"].items())
                  + f" ({lay['memory_stage']} stage); sent per GPU per step: "
                  + ", ".join(f"{k} {_size(v)}" for k, v in lay["comm_bytes"].items()))
        for r in lay["reasons"]:
            con.print(f"infeasible: {r}", style="red", markup=False)
        for w in lay["warnings"]:
            con.print(f"warning: {w}", style="yellow", markup=False)


def add_parser(sub) -> None:
    s = sub.add_parser("plan", help="estimate memory, communication and step time of a layout (or --search all)",
                       description=__doc__)
    s.add_argument("overrides", nargs="*", help="Hydra overrides, as for `launch` (model=gpt_1b3 cluster=a100_80g ...)")
    s.add_argument("--search", action="store_true", help="enumerate and rank every valid layout")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.add_argument("--top", type=int, default=None, help=f"show the best N layouts (table default {TABLE_TOP}, JSON all)")
    s.set_defaults(fn=cmd_plan)
