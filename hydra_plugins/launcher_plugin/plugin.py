"""Hydra Launcher plugin: hands all points of a `launch -m` sweep to the launch pipeline at once,
so they are validated together and queued as one Slurm array. Hydra requires plugins to live in
the hydra_plugins namespace; the logic lives in the launcher package.

Hydra's sweeper saves the whole composed config, command-line overrides included (so any secret
given there, `+cluster.env.HF_TOKEN=...`), to `<hydra.sweep.dir>/multirun.yaml` before it calls us.
That file is no part of the archive: `setup` points hydra.sweep.dir at a private temporary directory
(mode 0700, outside runs_root), and `launch` removes it before anything else happens (and at exit,
should the sweep fail before `launch`)."""
from __future__ import annotations

import atexit
import shutil
import tempfile
from typing import Any, List, Optional, Sequence

from hydra.core.utils import JobReturn, JobStatus
from hydra.plugins.launcher import Launcher
from omegaconf import DictConfig, OmegaConf, open_dict, read_write


class LauncherPlugin(Launcher):
    def __init__(self, **_: Any) -> None:
        self.config: Optional[DictConfig] = None
        self.hydra_context: Any = None
        self.sweep_dir: Optional[str] = None

    def setup(self, *, hydra_context: Any, task_function: Any, config: DictConfig) -> None:
        self.hydra_context = hydra_context
        self.config = config
        # the sweeper holds this same config object and reads hydra.sweep.dir after setup
        self.sweep_dir = tempfile.mkdtemp(prefix="launcher-hydra-")
        atexit.register(self._remove_sweep_dir)
        with read_write(config.hydra), open_dict(config.hydra):
            config.hydra.sweep.dir = self.sweep_dir

    def _remove_sweep_dir(self) -> None:
        if self.sweep_dir:
            shutil.rmtree(self.sweep_dir, ignore_errors=True)

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        from launcher.app import submit_points
        from launcher.submit.pipeline import Point

        assert self.config is not None and self.hydra_context is not None
        self._remove_sweep_dir()  # multirun.yaml: the composed config with every override, secrets too
        points: List[Point] = []
        hydra_nodes = []
        for overrides in job_overrides:
            cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
            with read_write(cfg), open_dict(cfg):
                hydra_node = cfg.pop("hydra")
            hydra_nodes.append(hydra_node)
            points.append(
                Point(
                    cfg=cfg,
                    overrides=list(hydra_node.overrides.task),
                    choices=OmegaConf.to_container(hydra_node.runtime.choices),
                )
            )
        result = submit_points(points)
        returns = []
        for i, (p, hn) in enumerate(zip(points, hydra_nodes)):
            ret = JobReturn(overrides=p.overrides, cfg=p.cfg, hydra_cfg=hn, working_dir=".", task_name="launch")
            ret.status = JobStatus.COMPLETED
            ret.return_value = result.runs[i].run_id if result.runs else None
            returns.append(ret)
        return returns
