"""A job that died without recording its outcome gets the one its scheduler state implies, sealed."""
import pytest

from launcher.archive.registry import record_lost_outcome
from launcher.backends import JobState, slurm
from launcher.rundir import RunDir, Status


@pytest.mark.parametrize("state,want", [("CANCELLED by 0", "cancelled"), ("TIMEOUT", "timeout"),
                                        ("COMPLETED", "failed"), ("NODE_FAIL", "failed"), ("", "failed")])
def test_lost_outcome_is_recorded_and_sealed(tmp_path, state, want):
    rd = RunDir(tmp_path)
    rd.set_status("running")
    job_state = slurm.state_of(state) or JobState(Status.failed, state)
    assert record_lost_outcome(rd, job_state) == want
    status = rd.status()
    assert status["status"] == want and "without recording an outcome" in status["error"]
    assert rd.verify() == []


def test_a_final_status_is_never_overwritten(tmp_path):
    rd = RunDir(tmp_path)
    assert rd.finish("completed", exit_code=0)
    assert not rd.finish("failed", exit_code=1) and not rd.set_status("running")
    assert rd.status()["status"] == "completed" and rd.verify() == []
