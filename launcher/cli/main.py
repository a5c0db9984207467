"""`launcher`: manage archived runs (the Hydra app `launch` starts them).

  launcher runs [--sweep S] [--status ST] [--json]   list runs, oldest first
  launcher logs RUN [--rank N] [--err]              print one rank's log
  launcher cancel RUN_OR_SWEEP                      cancel queued/running jobs
  launcher show RUN | diff RUN_A RUN_B              read the archive
  launcher reproduce RUN [key=value ...]            re-run from the archived config, code and seeds
  launcher runs --reindex | --tag T | key=value     rebuild the index; filter
  launcher plan [overrides] [--search] [--json]     memory / speed of a layout, or rank every layout
  launcher plan --calibrate RUN... [--dry-run]      fit the planner to measured runs of a cluster
  launcher doctor RUN [--json]                      why a run failed (its class), the evidence, the fix
  launcher status [SWEEP|RUN] [--watch]             a sweep's counts per state and one row per point
  launcher retry SWEEP --failed [key=value ...]     the failed points again, one array of new attempts
  launcher results SWEEP [--csv] [--plot F.png]     swept overrides and final metrics, best first
  launcher report RUN|SWEEP [-o F.html]             one self-contained HTML page: plots, plan vs measured, layout
  launcher preflight [overrides] [--steps N]        the check ladder before a large run: go / no-go per rung
  launcher verify-resume [RUN] [overrides] [--at K]  whether it resumes exactly: stopped and resumed vs straight
  launcher nodes [--clear NODE] [--json]            the node-health ledger: suspect and excluded nodes, why
  launcher data prepare FILE... -o DIR              text files -> a tokenized dataset (docs/data.md)
  launcher data show DIR | verify DIR               a dataset's summary; its files checked against its manifest
"""
from __future__ import annotations

import argparse
import codecs
import json
import sqlite3
import sys
from pathlib import Path
from typing import List, Optional

import yaml

from launcher import backends
from launcher.archive import registry
from launcher.cli import (
    archive_cmds,
    data_cmd,
    doctor_cmd,
    nodes_cmd,
    plan_cmd,
    preflight_cmd,
    report_cmd,
    sweep_cmds,
    verify_cmd,
)
from launcher.printable import printable
from launcher.run.io import open_regular
from launcher.run.rundir import RunDir, SweepDir, Unreadable
from launcher.run.status import FINAL, STATUSES


def _root(args) -> Path:
    return Path(args.root).expanduser().resolve() if args.root else registry.default_root()


def _select(args, ident: str):
    # only the runs named are refreshed: a command costs what it is asked about, not the whole root
    def select(runs):
        return [r for r in runs if ident in (r["run_id"], r["sweep_id"], r["dir"])]

    chosen = registry.list_named(_root(args), ident, select)
    if not chosen and RunDir(Path(ident)).exists():  # a run dir outside --root, as --help offers: its own root
        run_dir = Path(ident).resolve()
        chosen = [r for r in registry.list_runs(run_dir.parent.parent, select=lambda runs: [
            r for r in runs if Path(r["dir"]).resolve() == run_dir])]
    if not chosen:
        sys.exit(f"launcher: no run or sweep {ident!r} under {_root(args)} (see `launcher runs`)")
    return chosen


def _where(pairs: List[str]) -> dict:
    where = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            sys.exit(f"launcher runs: filter {pair!r} is not key=value (e.g. optim.lr=0.001)")
        where[key] = yaml.safe_load(value)
    return where


TABLE_LAST = 50  # the runs a table lists by default: a root of 100,000 is read from its index, not listed whole


