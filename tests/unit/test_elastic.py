"""cluster.elastic's rule (launcher.features.elastic.resize) and its login-side parts: which runs it takes, on how many
nodes and with which changes a run goes on, when it grows back, and the job it queues for itself. The
drill on the Slurm cluster: tests/integration/test_elastic.py."""
import pytest
from test_bad_input import compose_cfg

from launcher.backends.slurm import after_job_command, node_states_from_sinfo, seal_job_command
from launcher.config.rules import problems
from launcher.config.schema import typed
from launcher.features.elastic import resize as elastic
from launcher.run.rundir import RESTARTED_BY_SCHEDULE, RunDir
from launcher.run.status import Status
from launcher.runtime.restarts import STOP_CODES
from launcher.submit import resume


def _cfg(*overrides):
    return compose_cfg(["model=gpt_tiny", "cluster=local_slurm", "cluster.nodes=4", "cluster.gpus_per_node=1",
                        "train.global_batch_size=12", "train.micro_batch_size=1", "train.checkpoint.every=4",
                        "cluster.elastic.enabled=true", *overrides])


def _keys(cfg):
    return {(e.key, e.problem) for e in problems(cfg)}


def test_a_run_that_can_go_on_elsewhere_passes_and_each_thing_that_stops_it_is_named():
    assert not _keys(_cfg()), _keys(_cfg())
    assert not _keys(_cfg("cluster.elastic.enabled=false", "cluster=local", "cluster.nodes=1"))  # off: no rule
    cases = {
        ("cluster=local", "cluster.nodes=1"): "cluster.elastic.enabled",  # no nodes to lose
        ("train.checkpoint.universal=false",): "train.checkpoint.universal",
        ("train.checkpoint.every=0",): "train.checkpoint.every",
        ("parallelism.engine=deepspeed", "zero.stage=0", "precision=bf16"): "cluster.elastic.enabled",
        ("cluster.elastic.min_nodes=5",): "cluster.elastic.min_nodes",
        ("cluster.elastic.target_nodes=2",): "cluster.elastic.target_nodes",
        ("cluster.pack=true",): "cluster.pack",
    }
    for overrides, key in cases.items():
        found = _keys(_cfg(*overrides))
        assert key in {k for k, _ in found}, (overrides, found)
    (problem,) = [p for k, p in _keys(_cfg("parallelism.engine=deepspeed", "zero.stage=0", "precision=bf16"))
                  if "ZeRO" in p]
    assert "DeepSpeed ZeRO-0 in bf16" in problem and "set zero.stage" in problem
    assert not _keys(_cfg("parallelism.engine=deepspeed", "zero.stage=0"))  # fp32: any module's state
    assert not _keys(_cfg("zero.stage=2", "zero.offload_optimizer=true"))  # offloaded ZeRO reshards


def test_node_counts_go_from_the_most_usable_down_to_the_minimum():
    assert elastic.node_counts(4, 3, 1) == [3, 2, 1]
    assert elastic.node_counts(4, 9, 2) == [4, 3, 2]  # never more than the run was launched with
    assert elastic.node_counts(4, 1, 2) == []  # fewer than min_nodes: the run ends as it does when off


def test_the_changes_keep_everything_but_the_node_count_and_record_where_to_grow_back():
    plain = typed(_cfg())
    from omegaconf import OmegaConf

    plain = OmegaConf.to_container(plain, resolve=True, enum_to_str=True)
    assert elastic.changes(plain, 3) == ["cluster.nodes=3", "cluster.elastic.target_nodes=4"]
    plain["parallelism"]["dp"], plain["parallelism"]["tp"] = 4, 1  # a dp the config names follows the nodes
    plain["cluster"]["elastic"]["target_nodes"] = 4  # recorded by the first shrink: kept
    assert elastic.changes(plain, 3) == ["cluster.nodes=3", "parallelism.dp=3"]
    assert elastic.target(plain) == 4


def test_usable_nodes_are_the_idle_ones_and_the_deciding_jobs_own():
    text = "node1|debug*|mixed\nnode2|debug*|idle\nnode3|debug*|drained\nnode4|debug*|idle*\nnode5|gpu|idle\n"
    rows = node_states_from_sinfo(text, None)  # the default partition's
    assert [n for n, _ in rows] == ["node1", "node2", "node3", "node4"]
    # node4 does not respond (*), node3 is drained: neither; node1 runs only the deciding job
    assert elastic.usable(rows, own="node1") == ["node1", "node2"]
    assert elastic.usable(rows) == ["node2"]
    assert node_states_from_sinfo(text, "gpu") == [("node5", "idle")]


