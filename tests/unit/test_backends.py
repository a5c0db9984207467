"""Backends: the sbatch text submitit will submit (resources, array, quoting of every value), grouping,
scheduler states, and that cluster.backend names one of them."""

from hydra import compose, initialize_config_dir

from launcher import backends
from launcher.app import CONF_DIR, normalize_overrides
from launcher.backends import slurm
from launcher.config import rules
from launcher.run.job_record import JobRecord

SLURM = backends.get("slurm")


def _cfg(*overrides):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=normalize_overrides(["cluster=local_slurm", *overrides]))


def test_one_task_per_gpu_and_array(tmp_path):
    text = SLURM.script_text(_cfg("cluster.nodes=2", "cluster.gpus_per_node=4"), tmp_path, 5)
    assert "#SBATCH --nodes=2" in text
    assert "#SBATCH --ntasks-per-node=4" in text
    assert "#SBATCH --array=0-4%5" in text
    assert "#SBATCH --partition=debug" in text
    assert "--kill-on-bad-exit=1" in text


def test_the_batch_script_asks_again_for_a_requeue_the_step_killed_after_srun(tmp_path):
    lines = SLURM.script_text(_cfg(), tmp_path / "sub mit", 1).splitlines()
    srun = next(i for i, ln in enumerate(lines) if ln.startswith("srun "))
    note = next(i for i, ln in enumerate(lines) if ln.startswith(f"export {slurm.REQUEUE_NOTE_ENV}="))
    teardown = next(i for i, ln in enumerate(lines)
                    if ln.endswith('-m launcher.runtime.after_step "$launcher_step_rc"'))
    assert note < srun < teardown
    # srun's exit status is the job's (FAILED vs COMPLETED, afterok dependencies): kept across the teardown
    assert lines[srun + 1:teardown] == ["", "", "# teardown", "launcher_step_rc=$?"]
    assert lines[teardown + 1] == 'exit "$launcher_step_rc"'
    assert lines[note].endswith(f"='{tmp_path}/sub mit'/requeue.${{SLURM_JOB_ID}}.json")


def test_single_point_is_not_an_array(tmp_path):
    assert "--array" not in SLURM.script_text(_cfg(), tmp_path, 1)


def test_gpus_requested_only_when_cluster_has_them(tmp_path):
    assert "--gpus-per-node" not in SLURM.script_text(_cfg(), tmp_path, 1)
    text = SLURM.script_text(_cfg("cluster=a100_80g"), tmp_path, 1)
    assert "#SBATCH --gpus-per-node=8" in text and "#SBATCH --account" not in text


def test_points_with_different_resources_are_grouped_apart():
    a, b, c = _cfg("optim.lr=0.1"), _cfg("optim.lr=0.2"), _cfg("cluster.nodes=1")
    assert SLURM.group_key(a) == SLURM.group_key(b) != SLURM.group_key(c)
    local = backends.get("local")
    assert local.group_key(_cfg("cluster=local")) != SLURM.group_key(a)


def test_backends_are_the_modules_of_the_package():
    assert backends.names() == ["local", "slurm"]
    assert backends.get("local").waits and not SLURM.waits
    assert backends.of(_cfg()).name == "slurm"


def test_unknown_backend_names_the_key_and_the_choices():
    errs = rules.problems(_cfg("cluster.backend=pbs"))
    assert [e.key for e in errs] == ["cluster.backend"]
    assert "'pbs' is not a backend" in str(errs[0]) and "local, slurm" in errs[0].fix


def test_slurm_states_map_to_run_statuses():
    assert slurm.state_of("CANCELLED by 0").status.value == "cancelled"
    assert slurm.state_of("TIMEOUT").ended and not slurm.state_of("PENDING").ended
    assert slurm.state_of("PREEMPTED").status.value == "requeued"
    assert slurm.state_of("SOMETHING_NEW") is None


