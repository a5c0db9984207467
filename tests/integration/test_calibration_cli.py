"""`launcher plan --calibrate` as a command: it imports no torch, and a later estimate for the
cluster uses the constants it wrote (the fit itself: tests/unit/test_calibration.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from recipes.gpt.plan import calibrate
from unit.test_calibration import BASE, REPO, RUNS, TRUE, cfg_with, cluster_file, make_run  # noqa: F401 (fixtures and helpers shared with the pure tests)

# the code under test: a checkout on PYTHONPATH (a worktree, a mutation copy), not the venv's install
_CODE = {k: os.environ[k] for k in ("PYTHONPATH",) if k in os.environ}


def test_a_later_estimate_for_the_cluster_uses_the_written_constants(tmp_path):
    conf = tmp_path / "conf"
    import shutil

    shutil.copytree(REPO / "conf", conf)
    target = conf / "cluster" / "local.yaml"
    target.write_text(calibrate.updated_cluster_file(target.read_text(), TRUE, ["r"], "t"))
    env = dict(os.environ, LAUNCHER_CONF_DIR=str(conf))
    res = subprocess.run([sys.executable, "-m", "launcher.cli.main", "plan", "--json", *BASE], capture_output=True,
                         text=True, env=env, cwd=tmp_path, timeout=120)
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout)
    assert got["cluster"]["calibration"] == pytest.approx(TRUE.as_dict())
    _, parts, _ = calibrate.planned(cfg_with(*BASE))
    assert got["layouts"][0]["step_time_s"] == pytest.approx(parts.step_time(TRUE), rel=1e-9)


def test_calibrate_never_imports_torch(tmp_path, cluster_file):
    runs = [make_run(tmp_path / "runs", n, o) for n, o in list(RUNS.items())[:2]]
    res = subprocess.run([sys.executable, "-X", "importtime", "-m", "launcher.cli.main", "plan", "--calibrate",
                          *map(str, runs), "--cluster-file", str(cluster_file)], capture_output=True, text=True,
                         timeout=120, cwd=tmp_path, env={"PATH": "/usr/bin:/bin", "LAUNCHER_RUNS": str(tmp_path),
                                                         **_CODE})
    assert res.returncode == 0, res.stderr[-2000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in res.stderr.splitlines() if "|" in line}
    assert "recipes.gpt.plan.calibrate" in imported and "torch" not in imported and "deepspeed" not in imported
