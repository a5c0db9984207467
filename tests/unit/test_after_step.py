"""The run's outcome decided after the job step, outside the ranks (launcher.runtime.after_step.decide,
pure), and the defaults that let failures reach it: the multi-node hang watch, the checkpoint advice."""
import pytest

from launcher.config import rules
from launcher.config.schema import hang_timeout_s
from launcher.run.status import RunStatus, Status
from launcher.runtime.after_step import Outcome, StepEnd, decide, describe
from launcher.runtime.restart_policy import Failure

NOTE = {"run": "/runs/x/0", "attempt": 2, "job_id": "9", "max_restarts": 3}
RUNNING = StepEnd(rc=137, scheduler_state="RUNNING", source="srun")  # as the Slurm backend's teardown says it


def status(state: Status, attempt: int = 2, **fields) -> RunStatus:
    return RunStatus(state=state, attempt=attempt, **fields)


def outcome(st: RunStatus, note=NOTE, end=RUNNING, used: int = 1, budget: int = 3, **kw) -> Outcome:
    return decide(st, note, end, restarts_used=used, max_restarts=budget, **kw)


def test_a_step_that_failed_with_no_word_is_requeued_within_the_budget():
    o = outcome(status(Status.running), step=9, from_step=4)
    assert o.action == "requeue"
    assert o.stop["reason"] == "failure" and o.stop["step"] == 9
    assert o.stop["detail"] == "a rank died without a word: srun exit 137 (SIGKILL)"
    failure = Failure.from_json(o.stop["failure"])
    assert failure.kind == "rank_lost" and failure.attempt == 2 and failure.progressed


@pytest.mark.parametrize("used,budget", [(3, 3), (0, 0), (5, 3)])
def test_the_budget_spent_fails_the_run_with_the_reason(used, budget):
    o = outcome(status(Status.running), used=used, budget=budget)
    assert o.action == "fail"
    assert "died without a word" in o.why and f"train.max_restarts={budget}" in o.why
    assert o.stop["exit_code"] == 137


def test_an_outcome_a_rank_recorded_is_kept():
    for state in (Status.completed, Status.failed, Status.cancelled, Status.timeout):
        assert outcome(status(state)).action == "nothing"
    # a rank's requeue that went through (no note of its request): the scheduler starts the next attempt
    assert outcome(status(Status.requeued, stop={"reason": "hang"})).action == "nothing"


def test_a_note_of_another_attempt_does_nothing():
    assert outcome(status(Status.running, attempt=3)).action == "nothing"
    stale = {**NOTE, "stop": {"reason": "failure"}, "attempt": 1}
    assert outcome(status(Status.running), note=stale).action == "nothing"


def test_a_requeue_a_rank_asked_for_is_asked_again_whatever_the_exit_status():
    asked = {**NOTE, "stop": {"reason": "failure", "rank": 1, "step": 7}}
    for st in (status(Status.running), status(Status.requeued, stop={"deferred": True})):
        for end in (RUNNING, StepEnd(0, "RUNNING"), StepEnd(1, "")):
            o = outcome(st, note=asked, end=end)
            assert o.action == "requeue" and o.stop == {"reason": "failure", "rank": 1, "step": 7, "deferred": True}


@pytest.mark.parametrize("word", ["CANCELLED", "CANCELLED by 1000", "TIMEOUT", "NODE_FAIL", "PREEMPTED",
                                  "REQUEUED", "PENDING", "FAILED"])
def test_a_job_the_scheduler_is_ending_is_left_to_it(word):
    o = outcome(status(Status.running), end=StepEnd(137, word))
    assert o.action == "nothing" and word.split()[0] in o.why


@pytest.mark.parametrize("word", ["", "RUNNING", "COMPLETING"])
def test_a_job_still_running_or_of_unknown_state_is_judged(word):
    assert outcome(status(Status.running), end=StepEnd(9, word)).action == "requeue"


def test_a_clean_exit_with_no_outcome_is_an_honest_failure():
    o = outcome(status(Status.running), end=StepEnd(0, "RUNNING"))
    assert o.action == "fail" and "no rank recorded an outcome" in o.why