def test_the_decision_acts_where_the_cluster_ended_the_job_or_the_run_asked_the_job_after_it():
    by = {"reason": "time_limit", "by": elastic.BY}
    assert elastic.decision("failed", None, "NODE_FAIL") == elastic.SHRINK
    assert elastic.decision("requeued", {"reason": "preempted"}, "PREEMPTED") == elastic.SHRINK  # PreemptMode=CANCEL
    assert elastic.decision("running", None, "NODE_FAIL") == elastic.SHRINK  # its ranks died with the node
    assert elastic.decision("requeued", by, "NODE_FAIL") == elastic.SHRINK  # a peer's request, the node's loss
    assert elastic.decision("requeued", {"reason": elastic.GROW}, "COMPLETED") == elastic.GROW
    assert elastic.decision("requeued", by, "FAILED") == elastic.RESUME  # a time limit, a failure, a hang
    for state, stop, word in (("completed", None, "NODE_FAIL"), ("failed", None, "FAILED"),
                              ("cancelled", None, "CANCELLED by 0"), ("timeout", None, "TIMEOUT"),
                              ("failed", None, ""), ("requeued", by, "CANCELLED by 0"),  # the user's cancel wins
                              ("requeued", {"reason": "time_limit"}, "FAILED")):  # not the deciding job's
        assert elastic.decision(state, stop, word) is None, (state, stop, word)


def test_the_restart_is_recorded_as_a_shrink_a_grow_or_the_requests_own_reason():
    assert elastic.restart_reason(elastic.SHRINK, 4, 3, None) == elastic.SHRINK
    assert elastic.restart_reason(elastic.GROW, 3, 4, {"reason": elastic.GROW}) == elastic.GROW
    assert elastic.restart_reason(elastic.RESUME, 4, 4, {"reason": "time_limit"}) == "time_limit"  # counted
    assert elastic.restart_reason(elastic.SHRINK, 4, 4, None) == "scheduler"  # a spare node: as Slurm's requeue
    assert elastic.restart_reason(elastic.RESUME, 4, 2, {"reason": "hang"}) == elastic.SHRINK
    assert elastic.mark({"reason": "hang"}, {elastic.ENV: "1"}) == {"reason": "hang", "by": elastic.BY}
    assert elastic.mark({"reason": "hang"}, {}) == {"reason": "hang"}
    assert elastic.waits_for_its_job("requeued", {"by": elastic.BY})
    assert elastic.waits_for_its_job("requeued", {"reason": elastic.GROW})
    assert not elastic.waits_for_its_job("requeued", {"reason": "time_limit"})  # Slurm's requeue: its own job


def test_an_elastic_job_is_never_requeued_by_slurm_and_a_ranks_request_asks_nothing_of_it(tmp_path, monkeypatch):
    from launcher import backends

    slurm = backends.get("slurm")
    text = slurm.script_text(_cfg(), tmp_path, 1)
    assert "#SBATCH --no-requeue\n" in text and f"export {elastic.ENV}=1" in text
    off = slurm.script_text(_cfg("cluster.elastic.enabled=false"), tmp_path, 1)
    assert "--no-requeue" not in off and elastic.ENV not in off
    import subprocess

    calls = []
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: calls.append(a))
    monkeypatch.setenv(elastic.ENV, "1")
    slurm.request_requeue("12")  # nothing asked of Slurm: the deciding job after this one restarts the run
    assert calls == []


def test_growing_back_needs_the_missing_nodes_idle_and_grow_on():
    assert elastic.grow_due(3, 4, 1, True)
    assert not elastic.grow_due(2, 4, 1, True)  # half the way back: wait for both
    assert not elastic.grow_due(3, 4, 1, False)
    assert not elastic.grow_due(4, 4, 3, True)  # not shrunk


def test_the_layout_line_says_the_accumulation():
    before = {"engine": "ddp", "dp": 4, "tp": 1, "pp": 1, "zero": 0, "nodes": 4, "micro_batch_size": 1,
              "grad_accum": 3, "global_batch_size": 12}
    after = {**before, "dp": 3, "nodes": 3, "grad_accum": 4}
    line = elastic.summary_line(before, after, "job 7 ended by the cluster (NODE_FAIL)")
    assert line == ("job 7 ended by the cluster (NODE_FAIL): now ddp dp3 x pp1 x tp1 on 3 node(s), micro batch 1 x "
                    "grad accum 4 x dp3 = global batch 12 (was ddp dp4 x pp1 x tp1 on 4 node(s), micro batch 1 x "
                    "grad accum 3 x dp4 = global batch 12)")


