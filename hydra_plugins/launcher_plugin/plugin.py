"""Hydra Launcher plugin for `launch -m`: hands all points of each batch the sweeper gives it to the
launch pipeline at once, so they are validated together and queued as one Slurm array per resource
shape. Hydra requires plugins to live in the hydra_plugins namespace; the logic lives in the launcher
package (launcher.app).

Two modes, chosen per sweep:

- queue (Hydra's BasicSweeper, submit.wait not true): as before, the runs are submitted and the
  backend's wait policy applies (Slurm returns once queued; cluster=local waits and exits 1 unless
  every run completed); each JobReturn holds the run id.
- results (any other sweeper: Optuna, Nevergrad, Ax..., or submit.wait=true): each batch is
  submitted, waited for (one compact progress bar), and each JobReturn holds the run's objective,
  ``submit.objective`` (a key of the run summary, default final_loss), as a float; a failed,
  cancelled or timed-out run, a run without that key, or (sweepers other than BasicSweeper) a point
  the launch checks refuse is a FAILED JobReturn holding the error, as Hydra's own launchers return
  a task's exception. What a failed trial means is the sweeper's decision: Optuna goes on up to its
  ``hydra.sweeper.max_failure_rate`` and `launch -m` exits 0 when the study completes; BasicSweeper
  raises the first failure (exit 1), as with Hydra's own launchers.

Hydra's sweeper saves the whole composed config, command-line overrides included (so any secret
given there, `+cluster.env.HF_TOKEN=...`), to `<hydra.sweep.dir>/multirun.yaml` before it calls us.
That file is no part of the archive: `setup` points hydra.sweep.dir at a private temporary directory
(mode 0700, outside runs_root), and `launch` removes it before anything else happens (and at exit,
should the sweep fail before `launch`). Every batch of one multirun joins the sweep dir its first
batch made (run index = Hydra's job number): a study is one sweep. In results mode, hydra.sweep.dir
then becomes that sweep dir, where a sweeper writes its results once it is done (Optuna:
optimization_results.yaml); they are scrubbed of known secrets at exit and printed.

Composition: every point is composed once, by launcher.config.compose.SweepComposer (installed as the config
loader's load_sweep_config, so the sweeper's own validation composes it and we take that config)."""
from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, List, Optional, Sequence

from hydra.core.utils import JobReturn, JobStatus
from hydra.plugins.launcher import Launcher
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"
RESULTS_FILES = ("optimization_results.yaml",)  # what sweepers write into hydra.sweep.dir at the end


TMP_PREFIX = "launcher-hydra-"  # + the launching pid: whose temporary hydra.sweep.dir (multirun.yaml) it is
_STALE_OLD_S = 3600.0  # one named by an older launcher (no pid): removed once it is this old


def remove_stale_sweep_dirs(tmp: Path, alive=None) -> List[Path]:
    """This user's temporary hydra.sweep.dirs whose launch is gone (its pid dead; unnamed ones an hour
    old): each holds a multirun.yaml with every override, secrets too. Returns those removed."""
    import re
    import time

    from launcher.submit.interrupted import pid_alive

    alive = alive or pid_alive
    gone = []
    for d in tmp.glob(f"{TMP_PREFIX}*") if tmp.is_dir() else ():
        try:
            st = d.lstat()
        except OSError:
            continue
        if not d.is_dir() or d.is_symlink() or st.st_uid != os.getuid():
            continue
        m = re.match(rf"^{TMP_PREFIX}(\d+)-", d.name)
        if (not alive(int(m.group(1)))) if m else time.time() - st.st_mtime > _STALE_OLD_S:
            shutil.rmtree(d, ignore_errors=True)
            gone.append(d)
    return gone


class _JobReturn(JobReturn):
    """Hydra's JobReturn whose hydra_cfg may be given as a function, called when first read."""

    @property  # type: ignore[override]
    def hydra_cfg(self):
        if callable(self._hydra_cfg):
            self._hydra_cfg = self._hydra_cfg()
        return self._hydra_cfg

    @hydra_cfg.setter
    def hydra_cfg(self, value) -> None:
        self._hydra_cfg = value


