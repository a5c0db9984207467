"""Sweeps as a whole: arrays under the scheduler's limits (chunking, throttle, MaxSubmitJobs), the
limits read from real `scontrol show config` output, one array per resource shape whatever the names,
and the results table (swept keys, objective direction, order, CSV)."""
import csv
import io
from types import SimpleNamespace

import pytest
from hydra import compose, initialize_config_dir

from launcher import backends, sweeps
from launcher.app import CONF_DIR, normalize_overrides
from launcher.backends import slurm
from launcher.sweeps import ArrayLimits, Chunk, TooManyJobs, plan_arrays

SLURM = backends.get("slurm")

# `scontrol show config` of the local Slurm 22.05 cluster (scripts/slurm-local.sh), lines around the limits
SCONTROL = """Configuration data as of 2026-11-29T17:45:11
AccountingStorageBackupHost = (null)
AccountingStorageEnforce = none
MaxArraySize            = 1001
MaxDBDMsgs              = 20016
MaxJobCount             = 10000
MaxJobId                = 67043328
MaxMemPerNode           = UNLIMITED
MaxStepCount            = 40000
MaxTasksPerNode         = 512
"""


def _cfg(*overrides):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=normalize_overrides(["cluster=local_slurm", *overrides]))


# ---- chunking ------------------------------------------------------------------------------------


def test_a_group_larger_than_max_array_size_splits_into_arrays():
    chunks = plan_arrays([5], ArrayLimits(max_array_size=2), [256])
    assert [(c.start, c.stop) for c in chunks] == [(0, 2), (2, 4), (4, 5)]
    assert [len(c) for c in chunks] == [2, 2, 1] and {c.group for c in chunks} == {0}


def test_no_limits_is_one_array_per_group():
    assert plan_arrays([3, 1], ArrayLimits(), [4, 4]) == [Chunk(0, 0, 3, 4), Chunk(1, 0, 1, 4)]
    assert plan_arrays([1001], ArrayLimits(max_array_size=1001), [8]) == [Chunk(0, 0, 1001, 8)]
    assert plan_arrays([0, 2], ArrayLimits(), [1, 1]) == [Chunk(1, 0, 2, 1)]


def test_the_throttle_is_shared_by_the_arrays_of_a_group():
    chunks = plan_arrays([10], ArrayLimits(max_array_size=3), [10])  # 4 arrays share %10
    assert [c.parallelism for c in chunks] == [3, 3, 2, 2] and sum(c.parallelism for c in chunks) == 10
    assert [c.parallelism for c in plan_arrays([6], ArrayLimits(max_array_size=2), [1])] == [1, 1, 1]


def test_every_point_lands_in_exactly_one_array():
    sizes = [7, 1, 12]
    chunks = plan_arrays(sizes, ArrayLimits(max_array_size=4), [256, 256, 256])
    assert all(len(c) <= 4 for c in chunks)
    for g, n in enumerate(sizes):
        covered = [i for c in chunks if c.group == g for i in range(c.start, c.stop)]
        assert covered == list(range(n))


def test_more_points_than_max_submit_jobs_is_refused_before_submitting():
    with pytest.raises(TooManyJobs, match=r"5 points.*queue 3 jobs"):
        plan_arrays([5], ArrayLimits(max_submit_jobs=3), [256])
    with pytest.raises(TooManyJobs, match=r"2 already queued.*1 can be submitted"):
        plan_arrays([2, 1], ArrayLimits(max_submit_jobs=3, queued=2), [1, 1])
    assert len(plan_arrays([2, 1], ArrayLimits(max_submit_jobs=3), [1, 1])) == 2


def test_overrides_replace_the_schedulers_limits():
    lim = ArrayLimits(1001, 10000, 4).with_overrides(2, None)
    assert lim == ArrayLimits(2, 10000, 4)
    assert ArrayLimits().with_overrides(None, 7) == ArrayLimits(None, 7, 0)