def test_the_same_silent_death_before_any_new_step_fails_at_once():
    prev = Failure(type="RankLost", message="srun exit 137 (SIGKILL)", place="", kind="rank_lost", attempt=1,
                   step=6, from_step=0)
    o = outcome(status(Status.running), previous=prev, step=None, from_step=4)
    assert o.action == "fail" and o.stop["no_restart"]["kind"] == "repeated"
    # past its checkpoint, the attempt made progress: worth another try
    assert outcome(status(Status.running), previous=prev, step=6, from_step=4).action == "requeue"
    # another death (another signal) is not a repeat
    assert outcome(status(Status.running), previous=prev, end=StepEnd(134, "RUNNING", source="srun"),
                   from_step=4).action == "requeue"


def test_exit_statuses_in_words():
    assert describe(137, "srun") == "srun exit 137 (SIGKILL)"
    assert describe(134, "srun") == "srun exit 134 (SIGABRT)"
    assert describe(1) == "the step exit 1"  # a backend that names its steps no other way
    assert describe(250, "srun") == "srun exit 250"


def test_the_hang_watch_is_on_by_default_for_several_nodes_only():
    assert hang_timeout_s({"hang_timeout_s": None, "dist_timeout_s": 600}, nodes=1) == 0
    assert hang_timeout_s({"hang_timeout_s": None, "dist_timeout_s": 600}, nodes=2) == 300
    assert hang_timeout_s({"hang_timeout_s": None, "dist_timeout_s": 60}, nodes=64) == 30  # before the collective's
    assert hang_timeout_s({"hang_timeout_s": 0, "dist_timeout_s": 600}, nodes=8) == 0  # the user's 0: off
    assert hang_timeout_s({"hang_timeout_s": 45}, nodes=1) == 45


def test_the_start_up_watch_is_on_by_default_for_several_nodes_and_the_products_loops_only():
    from launcher.config.schema import startup_timeout_s

    assert startup_timeout_s({"startup_timeout_s": None, "dist_timeout_s": 600}, nodes=1) == 0
    assert startup_timeout_s({"startup_timeout_s": None, "dist_timeout_s": 600}, nodes=2) == 600
    assert startup_timeout_s({"startup_timeout_s": None, "dist_timeout_s": 600}, nodes=2, script=True) == 0
    assert startup_timeout_s({"startup_timeout_s": 90}, nodes=1, script=True) == 90  # the user's value
    assert startup_timeout_s({"startup_timeout_s": 0}, nodes=64) == 0


def test_a_multi_node_run_without_periodic_checkpoints_is_warned_at_launch():
    cfg = lambda nodes, every: {"cluster": {"nodes": nodes}, "train": {"checkpoint": {"every": every}}}  # noqa: E731
    (line,) = rules.advice(cfg(2, 0))
    assert "train.checkpoint.every=0" in line and "step 0" in line
    assert rules.advice(cfg(1, 0)) == [] and rules.advice(cfg(4, 50)) == []


def test_the_local_processes_exit_statuses_read_as_one():
    from launcher.runtime.local_controller import step_rc

    assert step_rc([0, 0]) == 0
    assert step_rc([-6, -9]) == 137  # the killed rank, not the peer that aborted after it
    assert step_rc([-6, 1]) == 134 and step_rc([1, 0]) == 1 and step_rc([None, -11]) == 139


def test_srun_says_which_task_ended_how_on_which_node():
    from launcher.backends.slurm.node import srun_deaths

    text = ("step 6\nsrun: error: node2: task 1: Killed\nsrun: launch/slurm: _step_signal: Terminating StepId=7.0\n"
            "srun: error: node1: task 0: Aborted (core dumped)\n"
            "srun: error: node4: tasks 2-3,5: Exited with exit code 1\n")
    assert srun_deaths(text) == [("node2", 1, "Killed"), ("node1", 0, "Aborted (core dumped)"),
                                 ("node4", 2, "Exited with exit code 1"), ("node4", 3, "Exited with exit code 1"),
                                 ("node4", 5, "Exited with exit code 1")]


