"""`launch`: the Hydra app. Composes the run config from conf/ and sends it down the one launch path.

  launch [overrides]        one run   (Hydra run mode; submitted like a one-point sweep)
  launch -m [overrides]     a sweep   (our Hydra launcher plugin: one Slurm array for all points)

Stays light: nothing here imports torch or deepspeed.
"""
from __future__ import annotations

import io
import sys
from typing import Optional

import hydra
from hydra._internal import defaults_list
from hydra.core.hydra_config import HydraConfig
from hydra.core.object_type import ObjectType
from hydra.core.override_parser.types import Glob
from hydra.errors import CompactHydraException
from omegaconf import DictConfig, OmegaConf

from launcher.config.errors import ConfigError, ConfigErrors
from launcher.config.schema import CONF_DIR, CONFIG_NAME, register_configs

register_configs()

# ---- numeric config-group names (zero/0.yaml .. zero/3.yaml) ---------------------------------------
# Hydra's override grammar reads `zero=1` as the int 1, and its defaults list refuses a group choice
# that is not a string ("Config group override must be a string or a list. Got int"). Sweeps make it
# worse: `zero=range(0,4)`, `zero=choice(0,1)` (and Optuna's choice) and `zero=glob(*)` all hand
# the sweeper's points back to Hydra as `zero=0` text, parsed again into an int. So the group accepts
# ints where Hydra reads group choices: an int (or list of ints) given for a key that IS a config
# group of the app's repository becomes its decimal text before Hydra's defaults list sees it. Every
# form of the grammar, every sweeper and every entry (command line, compose API, plan) goes through
# that one place; a plain key that happens to be named like a group elsewhere is never touched.


def _choice_text(value):
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if isinstance(value, list):
        return [_choice_text(v) for v in value]
    return value


def accept_numeric_group_choices() -> None:
    """Patch Hydra's defaults-list override reader (once) so an int names a config-group option."""
    cls = defaults_list.Overrides
    if getattr(cls.__init__, "_launcher_numeric_groups", False):
        return
    original = cls.__init__

    def __init__(self, repo, overrides_list):
        for o in overrides_list:
            if o.is_sweep_override() or isinstance(o._value, dict):
                continue
            text = _choice_text(o._value)
            if text is not o._value and repo.group_exists(o.key_or_group):
                o._value = text
        original(self, repo, overrides_list)

    __init__._launcher_numeric_groups = True
    cls.__init__ = __init__

    # glob([1,2]) / glob(*,exclude=[0]): the grammar reads the patterns as ints too; a glob
    # pattern is text (it only ever selects config-group options)

    filter_names = Glob.filter

    def glob_filter(self, names):
        text = lambda g: [str(x) for x in (g if isinstance(g, list) else [g])]  # noqa: E731
        return filter_names(Glob(include=text(self.include), exclude=text(self.exclude)), names)

    Glob.filter = glob_filter


accept_numeric_group_choices()


def normalize_overrides(args):
    """The overrides as Hydra is to compose them: a model option that is a module selects its recipe
    (``recipe_for_model``). Numeric group choices need no rewriting (accept_numeric_group_choices)."""
    return recipe_for_model(list(args))[0]


# ---- a model option that needs a recipe selects it -----------------------------------------------
# A recipe option brings the `model` group with a default option of its own (conf/recipe/<option>.yaml);
# one whose defaults list leaves it open (`- /model: null`) trains any module the option names by its
# `_target_` (docs/models.md). Hydra cannot switch the recipe from inside the model option (the recipe's
# defaults list chose the model), so `model=<an option naming a _target_>` with no recipe named gets
# that recipe (`recipe=<it>`, the one such option) before Hydra composes, recorded so in the overrides.


def _yaml(path):
    import yaml

    try:
        return yaml.safe_load(path.read_text()) if path.is_file() else None
    except (OSError, yaml.YAMLError):
        return None


def module_recipe():
    """The recipe option whose model group is open to any module (its defaults: ``/model: null``),
    where exactly one is; else None."""
    found = []
    for path in sorted((CONF_DIR / "recipe").glob("*.yaml")):
        doc = _yaml(path)
        entries = doc.get("defaults") if isinstance(doc, dict) else None
        if any(isinstance(e, dict) and "/model" in e and e["/model"] is None for e in entries or []):
            found.append(path.stem)
    return found[0] if len(found) == 1 else None