def test_limits_from_real_scontrol_output():
    assert slurm.limits_from_config(SCONTROL) == {"max_array_size": 1001, "max_job_count": 10000,
                                                  "max_submit_jobs": None}
    assert slurm.limits_from_config("") == {"max_array_size": None, "max_job_count": None, "max_submit_jobs": None}
    assert slurm.limits_from_config("MaxArraySize = 0\n")["max_array_size"] is None  # 0: arrays disabled/unset
    assert not slurm.enforces_limits(SCONTROL)  # AccountingStorageEnforce = none: no association limits
    assert slurm.enforces_limits("AccountingStorageEnforce = associations,limits,qos\n")
    assert slurm.max_submit_from_sacctmgr("|\n") is None
    assert slurm.max_submit_from_sacctmgr("50|\n20|\n") == 20


def test_configured_limits_spare_the_scheduler_queries():
    calls = []
    real = slurm.limits.run
    slurm.limits.run = lambda cmd: calls.append(cmd[0]) or ""
    try:
        lim = SLURM.array_limits(SimpleNamespace(cluster={"max_array_size": 2, "max_submit_jobs": 9}))
    finally:
        slurm.limits.run = real
    assert lim.max_array_size == 2 and lim.max_submit_jobs == 9
    assert calls == ["squeue"]  # only how many jobs are queued now
    assert backends.get("local").array_limits(None) == ArrayLimits()


# ---- one array per resource shape ----------------------------------------------------------------


def test_points_differing_in_model_or_name_share_one_array():
    tiny, big = _cfg("model=gpt_tiny"), _cfg("model=gpt_125m")
    assert tiny.submit.job_name != big.submit.job_name
    assert SLURM.group_key(tiny) == SLURM.group_key(big)
    assert SLURM.group_key(_cfg("name=a")) == SLURM.group_key(_cfg("name=b", "optim.lr=0.1", "seed=3"))
    assert SLURM.group_key(_cfg("cluster.array_parallelism=2")) == SLURM.group_key(_cfg())
    assert SLURM.group_key(_cfg("cluster.nodes=1")) != SLURM.group_key(_cfg("cluster.nodes=2"))
    assert SLURM.group_key(_cfg("cluster.time_min=5")) != SLURM.group_key(_cfg())


def test_the_submission_carries_the_sweeps_name_and_throttle(tmp_path):
    assert sweeps.job_name(["gpt_tiny", "gpt_tiny"], "20260101-000000-abcd") == "gpt_tiny"
    assert sweeps.job_name(["gpt_tiny", "gpt_125m"], "20260101-000000-abcd") == "sweep-20260101-000000-abcd"
    text = SLURM.script_text(_cfg("model=gpt_125m"), tmp_path, 5, job_name="sweep-x", parallelism=2)
    assert "#SBATCH --job-name=sweep-x" in text and "#SBATCH --array=0-4%2" in text


def test_dry_run_previews_one_script_per_array(tmp_path):
    from launcher.submit import pipeline

    points = [pipeline.Point(_cfg(f"seed={s}", "cluster.max_array_size=2", "cluster.max_submit_jobs=100",
                                  f"submit.runs_root={tmp_path}", "submit.dry_run=true",
                                  "model=gpt_tiny"), [f"seed={s}"]) for s in range(5)]
    out = io.StringIO()
    pipeline.launch(points, argv=["launch"], out=out)
    text = out.getvalue()
    assert text.count("# ---- sbatch script for points") == 3
    assert "points [0, 1] (2 array task(s))" in text and "points [4] (1 array task(s))" in text
    assert text.count("#SBATCH --job-name=gpt_tiny") == 3
    bad = [pipeline.Point(p.cfg.copy(), p.overrides) for p in points]
    for p in bad:
        p.cfg.cluster.max_submit_jobs = 3
        p.cfg.submit.waves = False  # the setting under test: without waves, a sweep past the room is refused
    with pytest.raises(pipeline.InvalidSweep, match="MaxSubmitJobs"):
        pipeline.launch(bad, argv=["launch"], out=io.StringIO())


# ---- results -------------------------------------------------------------------------------------