def test_a_wordless_death_notes_the_killed_ranks_node_and_its_requeue_leaves_it_out(tmp_path):
    """srun saw rank 1 killed on node2 and rank 0 abort on node1 (its peer gone, as NCCL's teardown does):
    node2 alone is noted (kind crashed) and left out of the requeue the teardown asks for."""
    import json

    from launcher.run.rundir import RunDir
    from launcher.runtime import after_step

    rd = RunDir(tmp_path / "runs" / "s" / "0")
    rd.path.mkdir(parents=True)
    rd.write_config({"cluster": {"nodes": 2, "partition": "debug"}, "train": {"max_restarts": 3}})
    rd.write_run({"run_id": "s-0", "layout": {}})
    rd.set_status(Status.running, attempt=1)

    class Backend:
        asked = []
        step_word = "srun"

        def step_deaths(self, job_id):
            return [("node2", 1, "Killed"), ("node1", 0, "Aborted (core dumped)")]

        def partition_nodes(self, partition):
            return ["node1", "node2", "node3", "node4"]

        def requeued_since_start(self, job_id):
            return False

        def requeue_without(self, job_id, nodes, run_dir):
            self.asked.append(("without", tuple(nodes)))
            return True

        def request_requeue(self, job_id):
            self.asked.append(("plain", ()))

    note = {"run": str(rd.path), "attempt": 1, "job_id": "7", "max_restarts": 3}
    o = after_step.decide(rd.status(), note, RUNNING, restarts_used=0, max_restarts=3, step=6)
    assert after_step.note_crashes(rd, Backend(), "7", note, 6) == 1
    (ev,) = [json.loads(p.read_text()) for p in (tmp_path / "runs" / "nodes" / "events").glob("*.json")]
    assert (ev["node"], ev["kind"], ev["rank"], ev["step"]) == ("node2", "crashed", 1, 6) and "Killed" in ev["detail"]
    assert after_step.settle(rd, o, Backend(), "7") == "requeued"
    assert Backend.asked == [("without", ("node2",))]
    assert rd.status().stop["excluded"] == ["node2"]


def test_slurms_records_say_which_node_it_lost_under_a_requeued_job():
    from launcher.backends.slurm.node import last_node_fail, node_events

    sacct = ("7|NODE_FAIL|2026-12-07T11:40:00|2026-12-07T11:41:05|node[2-3]\n"
             "7|RUNNING|2026-12-07T11:41:30|Unknown|node[1-2]\n")
    assert last_node_fail(sacct) == ("2026-12-07T11:40:00", "2026-12-07T11:41:05", ["node2", "node3"])
    assert last_node_fail("7|PREEMPTED|2026-12-07T11:40:00|2026-12-07T11:41:05|node2\n") is None
    events = ("node3|2026-12-07T11:41:04|DOWN|fault-tolerance-test\n"
              "node2|2026-12-07T11:30:00|IDLE|\n")
    assert node_events(events) == [("node3", "2026-12-07T11:41:04", "fault-tolerance-test")]
    assert node_events("node3|down*|Not responding\nnode2|idle|\n") == [("node3", "down*", "Not responding")]


def test_a_node_the_scheduler_lost_is_noted_at_the_next_attempts_start(tmp_path):
    """The attempt Slurm restarted with no request of the run's: the node its backend says it lost is
    noted (kind lost) against the attempt that ran on it; a restart the run asked for asks nothing."""
    import json

    from launcher.features.nodes import record
    from launcher.run.rundir import RunDir

    rd = RunDir(tmp_path / "runs" / "s" / "0")
    rd.path.mkdir(parents=True)
    cfg = {"cluster": {"nodes": 2}}  # (the ledger on, by default, in the runs root)
    asked = []

    class Backend:
        def lost_nodes(self, job_id):
            asked.append(job_id)
            return {"node3": "Not responding"}

    rd.record_restart({"attempt": 2, "reason": "failure", "nodes": ["node2", "node3"]})
    assert record.note_lost(cfg, rd, Backend(), 2, "7") == [] and asked == []
    rd.record_restart({"attempt": 3, "reason": "scheduler", "nodes": ["node2", "node3"]})
    (event,) = record.note_lost(cfg, rd, Backend(), 3, "7")
    assert asked == ["7"] and (event.node, event.kind, event.attempt) == ("node3", "lost", 2)
    (saved,) = [json.loads(p.read_text()) for p in (tmp_path / "runs" / "nodes" / "events").glob("*.json")]
    assert saved["kind"] == "lost" and "Not responding" in saved["detail"], saved
