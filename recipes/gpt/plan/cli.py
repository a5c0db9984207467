"""What `launcher plan` and `launcher plan --calibrate RUN...` run for the GPT recipe (its contract's
``plan_command`` and ``calibrate_command``; launcher/cli/plan_cmd.py composes the config and finds
them): the estimate of the layout a config names, or with --search every valid layout for its model,
cluster and global batch, ranked feasible first by predicted step time; and the fit of the cluster's
calibration to measured runs, written into the cluster's config file (docs/calibration.md). Never
imports torch.
"""
from __future__ import annotations

import datetime
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, Optional

from rich.markup import escape

from launcher.archive import atomic
from launcher.cli.plan_cmd import TABLE_TOP
from launcher.config import rules
from launcher.config.layout import Facts
from launcher.config.schema import enum_value
from recipes.gpt.plan.estimate import cluster_json, estimate, model_json
from recipes.gpt.plan.spec import ClusterSpec, LayoutSpec
from recipes.gpt.schema import ModelSpec

if TYPE_CHECKING:
    from recipes.gpt.schema import GPTRunConfig


def _fail(msg: str, code: int = 2) -> int:
    print(f"launcher plan: {msg}", file=sys.stderr)
    return code


def build(cfg: GPTRunConfig, do_search: bool, top: Optional[int]) -> Dict[str, Any]:
    """The report: {"model": ..., "cluster": ..., "layouts": [...]}. Raises ValueError for a layout
    that cannot be estimated (world size or batch not divisible)."""
    from recipes.gpt.plan.search import search  # lazy: only printing pays for it

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
    facts = Facts.from_cfg(cfg)
    errors = rules.problems(facts)
    if not rules.buildable(facts):  # no whole layout (sizes, tp*pp vs the world, the batch split)
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
    from recipes.gpt.plan import checks  # lazy: only printing pays for it

    item = est.as_json()
    item["warnings"] = checks.layout_warnings(cluster, est)
    return item


def plan_command(cfg: GPTRunConfig, args: Any) -> int:
    """`launcher plan [overrides] [--search] [--json] [--top N]` for a composed GPT run config."""
    try:
        report = build(cfg, args.search, args.top)
    except ValueError as e:
        return _fail(f"the config names no layout that can be estimated:\n{e}")
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    _print_table(report, args.top or TABLE_TOP)
    return 0


def calibrate_command(run_dirs: List[Path], args: Any) -> int:
    """`launcher plan --calibrate RUN... [--cluster-file PATH] [--dry-run] [--json]` on these run dirs."""
    from recipes.gpt.plan import calibrate as cal_mod  # the fit: only this subcommand pays for it

    try:
        samples = [cal_mod.read_sample(rdir) for rdir in run_dirs]
        ids = [s.run_id for s in samples]
        dup = sorted({i for i in ids if ids.count(i) > 1})
        if dup:
            raise cal_mod.CalibrationError(f"run {dup[0]} is given more than once")
        cal_mod.check_one_cluster(samples)
        result = cal_mod.fit(samples)
        if args.cluster_file:
            target = Path(args.cluster_file)
        else:
            choice = samples[0].cluster_choice or samples[0].cluster_name
            target = cal_mod.cluster_file(choice)
        new_text = None
        if not args.dry_run:
            if not target.is_file():
                raise cal_mod.CalibrationError(
                    f"cluster: no cluster config file {target} for cluster {samples[0].cluster_name!r}; "
                    f"name the file to write with --cluster-file PATH (or --dry-run)")
            fitted_at = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
            new_text = cal_mod.updated_cluster_file(target.read_text(), result.calibration, ids, fitted_at)
    except cal_mod.CalibrationError as e:
        return _fail(f"--calibrate: {e}\nnothing was written")
    except OSError as e:
        return _fail(f"--calibrate: {e}\nnothing was written")
    if new_text is not None:
        mode = target.stat().st_mode & 0o7777
        try:
            atomic.write_text(target, new_text)
            os.chmod(target, mode)
        except OSError as e:
            return _fail(f"--calibrate: cannot write {target}: {e}")
    table = cal_mod.rows(samples, result.calibration)
    report = {"cluster": samples[0].cluster_name, "calibration": result.calibration.as_dict(),
              "fitted": list(result.fitted), "notes": list(result.notes), "runs": table,
              "cluster_file": str(target), "written": new_text is not None}
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    _print_calibration(report)
    return 0


