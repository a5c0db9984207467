"""`launcher`: manage archived runs (the Hydra app `launch` starts them).

  launcher runs [--sweep S] [--status ST] [--json]   list runs, oldest first
  launcher logs RUN [--rank N] [--err]              print one rank's log
  launcher cancel RUN_OR_SWEEP                      cancel queued/running jobs
  launcher plan [overrides] [--search] [--json]     memory / speed of a layout, or rank every layout
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import List, Optional

from launcher.archive import registry


def _root(args) -> Path:
    return Path(args.root).expanduser().resolve() if args.root else registry.default_root()


def _select(args, ident: str):
    runs = registry.list_runs(_root(args))
    chosen = [r for r in runs if ident in (r["run_id"], r["sweep_id"], r["dir"])]
    if not chosen:
        sys.exit(f"launcher: no run or sweep {ident!r} under {_root(args)} (see `launcher runs`)")
    return chosen


def cmd_runs(args) -> int:
    runs = registry.list_runs(_root(args))
    if args.sweep:
        runs = [r for r in runs if r["sweep_id"] == args.sweep]
    if args.status:
        runs = [r for r in runs if r["status"] == args.status]
    if args.json:
        print(json.dumps(runs, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table("run_id", "status", "job", "loss", "tokens/s", "dir")
    for r in runs:
        loss = f"{r['final_loss']:.4f}" if r.get("final_loss") is not None else ""
        tps = f"{r['tokens_per_s']:,.0f}" if r.get("tokens_per_s") else ""
        table.add_row(r["run_id"], r["status"], str(r.get("job_id") or ""), loss, tps, r["dir"])
    Console().print(table)
    return 0


def cmd_logs(args) -> int:
    from launcher.archive import atomic, bundle

    (run,) = _select(args, args.run)[:1]
    job = atomic.read_json(Path(run["dir"]) / bundle.JOB_FILE, {}) or {}
    if not job:
        sys.exit(f"launcher: run {run['run_id']} was never submitted")
    folder = Path(job["submitit_folder"])
    path = folder / f"{job['job_id']}_{args.rank}_log.{'err' if args.err else 'out'}"
    if not path.exists():
        sys.exit(f"launcher: no log yet at {path} (rank {args.rank} has not started?)")
    sys.stdout.write(path.read_text(errors="replace"))
    return 0


def cmd_cancel(args) -> int:
    import os
    import signal
    import subprocess

    from launcher.archive import atomic, bundle

    n = 0
    for run in _select(args, args.target):
        if run["status"] in bundle.FINAL:
            continue
        job = atomic.read_json(Path(run["dir"]) / bundle.JOB_FILE, {}) or {}
        if job.get("backend") == "slurm":
            subprocess.run(["scancel", str(job["job_id"])], check=False, timeout=60)
        elif job.get("job_id", "").isdigit():
            try:
                os.kill(int(job["job_id"]), signal.SIGTERM)
            except ProcessLookupError:
                pass
        bundle.set_status(Path(run["dir"]), "cancelled", exit_code=None, error="cancelled by user")
        n += 1
    print(f"cancelled {n} run(s)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="launcher", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--root", help="runs root (default: $LAUNCHER_RUNS or ./runs)")
    sub = p.add_subparsers(dest="cmd", required=True)

    s = sub.add_parser("runs", help="list runs, oldest first", parents=[common])
    s.add_argument("--sweep", help="only this sweep id")
    s.add_argument("--status", choices=registry.bundle.STATUSES, help="only runs in this status")
    s.add_argument("--json", action="store_true", help="machine-readable list")
    s.set_defaults(fn=cmd_runs)

    s = sub.add_parser("logs", help="print one rank's log of a run", parents=[common])
    s.add_argument("run", help="run id (or run dir)")
    s.add_argument("--rank", type=int, default=0)
    s.add_argument("--err", action="store_true", help="stderr instead of stdout")
    s.set_defaults(fn=cmd_logs)

    s = sub.add_parser("cancel", help="cancel a run or every unfinished run of a sweep", parents=[common])
    s.add_argument("target", help="run id or sweep id")
    s.set_defaults(fn=cmd_cancel)

    from launcher.cli import plan_cmd

    plan_cmd.add_parser(sub)
    return p


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.fn(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