def recipe_for_model(args):
    """(the overrides, the line added or None): ``recipe=<module_recipe>`` put first where a plain
    ``model=<option>`` names an option with a ``_target_`` and no override names the recipe
    (``recipe=...``, ``recipe._target_=...``)."""
    args = list(args)
    if any(str(a).lstrip("+~").split("=", 1)[0].split(".", 1)[0] == "recipe" for a in args):
        return args, None
    for a in args:
        key, _, value = str(a).partition("=")
        if key != "model" or not value or any(c in value for c in ",()[]$"):
            continue
        option = _yaml(CONF_DIR / "model" / f"{value}.yaml")
        recipe = module_recipe() if isinstance(option, dict) and "_target_" in option else None
        if recipe is not None:
            return [f"recipe={recipe}", *args], f"recipe={recipe}"
    return args, None


# Hydra's output-dir settings: `launch` archives every run in <submit.runs_root>/<sweep>/<index>/ and
# its ranks write through the run dir, so these would be silently ignored. Refused instead, saying so.
_RUNS_ROOT_FIX = "remove it; runs go to submit.runs_root=<dir> (default $LAUNCHER_RUNS, else ./runs)"
HYDRA_OUTPUT_KEYS = {
    "hydra.run.dir": ("is not used by launch: a run is archived in <submit.runs_root>/<sweep_id>/<index>/",
                      _RUNS_ROOT_FIX),
    "hydra.sweep.dir": ("is not used by launch: a sweep is archived in <submit.runs_root>/<sweep_id>/, one "
                        "dir per point", _RUNS_ROOT_FIX),
    "hydra.sweep.subdir": ("is not used by launch: a point's run dir is <sweep_id>/<index>", _RUNS_ROOT_FIX),
    "hydra.job.chdir": ("is not used by launch: a run's ranks start in its code snapshot and write their "
                        "files through the run dir (ctx.rundir)", "remove it; a recipe writes into ctx.rundir"),
    "hydra.output_subdir": ("is not used by launch: the composed config, overrides and Hydra's choices are "
                            "archived in the run dir (config.yaml, overrides.yaml)", "remove it"),
}


def hydra_output_problems(hydra_overrides) -> list:
    """ConfigErrors for the Hydra output-dir keys among these ``hydra.*`` override lines (pure)."""
    from launcher.config.compose import override_key  # lazy: `launch --help` never loads the composer

    found = []
    for line in hydra_overrides:
        key = override_key(line)
        if key in HYDRA_OUTPUT_KEYS:
            found.append(ConfigError(key, *HYDRA_OUTPUT_KEYS[key]))
    return found


def refuse_hydra_output_keys(hydra_overrides) -> None:
    """Exit 2 naming each Hydra output-dir key given (nothing composed further, nothing submitted)."""
    problems = hydra_output_problems(hydra_overrides)
    if problems:
        exit_refused(ConfigErrors(problems, "(Hydra's output dirs); nothing was submitted"))


class RunFailed(CompactHydraException):
    """A run of a sweep ended without an objective: the failed trial's error in its JobReturn.
    Compact: where a sweeper raises it (Hydra's BasicSweeper does), Hydra prints just the message."""


def check_each(points) -> dict:
    """{index: InvalidSweep} for the points the launch checks would refuse (each checked alone)."""
    # lazy: `launch --help` and --cfg never load the submit path
    from launcher.submit.pipeline import InvalidSweep, validate

    bad = {}
    for i, p in enumerate(points):
        try:
            validate([p])
        except InvalidSweep as e:
            bad[i] = e
    return bad


