"""Fixtures: a runs root per test, and the local Slurm cluster."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Dict

import pytest


@pytest.fixture
def runs_root(tmp_path: Path) -> Path:
    root = tmp_path / "runs"
    return root


@pytest.fixture(scope="session")
def slurm() -> Dict[str, str]:
    """The local Slurm cluster from scripts/slurm-local.sh. Under scripts/test.sh it must be up."""
    conf = os.environ.get("SLURM_CONF")
    ok = bool(conf) and shutil.which("sinfo") is not None
    if ok:
        res = subprocess.run(["sinfo", "-h", "-o", "%N %t"], capture_output=True, text=True, timeout=30)
        ok = res.returncode == 0 and "node" in res.stdout
    if not ok:
        if os.environ.get("LAUNCHER_REQUIRE_SLURM") == "1":
            pytest.fail("local Slurm cluster is not up (scripts/slurm-local.sh up)")
        pytest.skip("local Slurm cluster not up: run scripts/slurm-local.sh up and export SLURM_CONF")
    return {"SLURM_CONF": conf}
