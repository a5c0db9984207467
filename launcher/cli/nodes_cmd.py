"""`launcher nodes [--json] [--clear NODE] [--ledger DIR]`: the node-health ledger as a table.

Each node jobs saw fail (a CUDA or NCCL error raised on it, the rank a hang waited for): its state
(suspect; excluded: left out of every submission; expired: used again; ok: cleared), its last events,
the runs they hit and when it is used again (docs/fault-tolerance.md, "Bad and slow nodes"). --clear NODE
appends a clearing: what came before it no longer counts. The ledger is <--root>/nodes, or the directory
a team shares (cluster.health.ledger).
"""
from __future__ import annotations

import json
import time
from datetime import datetime
from pathlib import Path
from typing import Any, List


def add_parser(sub, parents: List[Any]) -> None:
    from launcher.config.schema import HealthConfig

    d = HealthConfig()
    s = sub.add_parser("nodes", help="the node-health ledger: suspect and excluded nodes, their evidence",
                       description=__doc__, parents=parents)
    s.add_argument("--ledger", help="the ledger's directory (default: <--root>/nodes; cluster.health.ledger)")
    s.add_argument("--clear", metavar="NODE", action="append", help="clear a node (repeat for more)")
    s.add_argument("--json", action="store_true", help="one object per node")
    s.add_argument("--exclude-after", type=int, default=d.exclude_after,
                   help=f"events within the window that exclude a node (cluster.health.exclude_after, "
                   f"default {d.exclude_after})")
    s.add_argument("--window-h", type=float, default=d.window_h, help=f"hours (default {d.window_h:g})")
    s.add_argument("--expire-h", type=float, default=d.expire_h, help=f"hours (default {d.expire_h:g})")
    s.set_defaults(fn=cmd_nodes)


def _when(t: Any) -> str:
    return datetime.fromtimestamp(float(t)).strftime("%m-%d %H:%M") if t else "-"


def cmd_nodes(args) -> int:
    from launcher.features.nodes.ledger import DIR, Ledger
    from launcher.features.nodes.rule import Settings

    ledger = Ledger(Path(args.ledger).expanduser() if args.ledger else Path(args._root) / DIR)
    for node in args.clear or []:
        ledger.clear(node)
        print(f"launcher nodes: {node} cleared (its earlier events no longer count)")
    settings = Settings(int(args.exclude_after), float(args.window_h) * 3600.0, float(args.expire_h) * 3600.0)
    states = ledger.states(settings, time.time())
    if args.json:
        print(json.dumps([{"node": s.node, "state": s.state, "expires_at": s.expires_at, "runs": s.runs,
                           "events": [e.__dict__ for e in s.events]} for s in states.values()], indent=2))
        return 0
    if not states:
        print(f"launcher nodes: no event in {ledger.path}")
        return 0
    from launcher.cli.tables import console, one_line_table
    from launcher.printable import printable

    rows = [[s.node, s.state, str(len(s.events)), printable(s.evidence) or "-", str(len(s.runs)),
             _when(s.expires_at) if s.state in ("suspect", "excluded") else "-"] for s in states.values()]
    con = console()
    table, left = one_line_table(["node", "state", "events", "last events", "runs", "used again"], rows,
                                 con.width, optional=("last events",))
    con.print(table)
    excluded = [s.node for s in states.values() if s.state == "excluded"]
    print(f"{len(excluded)} excluded (left out of every submission): {', '.join(excluded) or 'none'}; ledger "
          f"{ledger.path}" + (f"; not shown: {', '.join(left)}" if left else ""))
    return 0
