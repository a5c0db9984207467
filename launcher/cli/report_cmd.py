"""`launcher report RUN|SWEEP [-o FILE.html]`: one self-contained HTML page (thin over launcher.report).

A run's page is written beside its run dir, not inside it: a sealed run dir may hold nothing its
manifest does not name (a file added later makes `launcher show`/`diff` report the archive as changed
and `reproduce` refuse it), so the default is ``<sweep_dir>/report-<index>.html``. A sweep's page
goes to ``<sweep_dir>/report.html``.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional, Tuple

from launcher.archive import atomic
from launcher.cli.archive_cmds import resolve_run_dir
from launcher.cli.sweep_cmds import sweep_runs
from launcher.run.rundir import RunDir, SweepDir


def _sweep(root: Path, ident: str) -> Optional[Tuple[Path, str]]:
    """(runs root, sweep id) when ``ident`` names a sweep of more than one run (a sweep dir or a sweep
    id under ``root``); a one-run sweep is its run, as for `launcher show`."""
    for sd in (SweepDir(Path(ident)), SweepDir(root / ident)):
        if not RunDir(sd.path).exists() and len(sd.runs()) > 1:
            return sd.path.resolve().parent, sd.sweep_id
    return None


def cmd_report(args) -> int:
    from launcher import report  # lazy: only this subcommand pays for it, not `launcher --help`

    sweep = _sweep(args._root, args.target)
    if sweep:
        root, sweep_id = sweep
        text = report.sweep_report(sweep_runs(root, sweep_id))
        default = root / sweep_id / "report.html"
    else:
        rdir = resolve_run_dir(args._root, args.target)
        text = report.run_report(rdir)
        default = rdir.parent / f"report-{rdir.name}.html"
    out = Path(args.output).expanduser() if args.output else default
    try:
        atomic.write_text(out, text)
    except OSError as e:
        sys.exit(f"launcher report: cannot write {out}: {e}")
    print(out)
    return 0


def add_parser(sub, parents) -> None:
    s = sub.add_parser("report", help="one self-contained HTML page of a run or a sweep (plots embedded)",
                       parents=parents)
    s.add_argument("target", metavar="RUN|SWEEP", help="run id, run dir, sweep id or sweep dir (a sweep of one "
                   "run is that run)")
    s.add_argument("-o", "--output", metavar="FILE.html", help="where to write the page (default: "
                   "<sweep_dir>/report-<index>.html for a run, beside its sealed run dir; "
                   "<sweep_dir>/report.html for a sweep)")
    s.set_defaults(fn=cmd_report)