def test_state_lines_parse_with_the_last_word_of_an_id_winning():
    text = "12_1|REQUEUED\n12_1|CANCELLED by 0\n12_2|SOMETHING_NEW\n|RUNNING\n13|TIMEOUT+\n"
    out = slurm.parse_states(text)
    assert set(out) == {"12_1", "13"}
    assert out["12_1"].ended and out["12_1"].raw == "CANCELLED by 0" and out["13"].status.value == "timeout"


def test_an_array_task_that_never_started_takes_its_compressed_records_state():
    """sacct and squeue keep one record of an array's tasks that never started (``A_[...]``): a task asked
    for by its own id takes that record's state, so a pending array cancelled outside the product settles."""
    packed = slurm.parse_states("7_[2-4,9%2]|CANCELLED by 0\n7_0|COMPLETED\n8_[0-1]|PENDING\n")
    out = slurm.with_array_tasks(packed, ["7_3", "7_9", "7_5", "8_1", "9_0", "7_0"])
    assert out["7_3"].status.value == "cancelled" and out["7_3"].ended and out["7_9"].ended
    assert "7_5" not in out and "9_0" not in out  # outside the brackets, or no record: unknown
    assert out["8_1"].status.value == "pending" and out["7_0"].status.value == "completed"


def test_the_tasks_of_an_array_cancelled_whole_while_pending_take_its_one_record():
    """scancel of a pending array before any task was split off leaves sacct one record named by the array's
    id alone (seen on the local cluster: ``1431|CANCELLED by 0`` for 1,000 tasks): each task takes it."""
    out = slurm.with_array_tasks(slurm.parse_states("1431|CANCELLED by 0\n"), ["1431_0", "1431_999", "1432_1"])
    assert out["1431_0"].ended and out["1431_999"].status.value == "cancelled"
    assert "1432_1" not in out


def test_log_paths_are_submitits(tmp_path):
    job = JobRecord(backend="slurm", job_id="12_3", submitit_folder=str(tmp_path))
    assert SLURM.log_path(job, 2) == tmp_path / "12_3_2_log.out"
    assert SLURM.log_path(job, 0, err=True) == tmp_path / "12_3_0_log.err"


def test_an_sbatch_extra_of_true_is_a_bare_flag_and_other_values_stay_as_given(tmp_path):
    """sbatch rejects --no-requeue=True; a YAML true (typed as a string in the mapping) is the flag alone."""
    text = SLURM.script_text(_cfg("+cluster.sbatch_extra.no-requeue=true", "+cluster.sbatch_extra.reservation=big",
                                  "+cluster.sbatch_extra.kill-on-invalid-dep=yes"), tmp_path, 1)
    assert "#SBATCH --no-requeue\n" in text and "--no-requeue=" not in text
    assert "#SBATCH --reservation=big\n" in text and "#SBATCH --kill-on-invalid-dep=yes\n" in text


def test_a_job_requeued_after_its_node_failed_reads_the_controllers_pending_not_accountings_node_fail(
        monkeypatch):
    """For a moment after a node failure accounting holds the job's first allocation as NODE_FAIL while
    the controller has requeued it (PENDING): a `launcher status` then must not record the run failed
    (found by the review's probe P9: the run stayed failed at step 18 of 150)."""
    import launcher.backends.slurm.limits as limits

    asked = []

    def run(cmd, say_failure=False):
        asked.append(cmd[0])
        if cmd[0] == "sacct":
            return "51|NODE_FAIL\n52|NODE_FAIL\n53|COMPLETED\n"
        return "51|PENDING\n"  # squeue: 52 is gone from the controller (purged): accounting's word stands

    monkeypatch.setattr(limits, "run", run)
    got = slurm.BACKEND.states([{"job_id": "51"}, {"job_id": "52"}, {"job_id": "53"}])
    assert got["51"].status.value == "pending" and not got["51"].ended
    assert got["52"].status.value == "failed" and got["53"].status.value == "completed"
    assert asked == ["sacct", "squeue"]
