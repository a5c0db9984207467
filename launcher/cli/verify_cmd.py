"""`launcher verify-resume [RUN] [key=value ...] [--at STEP ...] [--steps N] [--tolerance T]`: whether a
training program resumes exactly (docs/training-api.md, "Verifying a resume").

Runs the program twice, side by side, from the same config and code: once straight through, once
stopped after each --at step by the product's own stop path (what a time-limit signal or a
preemption causes: a checkpoint, the stop, the requeue) and resumed as a requeue resumes it. Compares
every step's metrics row and every tensor of every step's checkpoint (weights, optimizer state, RNG
states, the ranks' own state). RUN: an archived run, run again from its archived config, code snapshot
and seeds; else the overrides are composed as `launch` composes them (cluster=local by default).
Answers bitwise, equal within --tolerance (naming the largest difference), or diverges, naming the
first step and the first thing that differs, with the likely cause. Exit 0: bitwise or within the
tolerance; 1: diverges (or a run failed); 2: refused. The verdict is recorded beside the runs and
shown by `launcher show`.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, List


def add_parser(sub, parents: List[Any]) -> None:
    from launcher.features.verify_resume.run import DEFAULT_STEPS

    s = sub.add_parser("verify-resume", help="whether a program resumes exactly: a run stopped and resumed "
                       "against one straight through, step by step", description=__doc__, parents=parents)
    s.add_argument("target", nargs="*", metavar="RUN_OR_OVERRIDES",
                   help="an archived run (id or dir), then key=value changes; or only key=value overrides")
    s.add_argument("--steps", type=int, default=DEFAULT_STEPS, help=f"steps of each run (default {DEFAULT_STEPS})")
    s.add_argument("--at", type=int, action="append", metavar="STEP",
                   help="stop after this step and resume (repeat for more runs; default: half of --steps)")
    s.add_argument("--tolerance", type=float, default=0.0,
                   help="largest difference taken as equal (absolute or relative; default 0: bitwise)")
    s.set_defaults(fn=cmd_verify_resume)


def cmd_verify_resume(args) -> int:
    from launcher.config.errors import ConfigErrors
    from launcher.features.verify_resume import run  # lazy: only this subcommand pays for it
    from launcher.submit.pipeline import InvalidSweep
    from launcher.sweeps import Unschedulable

    target = list(args.target)
    run_dir = None
    if target and "=" not in target[0]:
        from launcher.cli.archive_cmds import resolve_run_dir

        run_dir = Path(resolve_run_dir(args._root, target.pop(0)))
    at = sorted(set(args.at or [args.steps // 2]))
    bad = [k for k in at if not 1 <= k < args.steps]
    if args.steps < 2 or bad:
        print(f"launcher verify-resume: --at must name steps from 1 to {args.steps - 1} (--steps {args.steps}): "
              f"a run stopped after its last step has nothing left to resume", flush=True)
        return 2
    if args.tolerance < 0:
        print("launcher verify-resume: --tolerance must be 0 or more", flush=True)
        return 2
    try:
        return run.verify(target, run_dir, at, args.steps, args.tolerance, args._root)
    except (ConfigErrors, InvalidSweep, Unschedulable) as e:
        print(f"launcher verify-resume: refused, nothing launched: {e}", flush=True)
        return 2
