"""Settling a lost job's outcome (launcher.run.outcome) against real processes: listing runs writes
nothing, `launcher status` settles once, a live job is left alone."""
import json
import subprocess
import sys

import pytest

from launcher.archive import registry
from launcher.cli import main as cli
from launcher.run import outcome
from launcher.run.job_record import JobRecord
from launcher.run.rundir import SweepDir
from launcher.run.status import Status


def _tree(path):
    return {str(p.relative_to(path)): (p.stat().st_mtime_ns, p.stat().st_mode, p.stat().st_size)
            for p in sorted(path.rglob("*"))}


@pytest.fixture
def lost_run(tmp_path):
    """A run whose job ended without recording an outcome: status.json says running, the job's
    process (local backend: its pid) is gone."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    sweep = SweepDir(tmp_path / "S")
    rd = sweep.run(0)
    rd.write_config({"x": 0})
    rd.write_job(JobRecord(backend="local", job_id=str(proc.pid)))
    rd.write_run({"run_id": "S-0", "sweep_id": "S", "index": 0, "backend": "local"})
    rd.set_status(Status.running, job_id=str(proc.pid))
    registry.record(tmp_path, [rd.path])
    return tmp_path, rd


def test_listing_runs_writes_nothing_in_a_run_dir(lost_run, capsys, monkeypatch):
    root, rd = lost_run
    monkeypatch.setenv("COLUMNS", "250")
    before = _tree(root / "S")
    (row,) = registry.list_runs(root)
    assert row["status"] == "running" and row["job_ended"] and row["job_state"] == "EXITED"
    assert cli.main(["runs", "--root", str(root)]) == 0
    assert "running (job ended: EXITED)" in capsys.readouterr().out
    assert cli.main(["runs", "--json", "--root", str(root)]) == 0
    assert json.loads(capsys.readouterr().out)[0]["class"] is None
    assert _tree(root / "S") == before
    assert rd.status().state is Status.running and not rd.is_sealed()


def test_settling_records_the_lost_outcome_once(lost_run):
    root, rd = lost_run
    assert outcome.settle(rd) is Status.failed
    st = rd.status()
    assert st.state is Status.failed and "scheduler state EXITED" in st.error and rd.verify() == []
    sealed = _tree(rd.path)
    assert outcome.settle(rd) is Status.failed and _tree(rd.path) == sealed
    (row,) = registry.list_runs(root)  # the index picks the outcome up, with its class
    assert row["status"] == "failed" and row["class"] is not None and not row["job_ended"]


def test_launcher_status_settles_a_lost_job(lost_run, capsys):
    root, rd = lost_run
    assert cli.main(["status", "S", "--json", "--root", str(root)]) == 0
    assert json.loads(capsys.readouterr().out)["counts"] == {"failed": 1}
    assert rd.status().state is Status.failed and rd.is_sealed() and rd.verify() == []
