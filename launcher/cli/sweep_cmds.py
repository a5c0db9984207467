"""`launcher status | retry | results`: a sweep as a whole (thin over launcher.archive.registry,
launcher.submit.resume, launcher.sweep_view and the pure tables of launcher.sweeps).

  launcher status [SWEEP|RUN] [--watch]        counts per state and one row per point
  launcher retry SWEEP --failed [key=value]    the failed points again, as one array of new attempts
  launcher results SWEEP [--csv] [--plot F]    swept overrides and final metrics, best first
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

from omegaconf import OmegaConf
from rich.text import Text

from launcher import sweeps
from launcher.archive import registry
from launcher.config.errors import ConfigErrors
from launcher.run.rundir import RunDir, SweepDir
from launcher.run.status import FINAL
from launcher.sweep_view import counts, plot, point_rows, results_table

RETRYABLE = ("failed", "cancelled", "timeout")


def _console():
    """Rich's console: the terminal's width (or COLUMNS'); no limit where the output is piped (every column
    kept): launcher.cli.tables."""
    from launcher.cli import tables

    return tables.console()


def sweep_runs(root: Path, ident: Optional[str], refresh: bool = True) -> List[Dict[str, Any]]:
    """The runs ``ident`` names (a sweep id, a run id or a run dir; none: the newest sweep), oldest
    first, settled: a run whose job ended without recording an outcome gets the one its scheduler
    state implies (launcher.run.outcome), so status, retry and results count it as ended; a final run
    whose seal is due is sealed once its job has ended."""
    def select(runs: List[Dict[str, Any]]) -> List[Dict[str, Any]]:  # only these runs are refreshed
        return _chosen(runs, root, ident)

    def listed() -> List[Dict[str, Any]]:  # read from the index by the sweep named (registry.list_named)
        if ident is not None:
            return registry.list_named(root, ident, lambda runs: _matching(runs, ident), refresh=refresh)
        newest = registry.list_runs(root, refresh=False, newest=1, configs=False)  # the newest run's sweep
        return registry.list_runs(root, refresh=refresh, select=lambda runs: _matching(runs, None),
                                  sweep_ids=[newest[0]["sweep_id"]]) if newest else []

    # nothing found: listed again whole, for the refusal that names what is missing (_chosen)
    chosen = listed() or registry.list_runs(root, refresh=refresh, select=select)
    # and a final run whose seal its job left due (one stat of its manifest): sealed once its job ended
    lost = [RunDir(r["dir"]) for r in chosen if (r.get("job_ended") and r["status"] not in FINAL)
            or (r["status"] in FINAL and RunDir(r["dir"]).seal_due())]
    if lost:
        from launcher.run import outcome  # lazy: only this subcommand pays for it, not `launcher --help`

        outcome.settle_all(lost)
        chosen = listed()
    return chosen


def _chosen(runs: List[Dict[str, Any]], root: Path, ident: Optional[str]) -> List[Dict[str, Any]]:
    if not runs:
        sys.exit(f"launcher: no runs under {root}")
    chosen = _matching(runs, ident)
    if not chosen:
        sys.exit(f"launcher: no sweep or run {ident!r} under {root} (see `launcher runs`)")
    return chosen


def _matching(runs: List[Dict[str, Any]], ident: Optional[str]) -> List[Dict[str, Any]]:
    """The runs of sweep ``ident``, else the run it names (run id or run dir); None: the newest sweep's."""
    if ident is None:
        if not runs:
            return []
        newest = max(runs, key=lambda r: (r.get("created") or "", r["sweep_id"]))["sweep_id"]
        return [r for r in runs if r["sweep_id"] == newest]
    chosen = [r for r in runs if r["sweep_id"] == ident]
    return chosen or [r for r in runs if ident in (r["run_id"], r["dir"]) or
                      (Path(ident).exists() and Path(r["dir"]) == Path(ident).resolve())]


# ---- status --------------------------------------------------------------------------------------


