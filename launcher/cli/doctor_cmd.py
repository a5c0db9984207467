"""`launcher doctor RUN [--json] [--no-scheduler]`: why a run failed (its class), the evidence, the fix.

Thin over launcher.doctor (docs/doctor.md): reads the run dir, the ranks' logs and, unless the run
completed or --no-scheduler is given, the scheduler's state of the job. Never imports torch.
"""
from __future__ import annotations

import json
from typing import Any, Dict, List

from rich.text import Text

from launcher.cli.archive_cmds import resolve_run_dir
from launcher.printable import printable
from launcher.run.rundir import RunDir


def add_parser(sub, parents: List[Any]) -> None:
    s = sub.add_parser("doctor", help="why a run failed (out of memory, hang, killed rank, ...) and the fix",
                       description=__doc__, parents=parents)
    s.add_argument("run", help="run id or run dir")
    s.add_argument("--json", action="store_true", help="machine-readable diagnosis")
    s.add_argument("--no-scheduler", action="store_true", help="read only the run dir and the logs")
    s.set_defaults(fn=cmd_doctor)


def _report(rd, ev, d) -> Dict[str, Any]:
    return {"run_id": ev.run_id, "dir": str(rd.path), "status": ev.status.state.value,
            "scheduler": ev.scheduler, **d.to_json()}


def cmd_doctor(args) -> int:
    from launcher import doctor  # lazy: only this subcommand pays for it, not `launcher --help`

    rd = RunDir(resolve_run_dir(args._root, args.run))
    ev = doctor.gather(rd, scheduler=not args.no_scheduler)
    d = doctor.diagnose(ev)
    out = _report(rd, ev, d)
    if args.json:
        print(json.dumps(out, indent=2, default=str))
        return 0
    # rich: only the command that prints loads it, not `launcher --help`
    from rich.console import Console
    from rich.table import Table

    failed = d.kind not in doctor.NOT_FAILED and d.kind != "cancelled"
    c = Console(highlight=False)
    head = Text.assemble((printable(ev.run_id), "bold"), "  ", str(out["status"]), "  ->  ",
                         (d.kind, "bold red" if failed else "bold green"))
    if d.rank is not None:
        head.append(f"  (rank {d.rank})")
    c.print(head)
    # archived text (errors, paths, log lines) is printed as it is, never read as rich markup, its
    # control characters escaped (a rank's error may hold ESC/OSC sequences)
    t = Table(show_header=False, box=None, padding=(0, 1))
    t.add_column(style="bold", no_wrap=True)
    t.add_column(overflow="fold")
    t.add_row("why", Text(printable(d.summary)))
    if d.detail:
        t.add_row("evidence", Text(printable("\n".join(d.detail))))
    t.add_row("fix", Text(printable(d.fix)))
    t.add_row("dir", Text(printable(rd.path)))
    c.print(t)
    return 0
