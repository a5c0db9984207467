"""The typed status record (RunStatus): status.json read and written whole, states only as the
enum; and listing runs never writes a run dir (settling a lost job's outcome is launcher.run.outcome's)."""
import json
import os

import pytest

from launcher.run import outcome
from launcher.run.job_record import JobRecord
from launcher.run.rundir import RunDir, SweepDir
from launcher.run.status import FINAL, RunStatus, Status


def test_a_record_round_trips_through_json(tmp_path):
    rec = RunStatus(state=Status.failed, exit_code=1, error="boom", failed_rank=2, summary={"final_loss": 1.5},
                    attempt=3, stop={"reason": "hang"}, hosts=["n1", "n2"], world_size=4, job_id="7_1",
                    earlier=[{"status": "failed", "error": "first"}], extra={"written_by": "a later version"})
    text = json.dumps(rec.to_json())
    assert RunStatus.from_json(json.loads(text)) == rec
    assert json.loads(text)["status"] == "failed" and json.loads(text)["written_by"] == "a later version"
    rd = RunDir(tmp_path)
    rd.set_status(Status.running, attempt=1, hosts=["n1"])
    rd.finish(Status.completed, exit_code=0, summary={"steps": 2})
    back = rd.status()
    assert RunStatus.from_json(json.loads((tmp_path / RunDir.STATUS).read_text())) == back
    assert (back.state, back.exit_code, back.summary, back.attempt, back.hosts) == \
        (Status.completed, 0, {"steps": 2}, 1, ["n1"])
    assert back.started and back.ended and back.is_final


def test_a_run_without_status_json_is_pending(tmp_path):
    rd = RunDir(tmp_path)
    assert rd.status() == RunStatus() and rd.status().state is Status.pending
    assert not rd.is_final() and not RunStatus().is_final
    assert {s.value for s in Status if RunStatus(state=s).is_final} == set(FINAL)


def test_states_are_set_only_as_the_enum(tmp_path):
    rd = RunDir(tmp_path)
    with pytest.raises(TypeError):
        rd.set_status("running")
    with pytest.raises(TypeError):
        rd.finish("completed")
    with pytest.raises(TypeError):  # a field the record does not have
        rd.set_status(Status.running, no_such_field=1)
    with pytest.raises(ValueError):
        rd.finish(Status.running)
    assert not (tmp_path / RunDir.STATUS).exists()
    assert rd.set_status(Status.running) and rd.status().state is Status.running


def test_a_live_job_is_not_settled(tmp_path):
    rd = SweepDir(tmp_path / "S").run(0)
    rd.write_job(JobRecord(backend="local", job_id=str(os.getpid())))  # this process: alive
    rd.set_status(Status.running)
    assert outcome.settle(rd) is Status.running and not rd.is_sealed()
    assert outcome.settle(rd, ended=True) is Status.failed  # the caller saw it end: its word counts




def test_a_copied_archive_reads_its_own_submitit_folder(tmp_path):
    """job.json names the submitit folder of the sweep the job ran in (an absolute path): a copy of the
    sweep reads the logs it holds itself, never the original's; the original reads its own."""
    original, copy = tmp_path / "a" / "S", tmp_path / "b" / "S"
    for sweep in (original, copy):
        (sweep / ".submitit").mkdir(parents=True)
    job = JobRecord(backend="local", job_id="7", submitit_folder=str(original / ".submitit"),
                    stdout=str(original / ".submitit" / "7_0_log.out"))
    assert job.read_in(original) == job
    moved = job.read_in(copy)
    assert moved.submitit_folder == str(copy / ".submitit") and moved.stdout == str(copy / ".submitit" / "7_0_log.out")
    assert job.read_in(tmp_path / "elsewhere") == job  # a copy without the folder: the record as it was