def cmd_runs(args) -> int:
    from launcher.submit.interrupted import repair  # lazy: the listing's own imports stay light

    for line in repair(_root(args)):  # launches killed mid-way: what they queued published or cancelled
        print(f"launcher runs: {line}", file=sys.stderr)
    if args.reindex:
        try:
            n = registry.reindex(_root(args))
            print(f"reindexed {n} run(s) under {_root(args)}", file=sys.stderr)
        except (sqlite3.OperationalError, OSError) as e:  # a full disk, a read-only archive: the old index stays
            print(f"launcher runs --reindex: {registry.unwritable(_root(args), e)}; nothing was changed",
                  file=sys.stderr)
    where = _where(args.filters)
    last = args.last if args.last is not None else None if args.json or args.all else TABLE_LAST
    filtered = bool(args.status or args.tag or where)
    sweep_ids = [args.sweep] if args.sweep else None
    # without filters, the newest are read from the index alone, and only they are refreshed
    runs = registry.list_runs(_root(args), sweep_ids=sweep_ids, newest=None if filtered else last,
                              configs=bool(args.json or where))
    if args.status:
        runs = [r for r in runs if r["status"] == args.status]
    if args.tag:
        runs = [r for r in runs if args.tag in (r.get("tags") or [])]
    runs = [r for r in runs if registry.matches(r, where)]
    older = (len(runs) if filtered else registry.count(_root(args), sweep_ids)) - (last or 0) if last is not None else 0
    if last is not None:
        runs = runs[len(runs) - min(len(runs), max(0, last)):]
    if args.json:
        # one run a line: json's C encoder (indent= takes the pure-Python one, ~5x slower at 10,000 runs)
        print("[\n" + ",\n".join(json.dumps(r) for r in runs) + "\n]" if runs else "[]")
        return 0
    if not runs:
        print(f"no runs under {_root(args)}" + (" matching the filters" if args.filters or args.sweep or args.status
                                                or args.tag else ""), file=sys.stderr)
        return 0
    from launcher.cli import tables  # rich: only the command that prints loads it, not `launcher --help`

    rows = []
    for r in runs:
        loss = f"{r['final_loss']:.4f}" if r.get("final_loss") is not None else _result(r.get("return_value"))
        tps = f"{r['tokens_per_s']:,.0f}" if r.get("tokens_per_s") else ""
        rows.append((r["run_id"], _status_cell(r), r["class"] or "", r.get("job_id") or "", loss, tps, r["dir"]))
    # one line per run: in a narrow terminal the dir goes first (`launcher show RUN` names it), then class,
    # tokens/s and job; piped (COLUMNS unset), every column whole
    console = tables.console()
    table, dropped = tables.one_line_table(("run_id", "status", "class", "job", "loss/result", "tokens/s", "dir"),
                                           rows, console.width, optional=("dir", "class", "tokens/s", "job"),
                                           right=("loss/result", "tokens/s"))
    console.print(table)
    note = tables.left_out_line(dropped, console.width, "launcher show RUN, --json")
    if note is not None:
        console.print(note)
    if older > 0:
        print(f"({older:,} older run(s) not listed: --last N, --all, --sweep S)", file=sys.stderr)
    return 0


def _status_cell(r) -> str:
    """The recorded status; for a job that ended without recording an outcome, the scheduler's word too
    (`launcher status` records the outcome it implies; listing writes nothing). A run whose manifest
    or status was removed after it was sealed or started is not pending: it reads as tampered."""
    if r["status"] not in FINAL and r.get("tampered"):
        return "tampered (launcher show RUN)"
    if r.get("job_ended") and r["status"] not in FINAL and r["status"] != "paused":  # paused: on purpose (sweep=asha)
        return f"{r['status']} (job ended: {r['job_state']})"
    return r["status"]


def _result(value) -> str:
    """A Hydra app's return value, short."""
    if value is None:
        return ""
    text = f"{value:.6g}" if isinstance(value, float) else str(value)
    return text if len(text) <= 24 else text[:23] + "…"


