"""`launcher preflight [overrides] [--steps N] [--from RUNG] [--no-wait]`: the ladder before a large
run (docs/preflight.md).

Rungs, each a run of its own: smoke (one process), node (one node with the tensor-parallel group),
comm (the communication benchmark between two nodes), full (the full layout for a few dozen steps,
fp32, no recomputation), tuned (with recomputation and mixed precision), resume (the full rung stopped
halfway and resumed, compared step by step with the full rung's run). On Slurm they are queued at
once as dependent jobs; locally they run one after another. Prints a go / no-go table (measured vs
planned throughput, memory and link bandwidth, each rung's verdict) and stops at the first no-go
with its diagnosis. Exit 0: go; 1: no-go; 2: the config or a rung is refused (nothing submitted);
3 (--show): not finished.

`--from RUNG` starts the ladder at that rung, the ones below it skipped (after fixing what stopped
an earlier ladder there). `launcher preflight --show ID` judges a recorded ladder again (e.g. after
--no-wait).
"""
from __future__ import annotations

from typing import Any, List

from launcher.features.preflight.ladder import DEFAULT_STEPS, RUNGS


def add_parser(sub, parents: List[Any]) -> None:
    s = sub.add_parser("preflight", help="the check ladder before a large run: smoke, node, comm, full, tuned, resume",
                       description=__doc__, parents=parents)
    s.add_argument("overrides", nargs="*",
                   help="Hydra overrides, as for `launch` (cluster=... parallelism=3d ...)")
    s.add_argument("--steps", type=int, default=DEFAULT_STEPS,
                   help=f"steps of the full, tuned and resume rungs (default {DEFAULT_STEPS})")
    s.add_argument("--from", dest="start", choices=RUNGS, metavar="RUNG",
                   help=f"start at this rung, skipping those below it ({', '.join(RUNGS)}; default the first)")
    s.add_argument("--no-wait", dest="wait", action="store_false",
                   help="Slurm: return once the rungs are queued (read the verdicts later with --show ID)")
    s.add_argument("--show", metavar="ID", help="print the table of a recorded ladder")
    s.set_defaults(fn=cmd_preflight)


def cmd_preflight(args) -> int:
    from launcher.features.preflight import climb as preflight  # lazy: only this subcommand, not `launcher --help`

    if args.show:
        if args.overrides:
            print("launcher preflight: --show ID takes no overrides", flush=True)
            return 2
        return preflight.show(args.show, args._root)
    if args.steps < 1:
        print("launcher preflight: --steps must be 1 or more", flush=True)
        return 2
    return preflight.run(args.overrides, args.steps, args.wait, start=args.start)
