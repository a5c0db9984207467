"""The stop paths' pure parts: what the scheduler says a TERM was, teardown that keeps the outcome in
flight, and what a wandb stream logs again after a killed service. (The drills on real Slurm:
tests/integration/test_fault_tolerance.py, test_asha.py, test_any_model_slurm.py.)"""
import pytest

from launcher.backends.slurm import job_ending_of
from launcher.runtime import teardown
from launcher.runtime.restarts import Interrupted
from launcher.training.wandb_stream import backfill, wandb_id

# `scontrol show job -o` read inside each job's TERM handler on the local cluster (fields abridged)
REQUEUED = ("JobId=3 JobName=j.sh JobState=COMPLETING Reason=None Requeue=1 Restarts=1 RunTime=00:00:00 "
            "TimeLimit=UNLIMITED StartTime=2026-12-05T10:21:33 EndTime=Unknown")
CANCELLED = ("JobId=4 JobName=j.sh JobState=COMPLETING Reason=None Requeue=1 Restarts=0 RunTime=00:00:04 "
             "TimeLimit=UNLIMITED StartTime=2026-12-05T10:21:29 EndTime=2026-12-05T10:21:33")


def test_a_requeue_counts_a_restart_before_the_term():
    assert job_ending_of(REQUEUED, restart_count=0) == "requeued"
    # the job's second start, requeued again
    assert job_ending_of(REQUEUED.replace("Restarts=1", "Restarts=2"), restart_count=1) == "requeued"


def test_a_cancel_has_an_end_time_and_no_new_restart():
    assert job_ending_of(CANCELLED, restart_count=0) == "cancelled"
    assert job_ending_of(CANCELLED.replace("COMPLETING", "CANCELLED"), restart_count=0) == "cancelled"
    # a requeued job's later cancel: its restart count is the job's own
    assert job_ending_of(CANCELLED.replace("Restarts=0", "Restarts=1"), restart_count=1) == "cancelled"


def test_a_time_limit_is_not_a_cancel():
    limit = CANCELLED.replace("RunTime=00:00:04", "RunTime=00:10:00").replace("TimeLimit=UNLIMITED",
                                                                              "TimeLimit=00:10:00")
    assert job_ending_of(limit, restart_count=0) == "timeout"
    assert job_ending_of(CANCELLED.replace("COMPLETING", "TIMEOUT"), restart_count=0) == "timeout"
    assert job_ending_of(limit.replace("TimeLimit=00:10:00", "TimeLimit=1-00:00:00"), restart_count=0) == "cancelled"


def test_a_term_while_the_job_runs_on_or_no_answer_is_unknown():
    running = CANCELLED.replace("COMPLETING", "RUNNING").replace("EndTime=2026-12-05T10:21:33", "EndTime=Unknown")
    assert job_ending_of(running, restart_count=0) is None  # not the scheduler's end of the job
    # a running job with a time limit shows its expected end: srun ending the step of a failed task
    limited = CANCELLED.replace("COMPLETING", "RUNNING").replace("TimeLimit=UNLIMITED", "TimeLimit=01:00:00")
    assert job_ending_of(limited, restart_count=0) is None
    assert job_ending_of("", restart_count=0) is None  # scontrol failed or the job is gone


def test_a_lost_node_or_a_failure_is_not_a_cancel():
    assert job_ending_of(CANCELLED.replace("Reason=None", "Reason=NodeDown"), restart_count=0) is None
    for state in ("NODE_FAIL", "FAILED", "PREEMPTED", "COMPLETED"):
        assert job_ending_of(CANCELLED.replace("COMPLETING", state), restart_count=0) is None, state
    assert job_ending_of(CANCELLED.replace("Reason=None", "Reason=TimeLimit"), restart_count=0) == "timeout"


def test_a_teardown_error_never_replaces_the_stop_in_flight(capsys):
    def broken():
        raise ConnectionResetError("Connection lost")

    with pytest.raises(Interrupted):
        try:
            raise Interrupted("preempted", 12)
        finally:
            teardown.step(broken, "closing the metrics sink")
    err = capsys.readouterr().err
    assert "closing the metrics sink failed while the rank ended (Interrupted" in err and "Connection lost" in err


def test_a_teardown_error_after_a_good_end_is_raised():
    def broken():
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        teardown.step(broken, "closing the run context")


def test_the_next_attempt_logs_again_what_a_killed_service_lost():
    history = [{"step": s, "loss": 10.0 - s} for s in (3, 1, 2, 4, 5)]
    assert [r["step"] for r in backfill(history, durable_through=0)] == [1, 2, 3, 4, 5]  # attempt 1 lost all
    assert [r["step"] for r in backfill(history, durable_through=3)] == [4, 5]
    assert backfill(history, durable_through=5) == []


def test_the_wandb_id_is_the_run_id_in_wandbs_characters():
    assert wandb_id("20261205-102343-e8e8-0") == "20261205-102343-e8e8-0"
    assert wandb_id("a/b c") == "a-b-c" and len(wandb_id("x" * 100)) == 64


def test_wandbs_look_for_staged_launch_inputs_runs_only_where_the_program_could_have_staged_some(monkeypatch):
    """wandb.init's look for W&B Launch's staged inputs imports the Launch agent (~0.5 s of CPU at every
    attempt): skipped where its inputs module was never imported, wandb's own where it was."""
    import sys
    import types

    from launcher.training import wandb_stream

    looked = []

    class Run:
        def _detect_and_apply_job_inputs(self):
            looked.append(self)

    fake = types.SimpleNamespace(sdk=types.SimpleNamespace(wandb_run=types.SimpleNamespace(Run=Run)))
    monkeypatch.delitem(sys.modules, wandb_stream.LAUNCH_INPUTS, raising=False)
    wandb_stream.skip_unstaged_launch_inputs(fake)
    wandb_stream.skip_unstaged_launch_inputs(fake)  # (once: the guard is not wrapped again)
    run = Run()
    run._detect_and_apply_job_inputs()
    assert looked == []
    monkeypatch.setitem(sys.modules, wandb_stream.LAUNCH_INPUTS, types.ModuleType(wandb_stream.LAUNCH_INPUTS))
    run._detect_and_apply_job_inputs()
    assert looked == [run]
    wandb_stream.skip_unstaged_launch_inputs(types.SimpleNamespace())  # a wandb without that method: nothing
    import wandb

    assert hasattr(wandb.sdk.wandb_run.Run, "_detect_and_apply_job_inputs")  # the name this guards still exists