def cmd_logs(args) -> int:
    (run,) = _select(args, args.run)[:1]
    job = RunDir(run["dir"]).job()
    if not job:
        sys.exit(f"launcher: run {run['run_id']} was never submitted")
    job = job.read_in(Path(run["dir"]).parent)  # a copied archive's own logs, not its original's
    path = backends.get(job.backend).log_path(job, args.rank, err=args.err)
    if not path.exists():
        sys.exit(f"launcher: no log yet at {path} (rank {args.rank} has not started?)")
    try:
        f = open_regular(path)  # a log linked to /dev/zero, or a FIFO, is refused, never read
    except (OSError, Unreadable) as e:
        sys.exit(f"launcher: {path}: {e}")
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")  # a character split between chunks kept
    with f:  # streamed in chunks: a log of any size in constant memory
        for chunk in iter(lambda: f.read(1 << 20), b""):
            text = decoder.decode(chunk)
            # to a terminal, a rank's ESC/OSC sequences are shown, not obeyed (\r kept: progress bars)
            sys.stdout.write(printable(text, keep="\n\t\r") if sys.stdout.isatty() else text)
    return 0


def cmd_cancel(args) -> int:
    from launcher.submit import waves
    from launcher.submit.progress import cancel_runs  # lazy: only this subcommand pays for it, not `launcher --help`

    chosen = _select(args, args.target)
    # a sweep in waves: its wave job first (it queues no more), then every run, the waiting ones too (all of
    # them are published at launch, so the runs chosen are all there are)
    stopped = [line for d in dict.fromkeys(Path(r["dir"]).parent for r in chosen if r["sweep_id"] == args.target)
               if (line := waves.cancel(SweepDir(d))) is not None]
    n = cancel_runs([RunDir(r["dir"]) for r in chosen if r["status"] not in FINAL], "cancelled by user")
    print(f"cancelled {n} run(s)" + "".join(f"; {line}" for line in stopped))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="launcher", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--root", help="runs root (default: $LAUNCHER_RUNS or ./runs)")
    sub = p.add_subparsers(dest="cmd", required=True)

    s = sub.add_parser("runs", help=f"list runs, oldest first (the table: the newest {TABLE_LAST})", parents=[common])
    s.add_argument("--sweep", help="only this sweep id")
    s.add_argument("--status", choices=STATUSES, help="only runs in this status")
    s.add_argument("--tag", help="only runs with this tag (launch tags=[a,b])")
    s.add_argument("filters", nargs="*", metavar="key=value", help="resolved-config filters, e.g. zero.stage=2")
    s.add_argument("--reindex", action="store_true", help="rebuild the SQLite index from the run dirs first")
    s.add_argument("--json", action="store_true", help="machine-readable list (every run, unless --last)")
    s.add_argument("--last", type=int, metavar="N",
                   help=f"only the newest N runs that match (the table's default: {TABLE_LAST}); only they are "
                        "refreshed")
    s.add_argument("--all", action="store_true", help="the table lists every run that matches")
    s.set_defaults(fn=cmd_runs)

    s = sub.add_parser("logs", help="print one rank's log of a run", parents=[common])
    s.add_argument("run", help="run id (or run dir)")
    s.add_argument("--rank", type=int, default=0)
    s.add_argument("--err", action="store_true", help="stderr instead of stdout")
    s.set_defaults(fn=cmd_logs)

    s = sub.add_parser("cancel", help="cancel a run or every unfinished run of a sweep", parents=[common])
    s.add_argument("target", help="run id or sweep id")
    s.set_defaults(fn=cmd_cancel)

    s = sub.add_parser("show", help="summary of a run's archive", parents=[common])
    s.add_argument("run", help="run id or run dir")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=archive_cmds.cmd_show)

    s = sub.add_parser("diff", help="config, seeds, topology, code and metrics differences of two runs, and "
                       "their resumes on another layout",
                       parents=[common])
    s.add_argument("run_a")
    s.add_argument("run_b")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=archive_cmds.cmd_diff)

    s = sub.add_parser("reproduce", help="launch a new run from an archived run's config, code and seeds "
                       "(a Hydra app's run: the app started again from its code snapshot with the run's "
                       "overrides, on the same launcher)", parents=[common])
    s.add_argument("run", help="run id or run dir")
    s.add_argument("overrides", nargs="*", metavar="key=value", help="changes to the archived config")
    s.add_argument("--trust-unverified", action="store_true",
                   help="reproduce a run whose seal does not verify or that lies outside the runs root; what did "
                        "not verify is recorded in the reproduction's run.json (trusted_unverified)")
    s.set_defaults(fn=archive_cmds.cmd_reproduce)

    s = sub.add_parser("resume", help="continue a failed, cancelled or finished run from its latest checkpoint, "
                       "as a new attempt of the same run", parents=[common])
    s.add_argument("run", help="run id or run dir")
    s.add_argument("overrides", nargs="*", metavar="key=value",
                   help="changes to the run's config for the next attempt (checked first, as retry's); dp, "
                   "tp, pp, engine, ZeRO stage and node count may change (the checkpoint is resharded, same "
                   "global batch)")
    s.add_argument("--steps", type=int, default=None, help="train this many steps in all (more than before)")
    g = s.add_mutually_exclusive_group()
    g.add_argument("--wait", dest="wait", action="store_true", default=None,
                   help="wait for the job and show progress (default for local runs)")
    g.add_argument("--no-wait", dest="wait", action="store_false", help="return once submitted (default for Slurm)")
    s.set_defaults(fn=archive_cmds.cmd_resume)

    plan_cmd.add_parser(sub)
    doctor_cmd.add_parser(sub, parents=[common])
    sweep_cmds.add_parsers(sub, parents=[common])
    report_cmd.add_parser(sub, parents=[common])
    preflight_cmd.add_parser(sub, parents=[common])
    verify_cmd.add_parser(sub, parents=[common])
    nodes_cmd.add_parser(sub, parents=[common])
    data_cmd.add_parser(sub)
    return p


