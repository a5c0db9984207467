"""SweepDir records of a multirun whose batches join one sweep: sweep.json and the per-point record
grow with each batch, nothing of an earlier batch is lost, `created` stays the first batch's."""
import json

from launcher.run.rundir import RunDir, SweepDir


def test_sweep_json_grows_with_each_batch(tmp_path):
    sd = SweepDir(tmp_path / "S")
    sd.path.mkdir()
    sd.extend({"sweep_id": "S", "argv": ["launch", "-m"], "job_ids": ["11"], "runs": ["S-1", "S-0"], "kind": "x"})
    first = sd.read()
    assert first["runs"] == ["S-0", "S-1"] and first["num_runs"] == 2 and first["job_ids"] == ["11"]
    sd.extend({"sweep_id": "S", "argv": ["launch", "-m"], "job_ids": ["12", "11"], "runs": ["S-10", "S-2"]})
    got = sd.read()
    assert got["runs"] == ["S-0", "S-1", "S-2", "S-10"]  # by index, not as text
    assert got["num_runs"] == 4 and got["job_ids"] == ["11", "12"] and got["kind"] == "x"
    assert got["created"] == first["created"]


def test_points_record_grows_and_each_run_reads_its_own(tmp_path):
    sd = SweepDir(tmp_path / "S")
    (sd.path / SweepDir.SHARED).mkdir(parents=True)
    sd.add_points({"0": {"seeds": {"seed": 1}, "overrides": {"overrides": ["seed=1"], "choices": {}}}})
    sd.add_points({"1": {"seeds": {"seed": 2}, "overrides": {"overrides": ["seed=2"], "choices": {}}}})
    record = json.loads((sd.path / SweepDir.SHARED / SweepDir.POINTS).read_text())
    assert set(record) == {"0", "1"}
    for i in (0, 1):
        rd = RunDir(sd.path / str(i))
        rd.path.mkdir()
        assert rd.seeds() == {"seed": i + 1} and rd.overrides()["overrides"] == [f"seed={i + 1}"]
