"""`launcher doctor RUN` as a command: it diagnoses a real run dir and imports no torch (the
fixtures and the pure diagnosis are in tests/unit/test_doctor.py)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from launcher.doctor import FIXES
from launcher.run.status import Status
from unit.test_doctor import OOM_STARTUP, _run_dir  # noqa: F401 (fixtures and helpers shared with the pure tests)


@pytest.mark.timeout(120)
def test_doctor_command_imports_no_torch(tmp_path):
    rd = _run_dir(tmp_path / "run")
    rd.write_rank_error(0, OOM_STARTUP)
    rd.finish(Status.failed, failed_rank=0, error="RuntimeError: DefaultCPUAllocator: can't allocate memory")
    res = subprocess.run([sys.executable, "-X", "importtime", "-m", "launcher.cli.main", "doctor", str(rd.path),
                          "--json"], capture_output=True, text=True, timeout=100, cwd=tmp_path,
                         env={"LAUNCHER_RUNS": str(tmp_path / "runs"), "PATH": "/usr/bin:/bin"})
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout)
    assert out["kind"] == "oom_startup" and out["rank"] == 0 and out["fix"] == FIXES["oom_startup"]
    imported = {line.rsplit("|", 1)[-1].strip() for line in res.stderr.splitlines() if "|" in line}
    assert "launcher.doctor" in imported and "torch" not in imported and "deepspeed" not in imported
