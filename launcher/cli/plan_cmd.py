"""`launcher plan [overrides] [--search] [--json] [--top N]`: memory, communication and speed of a layout.

Composes the run config exactly as `launch` does (same conf/, same overrides), then runs its recipe's
planner command (the recipe's contract: ``RecipeSpec.plan_command``; a recipe without one has no
planner): the estimate of the layout the config names, or with --search every valid layout, ranked
feasible first by predicted step time. Never imports torch; answers in milliseconds.

`launcher plan --calibrate RUN [RUN ...] [--cluster-file PATH] [--dry-run] [--json]` fits the
planner's calibration (cluster.calibration: compute_scale, comm_scale, step_overhead_s,
activation_scale) to what the runs measured (all of one cluster), prints planned vs measured step time
and activation memory per run before and after, and writes the constants as the `calibration:`
block of the runs' cluster config (conf/cluster/<cluster>.yaml; the rest of the file kept byte for
byte), so every later estimate for that cluster uses them (the runs' recipe's ``calibrate_command``).
docs/calibration.md.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, List

from launcher.cli.archive_cmds import resolve_run_dir
from launcher.config import recipe_contract, schema
from launcher.config.schema import CONFIG_NAME
from launcher.run.rundir import RunDir

TABLE_TOP = 20


def compose(overrides: List[str]) -> Any:
    """The run config for these overrides (Hydra compose API, conf/ of launcher.app)."""
    # hydra: only the command that composes a config loads it
    from hydra import compose as hydra_compose, initialize_config_dir

    # lazy: only this subcommand pays for it, not `launcher --help`
    from launcher.app import CONF_DIR, normalize_overrides

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return hydra_compose(config_name=CONFIG_NAME, overrides=normalize_overrides(list(overrides)))


def _fail(msg: str, code: int = 2) -> int:
    print(f"launcher plan: {msg}", file=sys.stderr)
    return code


def cmd_plan(args) -> int:
    if args.calibrate:
        given = [x for x in [*args.calibrate, *args.overrides] if "=" in x and not Path(x).exists()]
        if given or args.overrides or args.search:
            return _fail(f"--calibrate takes run ids or run dirs, not overrides or --search "
                         f"({' '.join(given or args.overrides) or '--search'})")
        return cmd_calibrate(args)
    if args.cluster_file or args.dry_run:
        return _fail("--cluster-file and --dry-run go with --calibrate RUN ...")
    try:
        cfg = compose(args.overrides)
    except Exception as e:  # Hydra/OmegaConf composition errors: unknown key, bad type, bad group option
        cause = f"\n  ({e.__cause__})" if e.__cause__ is not None else ""
        return _fail(f"cannot compose the config: {e}{cause}")
    target = str(cfg.recipe._target_)
    command = recipe_contract.of(target, strict=False).plan_command  # the planner is a recipe's (its contract)
    if command is None:
        return _fail(f"recipe._target_={target}: its recipe has no planner (launcher.config.recipe_contract); "
                     "`launch` holds it only to the rules every recipe shares")
    return command(cfg, args)


def cmd_calibrate(args) -> int:
    """Resolve the runs, then the calibration of the planner of the recipe they ran."""
    root = getattr(args, "_root", None)
    if root is None:
        from launcher.archive import registry  # lazy: only this subcommand pays for it, not `launcher --help`

        root = registry.default_root()
    dirs = []
    for ident in args.calibrate:
        try:  # a directory is read as the run dir it must be (the recipe's reader says when it is not one)
            dirs.append(Path(ident) if Path(ident).is_dir() else resolve_run_dir(Path(root), ident))
        except SystemExit as e:  # its message names the run and the root
            return _fail(f"--calibrate: {str(e.code).removeprefix('launcher: ')}\nnothing was written")
    targets = sorted({t for t in map(_recipe_of, dirs) if t})
    commands = {t: recipe_contract.of(t, strict=False).calibrate_command for t in targets}
    found = {c for c in commands.values() if c is not None}
    if targets and not found:
        return _fail(f"--calibrate: the runs ran {', '.join(targets)}: its recipe has no planner to calibrate "
                     "(launcher.config.recipe_contract)\nnothing was written")
    if not found:  # no run's recipe is readable: the default recipe's reader says what is wrong with them
        found = {recipe_contract.of(schema.default_target(), strict=False).calibrate_command} - {None}
    if len(found) != 1:
        return _fail("--calibrate: the runs ran recipes with different planners (calibrate one recipe's runs at a "
                     "time)\nnothing was written" if found else "--calibrate: no planner to calibrate")
    return next(iter(found))(dirs, args)


def _recipe_of(run_dir: Path) -> str:
    """The recipe a run ran (its archived config's recipe._target_), or "" where it cannot be read."""
    try:
        target = ((RunDir(run_dir).config() or {}).get("recipe") or {}).get("_target_")
    except Exception:  # not a run dir, or no config: the recipe's reader names the problem
        return ""
    return target if isinstance(target, str) else ""


def add_parser(sub) -> None:
    s = sub.add_parser("plan", help="estimate memory, communication and step time of a layout (or --search all); "
                       "--calibrate RUN... fits the planner to measured runs", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("overrides", nargs="*", help="Hydra overrides, as for `launch` (cluster=a100_80g parallelism=3d)")
    s.add_argument("--search", action="store_true", help="enumerate and rank every valid layout")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.add_argument("--top", type=int, default=None,
                   help=f"show the best N layouts (table default {TABLE_TOP}, JSON all)")
    s.add_argument("--calibrate", nargs="+", metavar="RUN", default=None,
                   help="fit cluster.calibration to these runs (ids or dirs, all of one cluster, 3+ steps each) "
                        "and write it into the cluster's config file")
    s.add_argument("--cluster-file", metavar="PATH", default=None,
                   help="with --calibrate: the YAML file to write the calibration block into (default: "
                        "conf/cluster/<the runs' cluster>.yaml)")
    s.add_argument("--dry-run", action="store_true", help="with --calibrate: print the fit, write nothing")
    s.add_argument("--root", help="runs root for --calibrate run ids (default: $LAUNCHER_RUNS or ./runs)")
    s.set_defaults(fn=cmd_plan)
