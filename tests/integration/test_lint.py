"""The tree is ruff-clean under the project's config (pyproject.toml: [tool.ruff])."""
import importlib.util
import subprocess
import sys

import pytest

from helpers import REPO

# every Python tree of the project; keep in step with docs and scripts that run ruff
LINTED = ("launcher", "recipes", "hydra_plugins", "tests", "benchmarks", "scripts")


@pytest.mark.skipif(importlib.util.find_spec("ruff") is None,
                    reason="ruff is not installed (it comes with the `test` extra: pip install -e .[test])")
def test_ruff_check_is_clean():
    res = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", *LINTED], cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
