"""`launch`: the Hydra app. Composes the run config from conf/ and sends it down the one launch path.

  launch [overrides]        one run   (Hydra run mode; submitted like a one-point sweep)
  launch -m [overrides]     a sweep   (our Hydra launcher plugin: one Slurm array for all points)

Stays light: nothing here imports torch or deepspeed.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import hydra
from hydra.errors import CompactHydraException
from omegaconf import DictConfig

from launcher.schema import register_configs

CONF_DIR = Path(os.environ.get("LAUNCHER_CONF_DIR") or Path(__file__).resolve().parent.parent / "conf")

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
    from hydra._internal import defaults_list

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
    from hydra.core.override_parser.types import Glob

    filter_names = Glob.filter

    def glob_filter(self, names):
        text = lambda g: [str(x) for x in (g if isinstance(g, list) else [g])]  # noqa: E731
        return filter_names(Glob(include=text(self.include), exclude=text(self.exclude)), names)

    Glob.filter = glob_filter


accept_numeric_group_choices()


def normalize_overrides(args):
    """Kept for callers: numeric group choices need no rewriting any more (accept_numeric_group_choices)."""
    return list(args)


# ---- fast composition of sweep points -------------------------------------------------------------
# Hydra composes every point from scratch (defaults tree, every YAML file merged onto the schema:
# ~0.1-0.2 s a point), and a sweep composes each point twice (the sweeper's validate_batch_is_legal,
# then the launcher). SweepComposer stands in for the config loader's load_sweep_config: every
# distinct combination of config-group choices (and hydra.* overrides) is composed by Hydra once;
# a point is a copy of it with the point's value overrides applied by Hydra's own override code
# (ConfigLoaderImpl._apply_overrides_to_config: OmegaConf.update/merge with Hydra's +/++/~ rules)
# and the hydra node's per-point fields (overrides, override_dirname) set as Hydra sets them. A
# point composed for the sweeper's check is kept for the launcher (`take`), so each point is
# composed once. tests/unit/test_compose_fast.py compares the result with Hydra's own.


class SweepComposer:
    PROGRESS_AFTER_S = 1.0

    def __init__(self, config_loader) -> None:
        self.loader = config_loader
        self.original = config_loader.load_sweep_config
        self.bases = {}  # (config name, base override lines) -> composed config (copied, never changed)
        self.kept = {}  # point overrides -> config composed for the sweeper's check, for the launcher
        self.expected = None  # points of the coming batch (the progress bar's total), when known
        self.composed = 0  # points composed (a statistic for tests and benchmarks)
        self.parsed = {}  # override text -> Hydra's parsed Override
        self._burst = None  # [start time, count, rich Progress or None, task]

    @classmethod
    def install(cls, config_loader) -> "SweepComposer":
        """Make ``config_loader.load_sweep_config`` this composer's (once per loader)."""
        found = getattr(config_loader, "_launcher_composer", None)
        if found is not None:
            return found
        composer = cls(config_loader)
        config_loader.load_sweep_config = composer.load_sweep_config
        config_loader._launcher_composer = composer
        return composer

    def load_sweep_config(self, master_config, sweep_overrides):
        """What Hydra's load_sweep_config returns; kept for the launcher's `take`."""
        key = tuple(sweep_overrides)
        cfg = self.kept.get(key)
        if cfg is None:
            cfg = self.kept[key] = self.compose(master_config, list(sweep_overrides))
        return cfg

    def take(self, master_config, sweep_overrides):
        """The point's config: the one composed for the sweeper's check, or composed now."""
        cfg = self.kept.pop(tuple(sweep_overrides), None)
        return cfg if cfg is not None else self.compose(master_config, list(sweep_overrides))

    def compose(self, master_config, sweep_overrides):
        import copy

        from hydra._internal.config_loader_impl import ConfigLoaderImpl, get_overrides_dirname
        from hydra.core.override_parser.overrides_parser import OverridesParser
        from hydra.errors import ConfigCompositionException
        from hydra.types import RunMode
        from omegaconf import OmegaConf
        from omegaconf.errors import OmegaConfBaseException

        self._tick()
        lines = list(OmegaConf.to_container(master_config.hydra.overrides.hydra)) + list(sweep_overrides)
        new = [line for line in dict.fromkeys(lines) if line not in self.parsed]
        if new:  # each distinct override text parsed once (the parsed Override is only read)
            self.parsed.update(zip(new, OverridesParser.create().parse_overrides(new)))
        parsed = [self.parsed[line] for line in lines]
        if any(o.is_sweep_override() or o.get_key_element() == "hydra.searchpath" for o in parsed):
            return self.original(master_config, sweep_overrides)  # Hydra's own errors / search path
        repo = self.loader.repository
        # the base: every hydra override and every config-group choice; merged on: app values
        values = [o for o in parsed if not o.is_hydra_override()
                  and (isinstance(o.value(), dict) or not repo.group_exists(o.key_or_group))]
        base_lines = [o.input_line for o in parsed if o not in values]
        name = master_config.hydra.job.config_name
        bkey = (name, tuple(base_lines))
        base = self.bases.get(bkey)
        if base is None:
            base = self.bases[bkey] = self.loader.load_configuration(
                config_name=name, overrides=base_lines, run_mode=RunMode.RUN)
        cfg = copy.deepcopy(base)
        try:
            ConfigLoaderImpl._apply_overrides_to_config(values, cfg)
        except OmegaConfBaseException as e:  # as load_configuration reports it
            raise ConfigCompositionException().with_traceback(sys.exc_info()[2]) from e
        app = [o for o in parsed if not o.is_hydra_override()]
        task = list(cfg.hydra.overrides.task)
        task = task[:len(task) - (len(app) - len(values))] + [o.input_line for o in app]
        cfg.hydra.overrides.task = task
        dirname = cfg.hydra.job.config.override_dirname
        cfg.hydra.job.override_dirname = get_overrides_dirname(
            overrides=app, kv_sep=dirname.kv_sep, item_sep=dirname.item_sep, exclude_keys=dirname.exclude_keys)
        OmegaConf.copy_cache(from_config=master_config, to_config=cfg)
        self.composed += 1
        return cfg

    def _tick(self) -> None:
        """Count a composed point; past PROGRESS_AFTER_S of composing, a progress bar on stderr."""
        import time

        now = time.perf_counter()
        if self._burst is None:
            self._burst = [now, 0, None, None]
        b = self._burst
        b[1] += 1
        if b[2] is None and now - b[0] > self.PROGRESS_AFTER_S:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            cols = [TextColumn("composing"), BarColumn(), MofNCompleteColumn() if self.expected else TextColumn(
                "{task.completed} point(s)"), TimeElapsedColumn()]
            b[2] = Progress(*cols, console=Console(stderr=True), transient=True)
            b[2].start()
            b[3] = b[2].add_task("compose", total=self.expected)
        if b[2] is not None:
            b[2].update(b[3], completed=b[1])

    def end(self) -> None:
        """Composing is over (for now): take the bar down."""
        if self._burst and self._burst[2] is not None:
            self._burst[2].stop()
        self._burst = None