def submit_for_results(points, *, objective: str, extra_meta=None, out=None, into=None, indices=None):
    """Submit ``points`` (the pipeline: one array per resource shape; ``into``/``indices`` as for
    pipeline.launch), wait for every run with the compact view, and return (result, outcomes, run
    ids): per point, the float value of the run summary's ``objective`` key, or the exception
    (RunFailed) saying why the run has none; and its run id (None if not submitted). InvalidSweep
    propagates: nothing was submitted."""
    # lazy: `launch --help` and --cfg never load the submit path
    from launcher.run.outcome import settle
    from launcher.submit.pipeline import launch
    from launcher.submit.progress import log_of_failure, wait_and_report

    out = out or sys.stdout
    said = io.StringIO()  # the pipeline's per-run listing: one line of it here, the runs are listed below
    result = launch(points, out=said, extra_meta=extra_meta, into=into, indices=indices)
    if result.dry_run:
        out.write(said.getvalue())
        return result, [None] * len(points), [None] * len(points)
    print(said.getvalue().splitlines()[0], file=out, flush=True)
    cfg = points[0].cfg
    wait_and_report(result, points, out, timeout_s=int(cfg.submit.wait_timeout_s), compact=True, quiet=True)
    from launcher.run.rundir import SweepDir  # lazy: `launch --help` and --cfg never load the submit path

    by_index = {SweepDir.index_of(r.run_id): r for r in result.runs}
    indices = list(range(len(points))) if indices is None else list(indices)
    outcomes = []
    for i in indices:
        r = by_index.get(i)
        if r is None:
            outcomes.append(RunFailed(f"point {i} was not submitted"))
            continue
        st = settle(r.rundir, ended=True).value
        status = r.rundir.status()
        summary = status.summary or {}
        if st != "completed":
            outcomes.append(RunFailed(f"run {r.run_id} {st}: {status.error or 'no error recorded'} "
                                      f"(logs: {log_of_failure(r)}; launcher doctor {r.run_id})"))
            continue
        try:
            outcomes.append(float(summary[objective]))
        except (KeyError, TypeError, ValueError):
            keys = ", ".join(sorted(k for k, v in summary.items() if isinstance(v, (int, float))))
            outcomes.append(RunFailed(f"run {r.run_id} completed, but its summary has no number "
                                      f"submit.objective={objective!r} (numbers: {keys or 'none'})"))
    return result, outcomes, [by_index[i].run_id if i in by_index else None for i in indices]


def exit_refused(err: Exception) -> None:
    print(f"launch: {err}", file=sys.stderr)
    sys.exit(2)


def finish(result, points) -> None:
    """After submission: wait for the runs where the backend (or submit.wait) says so, showing
    progress; exit 1 unless every run completed."""
    cfg = points[0].cfg
    wait = cfg.submit.wait
    if wait is None:
        wait = bool(result.backend and result.backend.waits)
    if wait and not result.dry_run:
        # lazy: `launch --help` and --cfg never load the submit path
        from launcher.submit.progress import wait_and_report

        if not wait_and_report(result, points, sys.stdout, timeout_s=int(cfg.submit.wait_timeout_s)):
            sys.exit(1)


def compose_point(overrides):
    """A launch Point for these overrides, composed as `launch` composes a run (Hydra's compose API over
    launch's conf/): `launcher preflight`'s rungs and `launcher verify-resume`'s runs."""
    from hydra import compose, initialize_config_dir
    from omegaconf import open_dict

    from launcher.submit.pipeline import Point

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name=CONFIG_NAME, overrides=normalize_overrides(list(overrides)), return_hydra_config=True)
    choices = OmegaConf.to_container(cfg.hydra.runtime.choices)
    with open_dict(cfg):
        del cfg["hydra"]
    return Point(cfg=cfg, overrides=list(overrides), choices={k: v for k, v in choices.items()
                                                              if not str(k).startswith("hydra/")})


def submit_points(points, into=None, indices=None):
    """The launch pipeline for these points (``into``/``indices`` as for pipeline.launch), then the
    wait policy and the exit code."""
    # lazy: `launch --help` and --cfg never load the submit path
    from launcher.submit.pipeline import InvalidSweep, launch
    from launcher.submit.submission import SubmissionRefused

    try:
        result = launch(points, into=into, indices=indices)
    except InvalidSweep as e:
        exit_refused(e)
    except SubmissionRefused as e:  # sbatch said no: the runs say why (launcher runs), no traceback
        print(f"launch: {e}", file=sys.stderr)
        sys.exit(1)
    finish(result, points)
    return result


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name=CONFIG_NAME)
def _run(cfg: DictConfig) -> None:
    from launcher.config.compose import override_lines
    from launcher.submit.pipeline import Point  # lazy: `launch --help` and --cfg never load the submit path

    hc = HydraConfig.get()
    refuse_hydra_output_keys(hc.overrides.hydra)
    submit_points([Point(cfg=cfg, overrides=override_lines(hc.overrides.task),
                         choices=OmegaConf.to_container(hc.runtime.choices))])