def _status_view(runs: List[Dict[str, Any]], width: int):
    # rich: only the command that prints loads it, not `launcher --help`
    from rich.console import Group

    from launcher.cli import tables

    rows = point_rows(runs)
    keys = rows[0]["_keys"] if rows else []
    sweep_ids = sorted({r["sweep_id"] for r in runs})
    head = Text(f"sweep {', '.join(sweep_ids)}: {len(runs)} run(s)  " +
                "  ".join(f"{k} {v}" for k, v in counts(runs).items()))
    cells = []
    for r in rows:
        step = f"{r['step']}/{r['steps']}" if r["steps"] else str(r["step"])
        cells.append((r["run_id"], r["status"], r["attempt"] or "", r["restarts"], step, sweeps.fmt(r["loss"]),
                      *(r[k] for k in keys), r["job_id"] or ""))
    # one line per point: in a narrow terminal job, restarts and attempt go first (--json has them), then
    # the widest cells are cut
    table, dropped = tables.one_line_table(("run_id", "status", "attempt", "restarts", "step", "loss", *keys, "job"),
                                           cells, width, optional=("job", "restarts", "attempt"), right=("step",))
    note = tables.left_out_line(dropped, width, "--json")
    return Group(head, table, *([note] if note is not None else []))


def rung_summary(runs: List[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    """sweep=asha: the sweep's rung table and compute spent against the full grid (None: no scheduler)."""
    if not runs:
        return None
    from launcher.features.asha import rungs, schedule as asha  # lazy: only the commands that show a sweep

    sweep = {r["sweep_id"] for r in runs}
    if len(sweep) != 1:
        return None
    summ = rungs.summary(SweepDir(Path(runs[0]["dir"]).parent))
    if summ is not None and summ.get("scheduler") != "pbt":  # (sweep=pbt's lines: its generations, lineages)
        summ["lines"] = asha.describe(summ)
    return summ


def _print_rungs(console: Any, runs: List[Dict[str, Any]]) -> None:
    summ = rung_summary(runs)
    if summ is not None:
        title = "population-based training (sweep=pbt)" if summ.get("scheduler") == "pbt" else \
            "successive halving (sweep=asha)"
        console.print(Text(f"{title}:\n" + "\n".join(summ["lines"])))


def _waves(runs: List[Dict[str, Any]]) -> Any:
    """The plan of the sweep's waves (launcher.submit.waves), when it was queued in waves."""
    from launcher.run.rundir import SweepDir

    return SweepDir(Path(runs[0]["dir"]).parent).waves() if runs else None


def cmd_status(args) -> int:
    console = _console()
    if args.json:
        runs = sweep_runs(args._root, args.target)
        rows = [{k: v for k, v in r.items() if k != "_keys"} for r in point_rows(runs)]
        plan = _waves(runs)
        print(json.dumps({"counts": counts(runs), "swept": point_rows(runs)[0]["_keys"] if runs else [],
                          "runs": rows, "rungs": rung_summary(runs),
                          "waves": plan.to_json() if plan is not None else None}, indent=2))
        return 0
    if not args.watch:
        runs = sweep_runs(args._root, args.target)
        console.print(_status_view(runs, console.width))
        _print_rungs(console, runs)
        plan = _waves(runs)
        if plan is not None:  # queued in waves: where they stand
            console.print(Text(plan.describe()))
        return 0
    from rich.live import Live  # rich: only the command that prints loads it, not `launcher --help`

    runs = sweep_runs(args._root, args.target)
    with Live(_status_view(runs, console.width), console=console, refresh_per_second=4) as live:
        try:
            while not all(r["status"] in FINAL for r in runs):
                time.sleep(args.interval)
                runs = sweep_runs(args._root, args.target)
                live.update(_status_view(runs, console.width))
        except KeyboardInterrupt:
            pass
    return 0


# ---- retry ---------------------------------------------------------------------------------------


def cmd_retry(args) -> int:
    # lazy: only this subcommand pays for it, not `launcher --help`
    from launcher.submit.progress import wait_and_report
    from launcher.submit.resume import resubmit

    if args.failed is None:
        print("launcher retry: say which points to retry: --failed (the failed, cancelled and timed-out ones)",
              file=sys.stderr)
        return 2
    runs = sweep_runs(args._root, args.sweep)
    if len({r["sweep_id"] for r in runs}) != 1 or runs[0]["sweep_id"] != args.sweep:
        print(f"launcher retry: {args.sweep!r} is not a sweep id (see `launcher runs`)", file=sys.stderr)
        return 2
    todo = [r for r in runs if r["status"] in RETRYABLE]
    if not todo:
        print(f"sweep {args.sweep}: no failed, cancelled or timed-out runs to retry "
              f"({', '.join(f'{k} {v}' for k, v in counts(runs).items())})")
        return 0
    try:
        result = resubmit([Path(r["dir"]) for r in todo], reason="retry",
                          changes=list(args.overrides) + list(args.failed))
    except (ConfigErrors, FileNotFoundError, ValueError) as e:
        print(f"launcher retry: {e}", file=sys.stderr)
        return 2
    print(f"sweep {args.sweep}: {len(result.runs)} run(s) retried as {', '.join(result.job_ids)}")
    wait = args.wait if args.wait is not None else bool(result.backend.waits)
    if not wait:
        print(f"watch: launcher status {args.sweep}" + (f" --root {args.root}" if args.root else ""))
        return 0
    points = [type("P", (), {"cfg": OmegaConf.create(r.rundir.config())})() for r in result.runs]
    return 0 if wait_and_report(result, points, sys.stdout) else 1


# ---- results -------------------------------------------------------------------------------------


def cmd_results(args) -> int:
    runs = sweep_runs(args._root, args.sweep)
    rows, keys, objective = results_table(runs, args.objective)
    if args.plot:
        plot(rows, keys, objective, Path(args.plot))
        print(f"wrote {args.plot}", file=sys.stderr)
    if args.csv:
        sys.stdout.write(sweeps.to_csv(rows, keys))
        return 0
    if args.json:
        print(json.dumps({"objective": objective, "higher_is_better": sweeps.higher_is_better(objective),
                          "swept": keys, "rows": [{k: v for k, v in r.items() if k != "_dir"} for r in rows],
                          "rungs": rung_summary(runs)}, indent=2))
        return 0
    from rich.table import Column, Table  # rich: only the command that prints loads it, not `launcher --help`

    direction = "higher" if sweeps.higher_is_better(objective) else "lower"
    table = Table(*(Column(c, no_wrap=c == "run_id") for c in sweeps.columns(keys)),
                  title=f"sweep {runs[0]['sweep_id']}: best first by {sweeps.objective_key(objective)} "
                        f"({direction} is better)")
    for r in rows:
        table.add_row(*(Text(sweeps.fmt(r.get(c))) for c in sweeps.columns(keys)))
    console = _console()
    console.print(table)
    _print_rungs(console, runs)
    return 0


# ---- registration --------------------------------------------------------------------------------


def add_parsers(sub, parents) -> None:
    s = sub.add_parser("status", help="a sweep's counts per state and one row per point (--watch refreshes)",
                       parents=parents)
    s.add_argument("target", nargs="?", metavar="SWEEP|RUN", help="sweep id or run id (default: the newest sweep)")
    s.add_argument("--watch", action="store_true", help="refresh until every run has ended (Ctrl-C stops)")
    s.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes (--watch)")
    s.add_argument("--json", action="store_true", help="machine-readable counts and rows")
    s.set_defaults(fn=cmd_status)

    s = sub.add_parser("retry", help="submit a sweep's failed points again, as one array of new attempts of the "
                       "same runs", parents=parents)
    s.add_argument("sweep", help="sweep id")
    # `retry S --failed k=v`: the changes may follow --failed (argparse takes no positional after an option)
    s.add_argument("--failed", nargs="*", metavar="key=value", default=None,
                   help="the failed, cancelled and timed-out points (required); key=value changes to their "
                   "archived configs may follow (recorded in restarts.jsonl; the layout must stay the same)")
    s.add_argument("overrides", nargs="*", metavar="key=value", help="changes, as after --failed")
    g = s.add_mutually_exclusive_group()
    g.add_argument("--wait", dest="wait", action="store_true", default=None,
                   help="wait for the jobs and show progress (default for local runs)")
    g.add_argument("--no-wait", dest="wait", action="store_false", help="return once submitted (default for Slurm)")
    s.set_defaults(fn=cmd_retry)

    s = sub.add_parser("results", help="a sweep's swept overrides and final metrics, best first", parents=parents)
    s.add_argument("sweep", help="sweep id")
    s.add_argument("--objective", default=None, help="summary key to rank by (default: the sweep's "
                   "submit.objective, final_loss; a Hydra app's runs: return_value); lower is better unless it "
                   "names a rate (*_per_s, tflops, mfu) "
                   "or a score (accuracy, f1, ...); a leading + or - forces higher / lower")
    s.add_argument("--csv", action="store_true", help="CSV on stdout")
    s.add_argument("--json", action="store_true", help="machine-readable rows")
    s.add_argument("--plot", metavar="FILE.png", help="write the loss curves and the objective against each "
                   "swept key to this PNG")
    s.set_defaults(fn=cmd_results)