def test_the_deciding_job_is_one_task_after_the_runs_job_in_its_scope(tmp_path):
    cmd = after_job_command("elastic", "launcher.features.elastic.decide", tmp_path / "s" / "r0", "afternotok:12_3",
                            tmp_path / "f", "/py", {"partition": "gpu", "qos": "high"}, 10, ("12_3",))
    assert cmd[:4] == ["sbatch", "--parsable", "--dependency=afternotok:12_3", "--kill-on-invalid-dep=yes"]
    assert "--no-requeue" in cmd and "--nodes=1" in cmd and "--ntasks=1" in cmd and "--time=10" in cmd
    assert "--partition=gpu" in cmd and "--qos=high" in cmd and not any(c.startswith("--account") for c in cmd)
    assert cmd[-1] == f"/py -m launcher.features.elastic.decide {tmp_path / 's' / 'r0'} 12_3"
    assert f"--output={tmp_path / 'f' / 'elastic.%j.out'}" in cmd
    seal = seal_job_command(tmp_path / "s" / "r0", "9", tmp_path / "f", "/py", {"SLURM_JOB_ACCOUNT": "a"})
    assert "--dependency=afterany:9" in seal and "--account=a" in seal and "--job-name=seal-s-r0" in seal


def test_growing_is_the_lowest_stop_and_no_restart_of_the_budget():
    assert STOP_CODES[elastic.GROW] == 1 < STOP_CODES["preempted"] < STOP_CODES["time_limit"]
    assert sorted(STOP_CODES.values()) == list(range(len(STOP_CODES)))  # one vote slot each, no gap
    assert elastic.GROW in RESTARTED_BY_SCHEDULE and elastic.SHRINK in RESTARTED_BY_SCHEDULE


def test_pick_takes_the_first_count_accepted_and_raises_the_last_refusal():
    seen = []

    def accept(n):
        seen.append(n)
        if n > 2:
            raise ValueError(f"{n} does not divide")
        return f"ok {n}"

    assert elastic.pick([4, 3, 2, 1], accept) == (2, "ok 2") and seen == [4, 3, 2]
    with pytest.raises(ValueError, match="3 does not divide"):  # every count refused: the last refusal
        elastic.pick([4, 3], accept)
    assert elastic.pick([], accept) is None


def test_a_run_that_ended_its_job_to_grow_is_taken_only_by_the_deciding_job(tmp_path):
    """A shrunk run whose job stopped at a checkpoint to grow is requeued (not final): `launcher resume`
    refuses it as it does any run that may still have a job; the deciding job (elastic=True) gets past
    that check to the next one (here: the run has no config archived)."""
    rd = RunDir(tmp_path / "run")
    rd.path.mkdir()
    rd.write_run({"run_id": "x-0", "layout": {}})
    rd.set_status(Status.requeued, attempt=2, stop={"reason": elastic.GROW, "step": 8})
    with pytest.raises(ValueError, match="x-0 is requeued: its job may still be running"):
        resume.prepare(rd.path)
    with pytest.raises(Exception) as got:
        resume.prepare(rd.path, elastic=True)
    assert "may still be running" not in str(got.value)
    rd.set_status(Status.requeued, attempt=2, stop={"reason": "preempted", "step": 8})  # not a grow: refused
    with pytest.raises(ValueError, match="may still be running"):
        resume.prepare(rd.path, elastic=True)


def test_a_lost_outcome_is_not_recorded_over_a_run_that_moved_on_since_it_was_read(tmp_path):
    """`launcher status` read the run requeued (its job ended to be restarted); before it records the lost
    outcome, cluster.elastic's job reopened it for a new job: nothing is written over that."""
    from launcher.backends import JobState
    from launcher.run.outcome import record_lost_outcome

    rd = RunDir(tmp_path / "run")
    rd.path.mkdir()
    rd.write_run({"run_id": "x-0", "layout": {}})
    rd.set_status(Status.requeued, attempt=2, job_id="10", stop={"reason": "time_limit", "by": elastic.BY})
    seen = rd.status()
    rd.set_status(Status.pending, attempt=2, job_id="11", resumed=True)  # the deciding job's new job
    assert record_lost_outcome(rd, JobState(Status.completed, "COMPLETED"), seen=seen) is Status.pending
    assert rd.status().state is Status.pending and rd.status().job_id == "11"
    # unchanged since read: recorded as before
    seen = rd.status()
    assert record_lost_outcome(rd, JobState(Status.failed, "FAILED"), seen=seen) is Status.failed


def test_a_commands_changes_are_taken_after_its_options_too():
    """`launcher resume RUN --steps 80 cluster.nodes=3` (the changes after an option) as `... cluster.nodes=3
    --steps 80`; anything else left over is still refused."""
    from launcher.cli.main import parse

    args = parse(["resume", "r", "parallelism.dp=2", "--steps", "80", "cluster.nodes=3", "--no-wait"])
    assert (args.run, args.steps, args.overrides, args.wait) == ("r", 80, ["parallelism.dp=2", "cluster.nodes=3"],
                                                                 False)
    with pytest.raises(SystemExit):
        parse(["resume", "r", "--steps", "80", "--bogus"])
    with pytest.raises(SystemExit):
        parse(["show", "r", "stray"])