def grid_too_large(args) -> Optional[ConfigError]:
    """A multirun whose grid (the basic sweeper's: every combination of the swept values) holds more
    points than submit.max_points, counted from the command line alone: refused in a second, before
    Hydra composes a point (a million points would compose for minutes and hold gigabytes). None: not a
    grid, within the maximum, or a size only a sweeper knows (interval, glob: checked as points)."""
    from hydra._internal.utils import get_args_parser

    try:
        ns, _ = get_args_parser().parse_known_args(list(args))
    except SystemExit:
        return None
    overrides = [str(o) for o in ns.overrides or []]
    if not ns.multirun or any(o.lstrip("+~").split("=", 1)[0] == "hydra/sweeper" for o in overrides):
        return None  # one run, or a sweeper that sizes its own trials (Optuna: n_trials)
    from launcher.config.compose import grid_points  # lazy: `launch --help` never loads the composer
    from launcher.config.schema import SubmitConfig

    limit = SubmitConfig.__dataclass_fields__["max_points"].default
    for o in overrides:
        key, _, value = o.lstrip("+~").partition("=")
        if key == "submit.max_points" and value.strip().isdigit():
            limit = int(value.strip())
    n = grid_points(overrides)
    if n is None or n <= limit:
        return None
    return ConfigError("submit.max_points", f"this sweep's grid holds {n:,} points, more than submit.max_points="
                       f"{limit:,}; nothing was composed or submitted",
                       f"launch fewer points (or the sweep in parts), or raise submit.max_points={n} knowingly")


def mode_from_command_line(self, config_name, overrides):
    """``Hydra.get_mode`` for `launch`: Hydra composes the whole config once only to read ``hydra.mode``,
    then again to run (~0.4 s of a launch's ~1.3 s). launch's conf/ never sets it: the mode is the command
    line's, ``hydra.mode=...`` given as an override, else None (``-m``: multirun, otherwise a run)."""
    from hydra.types import RunMode

    for line in reversed(list(overrides)):
        key, _, value = str(line).partition("=")
        if key.lstrip("+~") == "hydra.mode" and value.strip() in RunMode.__members__:
            return RunMode[value.strip()]
    return None


def answer_help_from_one_repository() -> None:
    """`launch --help` lists every config group's options (Hydra's ``format_config_groups``), building the
    whole config repository (a deep copy of the schema every recipe registers) once per group asked,
    ~100 times (3-4 s). Help asks with no overrides: one repository, built once, answers every group."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl

    original = ConfigLoaderImpl.get_group_options
    built = {}

    def get_group_options(self, group_name, results_filter=ObjectType.CONFIG, config_name=None, overrides=None):
        if config_name is not None or overrides:
            return original(self, group_name, results_filter, config_name, overrides)
        if id(self) not in built:
            built[id(self)] = self._parse_overrides_and_create_caching_repo(None, [])[1]
        return built[id(self)].get_group_options(group_name, results_filter)

    ConfigLoaderImpl.get_group_options = get_group_options


def main() -> None:
    from hydra._internal.hydra import Hydra

    Hydra.get_mode = mode_from_command_line  # this process is launch's: its conf never sets hydra.mode
    if any(a in ("--help", "-h") for a in sys.argv[1:]):
        answer_help_from_one_repository()
    # lazy: `launch --help` loads the secret rules only when Hydra runs; signals is stdlib only
    from launcher.cli.scrubbed import hydra_scrubbed
    from launcher.submit import signals  # SIGTERM/SIGHUP stop the launch as Ctrl-C does

    signals.install()
    if any("args=[" in a for a in sys.argv[1:]):  # `'recipe.args=[--device=cpu]'` as typed: quoted for Hydra
        from launcher.script_recipe import quote_args

        sys.argv[1:] = quote_args(sys.argv[1:])
    sys.argv[1:], added = recipe_for_model(sys.argv[1:])
    if added:
        print(f"launch: {added} added: the model option is a module, trained by that recipe (docs/models.md)",
              file=sys.stderr)
    too_large = grid_too_large(sys.argv[1:])
    if too_large is not None:
        exit_refused(too_large)
    try:
        with hydra_scrubbed(sys.argv[1:]):  # whatever Hydra prints (its errors, --cfg) holds no secret
            _run()
    except signals.Terminated as e:  # what was queued is published, the rest cancelled (submission.submit)
        print(f"launch: stopped ({e})", file=sys.stderr)
        sys.exit(e.exit_code)


if __name__ == "__main__":
    main()