def test_overrides_and_the_keys_a_sweep_varies():
    assert sweeps.parse_overrides(["seed=1", "+x.y=2", "~z", "model=gpt_tiny"]) == {
        "seed": "1", "x.y": "2", "z": "<deleted>", "model": "gpt_tiny"}
    pts = [{"seed": "1", "model": "a", "t": "3"}, {"seed": "2", "model": "a", "t": "3"}, {"seed": "3", "model": "a",
                                                                                         "t": "3", "lr": "1"}]
    assert sweeps.swept_keys(pts) == ["seed", "lr"]
    assert sweeps.swept_keys([{"a": "1"}]) == []


@pytest.mark.parametrize("key,higher", [
    ("final_loss", False), ("loss", False), ("step_time_s", False), ("val_perplexity", False),
    ("mean_tokens_per_s", True), ("tokens_per_s", True), ("samples_per_s", True), ("tflops", True), ("mfu", True),
    ("val_accuracy", True), ("f1", True), ("+final_loss", True), ("-mfu", False)])
def test_objective_direction(key, higher):
    assert sweeps.higher_is_better(key) is higher


def _rows(objective):
    summaries = [
        ("s-0", "completed", {"lr": "1e-3"}, {"final_loss": 2.5, "mean_tokens_per_s": 900.0, "steps": 3}),
        ("s-1", "failed", {"lr": "2e-3"}, {}),
        ("s-2", "completed", {"lr": "3e-3"}, {"final_loss": 2.1, "mean_tokens_per_s": 800.0, "steps": 3}),
        ("s-3", "completed", {"lr": "4e-3"}, {"final_loss": 2.3, "mean_tokens_per_s": 1000.0, "steps": 3}),
    ]
    return [sweeps.result_row(rid, st, ov, s, ["lr"], objective) for rid, st, ov, s in summaries]


def test_results_best_first_lower_loss_wins_failed_last():
    rows = sweeps.ranked(sweeps.sort_results(_rows("final_loss"), "final_loss"))
    assert [r["run_id"] for r in rows] == ["s-2", "s-3", "s-0", "s-1"]
    assert [r["rank"] for r in rows] == [1, 2, 3, ""]
    assert rows[0]["lr"] == "3e-3" and rows[0]["objective"] == 2.1


def test_results_by_throughput_higher_wins():
    rows = sweeps.sort_results(_rows("tokens_per_s"), "tokens_per_s")
    assert [r["run_id"] for r in rows] == ["s-3", "s-0", "s-2", "s-1"]
    rows = sweeps.sort_results(_rows("mean_tokens_per_s"), "mean_tokens_per_s")
    assert rows[0]["objective"] == 1000.0


def test_results_csv():
    rows = sweeps.ranked(sweeps.sort_results(_rows("final_loss"), "final_loss"))
    text = sweeps.to_csv(rows, ["lr"])
    parsed = list(csv.DictReader(io.StringIO(text)))
    assert list(parsed[0]) == ["rank", "run_id", "lr", "status", "final_loss", "tokens_per_s", "steps", "objective"]
    assert [p["run_id"] for p in parsed] == ["s-2", "s-3", "s-0", "s-1"]
    assert parsed[-1]["final_loss"] == "" and parsed[-1]["status"] == "failed" and parsed[0]["final_loss"] == "2.1"


def test_a_non_finite_objective_counts_as_none():
    row = sweeps.result_row("r", "completed", {}, {"final_loss": float("nan")}, [], "final_loss")
    assert row["objective"] is None


# ---- retry: what is checked before anything changes -----------------------------------------------


def test_the_curve_of_the_latest_attempt():
    rows = lambda *steps: [{"step": s} for s in steps]  # noqa: E731
    assert sweeps.current_curve(rows(1, 2, 3)) == rows(1, 2, 3)
    assert sweeps.current_curve(rows(1, 1, 2, 3)) == rows(1, 2, 3)  # started again from step 0
    assert sweeps.current_curve(rows(1, 2, 3, 4, 3, 4, 5)) == rows(1, 2, 3, 4, 5)  # from a checkpoint after 2
    assert sweeps.current_curve([]) == []