class LauncherPlugin(Launcher):
    def __init__(self, **_: Any) -> None:
        self.config: Optional[DictConfig] = None
        self.hydra_context: Any = None
        self.sweep_dir: Optional[str] = None
        self.composer: Any = None
        self.into: Optional[Path] = None  # the multirun's sweep dir, once its first batch made it
        self.batches = 0  # batches submitted into it
        self.known: dict = {}  # secret values of the sweep's configs (results files are scrubbed)
        self._swept_keys: Optional[set] = None

    # ---- which mode ---------------------------------------------------------------------------

    @property
    def sweeper(self) -> str:
        return str(OmegaConf.select(self.config, "hydra.sweeper._target_", default="") or "")

    @property
    def basic(self) -> bool:
        return self.sweeper == BASIC_SWEEPER

    def needs_results(self) -> bool:
        """A sweeper that reads return values, or an explicit submit.wait=true."""
        return not self.basic or OmegaConf.select(self.config, "submit.wait", default=None) is True

    # ---- Hydra's Launcher interface -------------------------------------------------------------

    def setup(self, *, hydra_context: Any, task_function: Any, config: DictConfig) -> None:
        from launcher.config.compose import SweepComposer

        self.hydra_context = hydra_context
        self.config = config
        # the sweeper holds this same config object and reads hydra.sweep.dir after setup
        remove_stale_sweep_dirs(Path(tempfile.gettempdir()))  # a launch killed (SIGKILL) before it removed its own
        self.sweep_dir = tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{os.getpid()}-")
        atexit.register(self._at_exit)
        with read_write(config.hydra), open_dict(config.hydra):
            config.hydra.sweep.dir = self.sweep_dir
        self.composer = SweepComposer.install(hydra_context.config_loader)
        self.composer.expected = self._basic_batch_size()

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        from launcher.app import refuse_hydra_output_keys
        from launcher.config import group_options
        from launcher.config.compose import FastPoint, override_lines
        from launcher.submit.pipeline import Point

        assert self.config is not None and self.hydra_context is not None
        self._remove_sweep_dir()  # multirun.yaml: the composed config with every override, secrets too
        refuse_hydra_output_keys(self.config.hydra.overrides.hydra)
        self.composer.end()  # the sweeper's validation composed the points (kept for us)
        self.composer.expected = len(job_overrides)
        points: List[Point] = []
        hydra_nodes = []
        dirs = group_options.dirs_of(self.config.hydra.runtime.get("config_sources"))  # --config-dir
        try:
            for overrides in job_overrides:
                got = self.composer.take(self.config, list(overrides))
                if isinstance(got, FastPoint):  # already resolved; its hydra node composed if asked for
                    hydra_nodes.append(self._hydra_node_of(list(overrides)))
                    points.append(Point.of_resolved(got.resolved, list(got.overrides), dict(got.choices), dirs))
                    continue
                with read_write(got), open_dict(got):
                    hydra_node = got.pop("hydra")
                hydra_nodes.append(hydra_node)
                points.append(Point(cfg=got, overrides=override_lines(hydra_node.overrides.task),
                                    choices=OmegaConf.to_container(hydra_node.runtime.choices), config_dirs=dirs))
        finally:
            self.composer.end()
        if self.needs_results():
            outcomes = self._launch_for_results(points, initial_job_idx)
        else:
            from launcher.app import submit_points

            indices = [initial_job_idx + i for i in range(len(points))]
            result = submit_points(points, into=self.into, indices=indices)
            self._joined(result)
            outcomes = result.run_ids(indices)  # a point waiting for a wave has its run too
        returns = []
        for p, hn, outcome in zip(points, hydra_nodes, outcomes):
            ret = _JobReturn(overrides=p.overrides, cfg=p.cfg, hydra_cfg=hn, working_dir=".", task_name="launch")
            ret.status = JobStatus.FAILED if isinstance(outcome, BaseException) else JobStatus.COMPLETED
            ret.return_value = outcome
            returns.append(ret)
        return returns

    def _hydra_node_of(self, overrides: List[str]):
        """The point's hydra node, composed when first read (a JobReturn's hydra_cfg: no sweeper reads
        it, so a fast point is not composed for it)."""
        master, composer = self.config, self.composer

        def compose():
            cfg = composer.compose(master, overrides)
            with read_write(cfg), open_dict(cfg):
                return cfg.pop("hydra")

        return compose

    # ---- results mode ----------------------------------------------------------------------------

    def _launch_for_results(self, points, initial_job_idx: int) -> list:
        """Submit the batch, wait, and return per point its objective or its error. A sweeper other
        than BasicSweeper gets a refused point as a failed trial (the rest of the batch runs)."""
        from launcher.app import RunFailed, check_each, exit_refused, submit_for_results
        from launcher.archive import secrets
        from launcher.submit.pipeline import InvalidSweep

        objective = str(points[0].cfg.submit.objective)
        self.known.update(secrets.known_secrets([p.cfg for p in points]))
        refused = {i: "refused by the launch checks: " + " ".join(
            line.strip() for line in str(e).splitlines()[1:] if line.strip() not in ("run:", ""))
            for i, e in ({} if self.basic else check_each(points)).items()}
        for i, why in refused.items():
            print(f"launch: trial {initial_job_idx + i} {why}", file=sys.stderr)
        ok = [i for i in range(len(points)) if i not in refused]
        outcomes: list = [RunFailed(refused[i]) if i in refused else None for i in range(len(points))]
        if not ok:
            return outcomes
        meta = {"study": {"sweeper": self.sweeper, "objective": objective}}  # trial number = run index
        try:
            result, got, run_ids = submit_for_results([points[i] for i in ok], objective=objective, extra_meta=meta,
                                                      into=self.into, indices=[initial_job_idx + i for i in ok])
        except InvalidSweep as e:
            exit_refused(e)
        if result.dry_run:  # nothing ran: BasicSweeper gets None (exit 0), a study a failed trial
            return [None if self.basic else RunFailed("submit.dry_run=true: nothing ran, no objective")
                    for _ in points]
        if self._joined(result):  # the study's sweep dir: where the sweeper writes its results
            with read_write(self.config.hydra), open_dict(self.config.hydra):
                self.config.hydra.sweep.dir = str(result.sweep_dir)
        ids: dict = {}
        for i, value, rid in zip(ok, got, run_ids):
            outcomes[i], ids[i] = value, rid
        for i, (p, value) in enumerate(zip(points, outcomes)):
            what = (f"failed: {str(value).splitlines()[0]}" if isinstance(value, BaseException)
                    else f"{objective} = {value:.6g}  (run {ids[i]})")
            print(secrets.scrub(f"trial {initial_job_idx + i} ({self._swept(p.overrides)}): {what}", self.known))
        sys.stdout.flush()
        return outcomes

    def _joined(self, result) -> bool:
        """Every batch of one multirun joins the sweep its first batch made (run index = Hydra's job
        number, one code snapshot): a study is one sweep. True for the batch that made it."""
        if result.dry_run or result.sweep_dir is None:
            return False
        self.batches += 1
        first = self.into is None
        self.into = Path(result.sweep_dir)
        return first

    def _swept(self, overrides: List[str]) -> str:
        """The point's overrides of the keys the sweeper varies (all of them if those are unknown)."""
        if self._swept_keys is None:
            self._swept_keys = set()
            try:
                from hydra.core.override_parser.overrides_parser import OverridesParser

                from launcher.config.compose import override_lines

                params = OmegaConf.select(self.config, "hydra.sweeper.params") or {}
                lines = [f"{k}={v}" for k, v in params.items()] + override_lines(self.config.hydra.overrides.task)
                parsed = OverridesParser.create().parse_overrides(lines)
                self._swept_keys = {o.get_key_element() for o in parsed if o.is_sweep_override()}
            except Exception:  # only what a line shows
                pass
        shown = [o for o in overrides if o.split("=", 1)[0] in self._swept_keys]
        return " ".join(shown or overrides) or "defaults"

    def _basic_batch_size(self) -> Optional[int]:
        """Points in the BasicSweeper's first batch (the composing bar's total); None if unknown."""
        if not self.basic:
            return None
        try:
            from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
            from hydra.core.override_parser.overrides_parser import OverridesParser

            from launcher.config.compose import override_lines

            params = [f"{k}={v}" for k, v in (OmegaConf.select(self.config, "hydra.sweeper.params") or {}).items()]
            lines = params + override_lines(self.config.hydra.overrides.task)
            parsed = OverridesParser.create(config_loader=self.hydra_context.config_loader).parse_overrides(lines)
            batch_size = OmegaConf.select(self.config, "hydra.sweeper.max_batch_size")
            batches = BasicSweeper.split_arguments(parsed, batch_size)
            return len(batches[0]) if batches else None
        except Exception:  # only a progress bar's total
            return None

    # ---- cleanup ---------------------------------------------------------------------------------

    def _remove_sweep_dir(self) -> None:
        if self.sweep_dir:
            shutil.rmtree(self.sweep_dir, ignore_errors=True)

    def _at_exit(self) -> None:
        self._remove_sweep_dir()
        if self.into is None or not self.needs_results():
            return
        from launcher.archive import secrets

        found = [self.into / n for n in RESULTS_FILES if (self.into / n).is_file()]
        for f in found:
            secrets.scrub_file(f, self.known)
        print(f"study: {self.batches} batch(es) in sweep {self.into.name} (launcher status {self.into.name}, "
              f"launcher results {self.into.name}); results in {self.into}")
        for f in found:
            print(f"{f}:\n  " + f.read_text().strip().replace("\n", "\n  "))
        sys.stdout.flush()
