"""A job that died without recording its outcome gets the one its scheduler state implies, sealed."""
import pytest

from launcher.backends import JobState, slurm
from launcher.run.outcome import record_lost_outcome
from launcher.run.rundir import RunDir
from launcher.run.status import Status


@pytest.mark.parametrize("state,want", [("CANCELLED by 0", "cancelled"), ("TIMEOUT", "timeout"),
                                        ("COMPLETED", "failed"), ("NODE_FAIL", "failed"), ("", "failed")])
def test_lost_outcome_is_recorded_and_sealed(tmp_path, state, want):
    rd = RunDir(tmp_path)
    rd.set_status(Status.running)
    job_state = slurm.state_of(state) or JobState(Status.failed, state)
    assert record_lost_outcome(rd, job_state) == want
    status = rd.status()
    assert status.state == want and "without recording an outcome" in status.error
    assert rd.verify() == []


def test_a_final_status_is_never_overwritten(tmp_path):
    rd = RunDir(tmp_path)
    assert rd.finish(Status.completed, exit_code=0)
    assert not rd.finish(Status.failed, exit_code=1) and not rd.set_status(Status.running)
    assert rd.status().state == "completed" and rd.verify() == []


def _hydra_app_run(root, sweep, index, value):
    from launcher.run.rundir import SweepDir

    rd = SweepDir(root / sweep).run(index)
    rd.write_config({"x": index})
    rd.write_run({"run_id": f"{sweep}-{index}", "sweep_id": sweep, "index": index, "kind": "hydra_app"})
    rd.finish(Status.completed, exit_code=0, summary={"return_value": value})
    return rd


def test_a_hydra_apps_return_value_is_indexed(tmp_path, capsys):
    """What a Hydra app's task returned goes into the index (launcher runs: loss/result, --json)."""
    import sqlite3

    from launcher.archive import index, registry

    rds = [_hydra_app_run(tmp_path, "S", i, v) for i, v in enumerate([1.5, {"acc": 0.9}, None])]
    registry.record(tmp_path, [rd.path for rd in rds])
    rows = registry.list_runs(tmp_path)
    assert [r["return_value"] for r in rows] == [1.5, {"acc": 0.9}, None]
    # an index written before the column existed is rebuilt from the run dirs, saying so
    db = index.db_path(tmp_path)
    db.unlink()
    with sqlite3.connect(db) as conn:
        conn.executescript(index.SCHEMA.replace(", return_value TEXT", ""))
    registry.record(tmp_path, [rds[0].path])
    assert "older layout" in capsys.readouterr().err
    assert [r["return_value"] for r in registry.list_runs(tmp_path)] == [1.5, {"acc": 0.9}, None]


def _pending_run(root, sweep, index):
    from launcher.run.rundir import SweepDir

    rd = SweepDir(root / sweep).run(index)
    rd.write_config({"x": index})
    rd.write_run({"run_id": f"{sweep}-{index}", "sweep_id": sweep, "index": index, "backend": "local"})
    rd.set_status(Status.running)
    return rd


def test_a_command_refreshes_only_the_runs_it_names_and_never_parses_their_config(tmp_path, monkeypatch):
    """`launcher status SMALL` beside a big sweep: only SMALL's unfinished runs are re-read (their records,
    not config.yaml: the index holds it), and a change in one of them reaches the listing and the index."""
    from launcher.archive import registry

    big = [_pending_run(tmp_path, "BIG", i) for i in range(30)]
    small = [_pending_run(tmp_path, "SMALL", i) for i in range(2)]
    registry.record(tmp_path, [rd.path for rd in big + small])
    small[1].finish(Status.completed, exit_code=0)
    read, parsed = [], []
    real_read = registry.read_dir
    monkeypatch.setattr(registry, "read_dir", lambda d, config=None: read.append(str(d)) or real_read(d, config))
    real_config = RunDir.config
    monkeypatch.setattr(RunDir, "config", lambda self: parsed.append(str(self.path)) or real_config(self))

    rows = registry.list_runs(tmp_path, select=lambda rows: [r for r in rows if r["sweep_id"] == "SMALL"])
    assert [r["run_id"] for r in rows] == ["SMALL-0", "SMALL-1"]
    assert sorted(read) == sorted(str(rd.path) for rd in small) and parsed == []
    assert [r["status"] for r in rows] == ["running", "completed"]
    # the change is indexed: a listing without a refresh sees it
    assert {r["run_id"]: r["status"] for r in registry.list_runs(tmp_path, refresh=False)}["SMALL-1"] == "completed"
