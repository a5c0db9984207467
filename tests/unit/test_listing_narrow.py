"""Listings cost what they show: the index read by sweep or newest first, a layout before `tampered`
migrated in place (tests/integration/test_listing_cli.py: `launcher runs` lists the newest 50)."""
import sqlite3

from launcher.archive import index, registry
from launcher.run.rundir import SweepDir
from launcher.run.status import Status


def _run(root, sweep, i, ts, final=True):
    rd = SweepDir(root / sweep).run(i)
    rd.write_config({"x": i})
    meta = rd.write_run({"run_id": f"{sweep}-{i}", "sweep_id": sweep, "index": i})
    meta["created_ts"] = ts  # a fixed order
    rd.write_run(meta)
    if final:
        rd.finish(Status.completed, exit_code=0)
    return rd


def _root(tmp_path, sweeps=3, per=30):
    rds = [_run(tmp_path, f"S{s}", i, 1000.0 * s + i) for s in range(sweeps) for i in range(per)]
    registry.record(tmp_path, [rd.path for rd in rds])
    return rds


def test_the_index_is_read_by_sweep_and_newest_first(tmp_path):
    _root(tmp_path)
    assert [r["run_id"] for r in registry.list_runs(tmp_path, sweep_ids=["S1"])] == [f"S1-{i}" for i in range(30)]
    newest = registry.list_runs(tmp_path, newest=5, configs=False)
    assert [r["run_id"] for r in newest] == [f"S2-{i}" for i in range(25, 30)]  # oldest first among them
    assert all(r["config"] == {} for r in newest)  # not parsed for a listing that shows none
    assert registry.list_runs(tmp_path, sweep_ids=["S0"])[0]["config"] == {"x": 0}
    assert registry.count(tmp_path) == 90 and registry.count(tmp_path, ["S0", "S2"]) == 60
    assert registry.sweeps_named("S1-7") == ["S1", "S1-7"] and "S1" in registry.sweeps_named(str(tmp_path / "S1" / "7"))


def test_an_index_of_the_layout_before_tampered_gets_the_column_not_a_rebuild(tmp_path, capsys):
    rds = _root(tmp_path, sweeps=1, per=3)
    db = index.db_path(tmp_path)
    db.unlink()
    with sqlite3.connect(db) as conn:
        conn.executescript(index.SCHEMA.replace(", tampered INTEGER", ""))
    registry.record(tmp_path, [rds[0].path])
    assert "older layout" not in capsys.readouterr().err
    with sqlite3.connect(db) as conn:
        assert [r[1] for r in conn.execute("PRAGMA table_info(runs)")] == list(index.COLUMNS)