def parse(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """The command line, with a command's ``key=value`` changes taken before and after its options alike
    (``launcher resume RUN --steps 80 cluster.nodes=2``: argparse alone stops the list at the option)."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    listed = next((n for n in ("overrides", "target") if isinstance(getattr(args, n, None), list)), None)
    if extra and listed and all("=" in e and not e.startswith("-") for e in extra):
        setattr(args, listed, [*getattr(args, listed), *extra])
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


# the longest run id, sweep id or path a command takes (PATH_MAX); a path's parts at most NAME_MAX each
IDENT_MAX, NAME_MAX = 4096, 255


def ident_problem(args) -> Optional[str]:
    """Why an id or path given to a command can name nothing (too long for the file system), with its
    argument named: said before any file is looked up (a 5,000-character id raised ENAMETOOLONG)."""
    for name in ("run", "target", "run_a", "run_b", "sweep", "dir", "root", "output"):
        for value in (lambda v: v if isinstance(v, list) else [v])(getattr(args, name, None)):
            if not isinstance(value, str):
                continue
            if len(value) > IDENT_MAX or any(len(part.encode()) > NAME_MAX for part in value.split("/")):
                shown = name.upper() if name not in ("root", "output") else f"--{name}"
                return (f"{shown}: {len(value):,} characters ({value[:40]}...) name no run, sweep or path: an id "
                        f"is at most {NAME_MAX} characters, a path {IDENT_MAX} (each of its parts {NAME_MAX})")
    return None


def main(argv: Optional[List[str]] = None) -> int:
    args = parse(argv)
    problem = ident_problem(args)
    if problem:
        print(f"launcher {args.cmd}: {problem}", file=sys.stderr)
        return 2
    args._root = _root(args) if hasattr(args, "root") else None
    registry.new_command()
    from launcher.cli.scrubbed import errors_scrubbed  # lazy: `launcher --help` never loads the secret rules

    with errors_scrubbed(sys.argv[1:] if argv is None else argv, "launcher"):  # an error never echoes a secret
        try:
            return int(args.fn(args) or 0)
        except Unreadable as e:  # the one run dir a command was asked about is junk
            where = f"{e.path.parent}: " if e.path is not None else ""
            print(f"launcher {args.cmd}: {where}{e}", file=sys.stderr)
            return 2


if __name__ == "__main__":
    sys.exit(main())