# ---- sweepers that need results ------------------------------------------------------------------


class RunFailed(CompactHydraException):
    """A run of a sweep ended without an objective: the failed trial's error in its JobReturn.
    Compact: where a sweeper raises it (Hydra's BasicSweeper does), Hydra prints just the message."""


def check_each(points) -> dict:
    """{index: InvalidSweep} for the points the launch checks would refuse (each checked alone)."""
    from launcher.submit.pipeline import InvalidSweep, check

    bad = {}
    for i, p in enumerate(points):
        try:
            check([p])
        except InvalidSweep as e:
            bad[i] = e
    return bad


def submit_for_results(points, *, objective: str, extra_meta=None, code_snapshot=None, out=None):
    """Submit ``points`` (the pipeline: one array per resource shape), wait for every run with the
    compact view, and return (result, outcomes, run ids): per point, the float value of the run
    summary's ``objective`` key, or the exception (RunFailed) saying why the run has none; and its
    run id (None if not submitted). InvalidSweep propagates: nothing was submitted."""
    from launcher.submit.pipeline import launch
    from launcher.submit.progress import _final_status, log_of_failure, wait_and_report

    import io

    out = out or sys.stdout
    said = io.StringIO()  # the pipeline's per-run listing: one line of it here, the runs are listed below
    result = launch(points, out=said, code_snapshot=code_snapshot, extra_meta=extra_meta)
    if result.dry_run:
        out.write(said.getvalue())
        return result, [None] * len(points), [None] * len(points)
    print(said.getvalue().splitlines()[0], file=out, flush=True)
    cfg = points[0].cfg
    wait_and_report(result, points, out, timeout_s=int(cfg.submit.wait_timeout_s), compact=True, quiet=True)
    by_index = {int(r.run_id.rsplit("-", 1)[1]): r for r in result.runs}
    outcomes = []
    for i in range(len(points)):
        r = by_index.get(i)
        if r is None:
            outcomes.append(RunFailed(f"point {i} was not submitted"))
            continue
        st = _final_status(r)
        status = r.rundir.status()
        summary = status.get("summary") or {}
        if st != "completed":
            outcomes.append(RunFailed(f"run {r.run_id} {st}: {status.get('error') or 'no error recorded'} "
                                      f"(logs: {log_of_failure(r)}; launcher doctor {r.run_id})"))
            continue
        try:
            outcomes.append(float(summary[objective]))
        except (KeyError, TypeError, ValueError):
            keys = ", ".join(sorted(k for k, v in summary.items() if isinstance(v, (int, float))))
            outcomes.append(RunFailed(f"run {r.run_id} completed, but its summary has no number "
                                      f"submit.objective={objective!r} (numbers: {keys or 'none'})"))
    return result, outcomes, [by_index[i].run_id if i in by_index else None for i in range(len(points))]


def _fail(err: Exception) -> None:
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
        from launcher.submit.progress import wait_and_report

        if not wait_and_report(result, points, sys.stdout, timeout_s=int(cfg.submit.wait_timeout_s)):
            sys.exit(1)


def submit_points(points) -> None:
    """The launch pipeline for these points, then the wait policy and the exit code."""
    from launcher.submit.pipeline import InvalidSweep, launch

    try:
        result = launch(points)
    except InvalidSweep as e:
        _fail(e)
    finish(result, points)
    return result


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def _run(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    from launcher.submit.pipeline import Point

    hc = HydraConfig.get()
    submit_points([Point(cfg=cfg, overrides=list(hc.overrides.task),
                         choices=OmegaConf.to_container(hc.runtime.choices))])


def main() -> None:
    _run()


if __name__ == "__main__":
    main()
