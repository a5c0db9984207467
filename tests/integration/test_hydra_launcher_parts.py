"""The generic Hydra launcher with real processes: the batch's jobs share one pickled state, and the
plugin module and the example app import no torch."""
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from hydra_plugins.launcher_plugin import generic

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(120)
def test_plugin_module_and_app_import_no_torch():
    """Hydra imports the plugin for every app (and for `launch`): it must stay light."""
    code = ("import sys, hydra_plugins.launcher_plugin.generic, recipes.hydra_example.app; "
            "print('torch' in sys.modules, 'launcher.app' in sys.modules, 'submitit' in sys.modules)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=100, cwd=REPO)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["False", "False", "False"]


def _task_for_state(cfg):
    return cfg.x * 2


def test_jobs_of_a_batch_share_one_pickled_state(tmp_path):
    """Hydra's state and the task function are pickled once per batch, beside submitit's files; a job
    pickles only that file's path and, in a fresh process, loads them from it."""
    import os
    import pickle

    state = generic._SharedState(tmp_path / "sub" / "hydra_state_S_0.pkl").write(
        _task_for_state, {"context": "ctx"}, {"singletons": list(range(10000))})
    job = generic._HydraJob(state, OmegaConf.create({"x": 21}), str(tmp_path / "run"), {"A": "b"})
    blob = pickle.dumps(job)
    assert len(blob) < 2000 and b"singletons" not in blob  # the state is not in the job's pickle
    (tmp_path / "job.pkl").write_bytes(blob)
    code = ("import pickle, sys; job = pickle.load(open(sys.argv[1], 'rb')); fn, ctx, st = job.shared.get(); "
            "print(fn(job.config), ctx['context'], len(st['singletons']))")
    here = Path(__file__).resolve()  # the task function is pickled by reference to this module
    res = subprocess.run([sys.executable, "-c", code, str(tmp_path / "job.pkl")], capture_output=True, text=True,
                         timeout=60, cwd=str(here.parents[2]),
                         env=dict(os.environ, PYTHONPATH=f"{here.parent}{os.pathsep}{here.parents[2]}"))
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["42", "ctx", "10000"]