def _pct(x: Optional[float]) -> str:
    return "-" if x is None else f"{x * 100:+.1f}%"


def _print_calibration(report: Dict[str, Any]) -> None:
    # rich: only the command that prints loads it, not `launcher --help`
    from rich.console import Console
    from rich.table import Column, Table

    from recipes.gpt.plan.calibrate import mean_abs  # lazy: only printing pays for it

    con = Console()
    if not con.is_terminal:
        con = Console(width=170)
    runs = report["runs"]
    table = Table(Column("run", no_wrap=True), "layout",
                  "step planned s", "measured s", "error", "calibrated s", "error",
                  "activations planned", "measured", "error", "calibrated", "error",
                  title=f"cluster {report['cluster']}: {len(runs)} run(s), planner before and after calibration "
                        f"(error = (predicted - measured) / measured)")
    for r in runs:
        st, act = r["step_time_s"], r["activation_bytes"]
        table.add_row(
            escape(r["run_id"]), escape(r["layout"]), f"{st['planned']:.4g}", f"{st['measured']:.4g}",
            _pct(st["error_before"]), f"{st['calibrated']:.4g}", _pct(st["error_after"]),
            _size(act["planned"]), _size(act["measured"]) if act["measured"] is not None else "-",
            _pct(act["error_before"]), _size(act["calibrated"]), _pct(act["error_after"]))
    con.print(table)
    for key, name in (("step_time_s", "step time"), ("activation_bytes", "activation memory")):
        before = mean_abs([r[key]["error_before"] for r in runs])
        after = mean_abs([r[key]["error_after"] for r in runs])
        if before is not None:
            con.print(f"mean |error| of {name}: {before:.1%} before, {after:.1%} after calibration")
    fitted = set(report["fitted"])
    con.print("calibration: " + ", ".join(f"{k} = {v:.6g}" + ("" if k in fitted else " (kept)")
                                          for k, v in report["calibration"].items()))
    for note in report["notes"]:
        con.print(f"note: {note}", style="yellow", markup=False)
    if report["written"]:
        con.print(f"written to {report['cluster_file']} (its `calibration:` block); every estimate for this "
                  f"cluster now uses it", markup=False)
    else:
        con.print(f"dry run: {report['cluster_file']} not changed", markup=False)


def _size(n: float) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{int(n)}B"


def _print_table(report: Dict[str, Any], top: int) -> None:
    # rich: only the command that prints loads it, not `launcher --help`
    from rich.console import Console
    from rich.table import Table

    con = Console()
    if not con.is_terminal:
        con = Console(width=170)
    m, c = report["model"], report["cluster"]
    con.print(
        f"[bold]{escape(str(m['name']))}[/]: {m['params']:,} parameters (formula {m['params_formula']:,}), "
        f"{m['global_batch_size']} x {m['seq_len']} tokens per step, "
        f"{m['model_flops_per_step']:.3g} model FLOPs per step"
    )
    mem = f"{_size(c['memory_bytes'])} ({_size(c['usable_bytes'])} usable; {escape(c['memory_source'])})" \
        if c["memory_bytes"] else "unknown (no memory check)"
    con.print(
        f"cluster [bold]{escape(str(c['name']))}[/]: {c['nodes']} x {c['gpus_per_node']} GPUs, memory per GPU {mem}, "
        f"peak {c['peak_tflops']:g} TFLOP/s, links {c['intra_node_gbps']:g} / {c['inter_node_gbps']:g} GB/s"
    )
    if c["assumed"]:
        con.print(f"[yellow]assumed (unknown in the cluster config): {', '.join(c['assumed'])}[/]")
    if c.get("calibration"):
        con.print("calibrated (cluster.calibration): " + ", ".join(f"{k} {v:.4g}" for k, v in c["calibration"].items()))
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
