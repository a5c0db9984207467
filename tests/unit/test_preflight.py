"""The preflight ladder (launcher.features.preflight.ladder): which rungs a config gets and what each
changes (composed with the real conf/ and checked as `launch` checks), and the verdict rules on what a
rung's run left."""
import math

import pytest

from launcher.features.preflight import ladder
from launcher.features.preflight.climb import InvalidLadder, compose_point, prepare
from launcher.submit.pipeline import validate as check

BASE = ["model=gpt_tiny", "precision=fp32", "train.global_batch_size=16", "train.micro_batch_size=2"]
SLURM_3D = [*BASE, "cluster=local_slurm", "cluster.nodes=2", "cluster.gpus_per_node=2", "parallelism=3d"]


def _ladder(overrides, steps=6):
    return {r.name: r for r in ladder.ladder(compose_point(overrides).cfg, steps=steps)}


def _values(rung):
    return dict(o.split("=", 1) for o in rung.overrides)


def test_every_rung_of_a_3d_layout_over_two_nodes():
    rungs = _ladder(SLURM_3D)
    assert list(rungs) == list(ladder.RUNGS)
    assert not any(r.skip for r in rungs.values())
    smoke, node, comm = _values(rungs["smoke"]), _values(rungs["node"]), _values(rungs["comm"])
    assert (smoke["cluster.nodes"], smoke["cluster.gpus_per_node"], smoke["parallelism.tp"], smoke["parallelism.pp"]) \
        == ("1", "1", "1", "1")
    assert smoke["train.global_batch_size"] == "1" and smoke["train.steps"] == str(ladder.SHORT_STEPS)
    # one node holds the tp group (tp=2 of 2 processes: dp 1); one stage's share of the layers
    assert node["cluster.nodes"] == "1" and node["parallelism.pp"] == "1" and "parallelism.tp" not in node
    assert node["train.global_batch_size"] == "2" and node["model.num_layers"] == "1"
    assert comm["recipe"] == "commbench" and comm["cluster.nodes"] == "2"
    assert _values(rungs["full"])["train.steps"] == "6"
    tuned = _values(rungs["tuned"])
    assert (tuned["precision.dtype"], tuned["train.recompute"]) == ("bf16", "selective")
    # no rung restarts (a preflight wants to see a failure, not hide it) but the resume rung's one requeue
    assert all(_values(r)["train.max_restarts"] == "0" for name, r in rungs.items() if name != "resume")
    resume = _values(rungs["resume"])
    assert resume["train.max_restarts"] == "1" and resume["train.steps"] == "6"
    assert resume["train.faults"] == "[{at_step: 3, mode: requeue, attempt: 1}]"
    # the full rung's config but for the stop: its run is the reference
    assert {k: v for k, v in resume.items() if k not in ("train.max_restarts", "train.faults", "train.fail_at_step")} \
        == {k: v for k, v in _values(rungs["full"]).items() if k != "train.max_restarts"}


def test_each_rung_composes_to_a_config_launch_accepts():
    prep = prepare(SLURM_3D, steps=6)
    assert set(prep.points) == set(ladder.RUNGS)
    for point in prep.points.values():
        check([point])  # raises if refused
    cfg = prep.points["node"].cfg
    assert (int(cfg.cluster.nodes), int(cfg.parallelism.tp), int(cfg.parallelism.pp)) == (1, 2, 1)
    assert str(prep.points["comm"].cfg.recipe._target_) == "recipes.commbench.bench.main"


def test_from_a_rung_skips_the_rungs_below_it_and_an_unknown_rung_is_refused():
    prep = prepare(SLURM_3D, steps=6, start="full")
    assert set(prep.points) == {"full", "tuned", "resume"}
    skipped = {r.name: r.skip for r in prep.rungs if r.skip}
    assert set(skipped) == {"smoke", "node", "comm"} and all("--from full" in why for why in skipped.values())
    with pytest.raises(InvalidLadder, match="--from fulll: no such rung"):
        prepare(SLURM_3D, steps=6, start="fulll")


def test_one_node_skips_the_comm_rung_and_one_process_per_node_the_node_rung():
    rungs = _ladder([*BASE, "cluster=local", "cluster.gpus_per_node=2", "parallelism=tp"])
    assert "cluster.nodes=1" in rungs["comm"].skip
    assert rungs["node"].skip is None
    rungs = _ladder([*BASE, "cluster=local_slurm", "cluster.nodes=2", "cluster.gpus_per_node=1"])
    assert rungs["node"].skip and rungs["comm"].skip is None


def test_a_model_too_large_for_one_gpu_is_cut_to_the_layers_that_fit():
    big = ["model=gpt_1b3", "precision=bf16", "cluster=a100_80g", "cluster.nodes=2", "cluster.gpu.memory_gb=8",
           "parallelism=tp", "parallelism.tp=8", "train.global_batch_size=64", "train.micro_batch_size=8",
           "train.recompute=full"]
    cfg = compose_point(big).cfg
    rungs = _ladder(big)
    layers = int(_values(rungs["smoke"])["model.num_layers"])
    assert 1 <= layers < int(cfg.model.num_layers)
    assert f"of {int(cfg.model.num_layers)}" in rungs["smoke"].notes[0]
    # the cut is the planner's: one more layer would not fit the 8 GiB GPU in fp32
    assert ladder._fits(cfg, layers, tp=1, pp=1, dp=1, zero=0, dtype="fp32", recompute="none", procs_per_node=1, mbs=1)
    assert not ladder._fits(cfg, layers + 1, tp=1, pp=1, dp=1, zero=0, dtype="fp32", recompute="none",
                           procs_per_node=1, mbs=1)
    # independently of the planner (first principles, GPT-2 shapes): fp32 weights + grads + Adam's two
    # moments are 16 B a parameter; the kept layers' states fit the 8 GiB x 0.9 usable, all 24 do not,
    # and the activations the cut leaves room for (Korthikanti: 34sbh + 5as^2b per layer in 16-bit
    # bytes, b=1) are at least those of one layer, so no layer more than the states allow was kept
    h, ffn, v, s_, a = 2048, 8192, 50304, 2048, 16
    per_layer = 4 * h * h + 2 * h * ffn + 9 * h + ffn  # qkv + proj, mlp, their biases, two norms
    states = lambda n: 16 * (v * h + s_ * h + 2 * h + n * per_layer)  # noqa: E731 (tied embeddings, final norm)
    usable = int(8 * 2**30 * 0.9)
    act_one_layer = 34 * s_ * h + 5 * a * s_ * s_
    assert states(layers) + act_one_layer <= usable < states(int(cfg.model.num_layers))
    assert states(layers + 1) + (layers + 1) * act_one_layer > usable  # one more layer and its activations: no
    # the full layout does not fit in fp32 without recomputation: it keeps the config's own
    full = rungs["full"]
    assert "precision.dtype=fp32" not in full.overrides and "kept precision.dtype=bf16" in full.notes[0]


def test_a_mixed_precision_config_keeps_its_own_settings_in_the_tuned_rung():
    rungs = _ladder([*SLURM_3D, "precision=fp16", "train.recompute=full"])
    tuned = _values(rungs["tuned"])
    assert (tuned["precision.dtype"], tuned["train.recompute"]) == ("fp16", "full")
    assert not rungs["tuned"].notes
    full = _values(rungs["full"])
    assert (full["precision.dtype"], full["train.recompute"]) == ("fp32", "none")


def test_an_injected_fault_after_a_rungs_last_step_is_dropped_there():
    rungs = _ladder([*SLURM_3D, "train.fail_at_step=5"], steps=6)
    assert _values(rungs["smoke"])["train.fail_at_step"] == "null"
    assert _values(rungs["node"])["train.fail_at_step"] == "null"
    assert "train.fail_at_step" not in _values(rungs["full"])  # it fires there
    prepare([*SLURM_3D, "train.fail_at_step=5"], steps=6)  # every rung valid (fail_at_step <= train.steps)


@pytest.mark.parametrize("bad,key", [
    (["parallelism.tp=3"], "parallelism.tp"),
    (["train.micro_batch_size=5"], "train"),
])
def test_a_refused_config_names_the_key_and_submits_nothing(bad, key, tmp_path):
    with pytest.raises(InvalidLadder) as e:
        prepare([*SLURM_3D, f"submit.runs_root={tmp_path}", *bad], steps=6)
    assert key in str(e.value)
    assert not any(tmp_path.iterdir())


def test_an_unknown_key_is_refused_before_composing_the_rungs():
    with pytest.raises(InvalidLadder, match="cannot compose"):
        prepare([*SLURM_3D, "train.stepz=3"], steps=6)


# ---- verdicts ------------------------------------------------------------------------------------

PLAN = {"model": {"tokens_per_step": 1000}, "cluster": {"usable_bytes": 10 * 2**30},
        "layouts": [{"step_time_s": 0.1, "memory_bytes": {"total": 2 * 2**30}}]}
DONE = {"status": "completed"}


def _rows(n=6, **kw):
    return [{"step": i + 1, "loss": 5.0 - 0.1 * i, "grad_norm": 1.0, "tokens_per_s": 8000.0, **kw} for i in range(n)]


def test_a_completed_finite_run_is_a_go_and_shows_measured_beside_planned():
    v = ladder.judge_training(DONE, _rows(), PLAN, calibrated=False)
    assert v.verdict == ladder.GO and v.passed
    assert v.measured["tokens_per_s"] == 8000.0 and v.planned["tokens_per_s"] == pytest.approx(10000.0)
    assert v.planned["memory_bytes"] == 2 * 2**30


@pytest.mark.parametrize("status", ["failed", "cancelled", "timeout"])
def test_a_run_that_did_not_complete_is_a_no_go(status):
    assert ladder.judge_training({"status": status}, _rows(2), PLAN, False).verdict == ladder.NO_GO


def test_a_live_run_is_running():
    assert ladder.judge_training({"status": "running"}, _rows(2), PLAN, False).verdict == ladder.RUNNING


def test_a_non_finite_loss_is_a_no_go_from_its_step():
    rows = _rows()
    rows[3]["loss"] = math.nan
    v = ladder.judge_training(DONE, rows, PLAN, False)
    assert v.verdict == ladder.NO_GO and "step 4" in v.reasons[0] and "optim.lr" in v.fix


def test_most_steps_overflowing_is_a_no_go_naming_the_loss_scale():
    rows = _rows(grad_norm=math.inf)
    v = ladder.judge_training(DONE, rows, PLAN, False)
    assert v.verdict == ladder.NO_GO and "6 of 6" in v.reasons[0] and "precision.loss_scale=0" in v.fix
    rows = _rows()
    rows[0]["grad_norm"] = math.inf  # fp16's first steps may overflow while the scale settles: fine
    assert ladder.judge_training(DONE, rows, PLAN, False).verdict == ladder.GO


def test_memory_above_usable_is_a_no_go_and_above_plan_a_warning():
    v = ladder.judge_training(DONE, _rows(peak_memory_bytes=11 * 2**30), PLAN, False)
    assert v.verdict == ladder.NO_GO and "usable" in v.reasons[0]
    v = ladder.judge_training(DONE, _rows(peak_memory_bytes=3 * 2**30), PLAN, False)
    assert v.verdict == ladder.WARN and v.passed and "1.50x" in v.reasons[0]


def test_throughput_is_judged_only_against_a_calibrated_plan():
    slow = _rows(tokens_per_s=1000.0)
    assert ladder.judge_training(DONE, slow, PLAN, calibrated=False).verdict == ladder.GO
    v = ladder.judge_training(DONE, slow, PLAN, calibrated=True)
    assert v.verdict == ladder.WARN and "10%" in v.reasons[0]


def _bench(busbw, scope="inter"):
    return {"rows": [{"op": "all_reduce", "scope": scope, "busbw_gbs": b} for b in busbw]}


def test_comm_rung_compares_the_inter_node_bus_bandwidth_with_the_cluster_config():
    v = ladder.judge_comm(DONE, _bench([0.5, 2.0]), inter_gbps=100.0)
    assert v.verdict == ladder.NO_GO and v.measured["busbw_gbs"] == 2.0
    assert "cluster.inter_node_bandwidth=100" in v.reasons[0] and "cluster.inter_node_bandwidth=2" in v.fix
    assert ladder.judge_comm(DONE, _bench([60.0]), inter_gbps=100.0).verdict == ladder.GO
    assert ladder.judge_comm(DONE, _bench([0.1]), inter_gbps=0.0).verdict == ladder.GO  # unknown: nothing to hold to
    v = ladder.judge_comm(DONE, _bench([5.0], scope="intra"), inter_gbps=0.0)
    assert v.verdict == ladder.NO_GO and "no all-reduce between nodes" in v.reasons[0]
    assert ladder.judge_comm({"status": "failed"}, None, 10.0).verdict == ladder.NO_GO


def test_an_injected_fault_on_a_rank_a_rung_lacks_is_dropped_there():
    rungs = _ladder([*SLURM_3D, "train.fail_at_step=2", "train.fail_rank=1"])
    assert _values(rungs["smoke"])["train.fail_at_step"] == "null"  # one process: no rank 1
    assert "train.fail_at_step" not in _values(rungs["node"])  # two processes: rank 1 fails there
    prepare([*SLURM_3D, "train.fail_at_step=2", "train.fail_rank=3"], steps=6)


def test_the_resume_rung_is_judged_by_the_comparison_with_the_full_rungs_run():
    from launcher.features.verify_resume.verdict import Diff, decide
    from launcher.run.status import RunStatus, Status

    done = RunStatus(state=Status.completed)
    same = decide([], [], [3], 6, "metrics rows and 4 checkpoint files")
    assert ladder.judge_resume(done, done, same).verdict == ladder.GO
    lost = decide([], [Diff(4, "state.pt", "optimizer.state.0.exp_avg", "optimizer", 0.1, 0.1)], [3], 6, "x")
    v = ladder.judge_resume(done, done, lost)
    assert v.verdict == ladder.NO_GO and "diverges at step 4" in v.reasons[0] and "optimizer" in v.fix
    assert ladder.judge_resume(done, RunStatus(state=Status.failed), None).verdict == ladder.NOT_RUN
    assert ladder.judge_resume(RunStatus(state=Status.running), done, None).verdict == ladder.RUNNING


def test_the_resume_rungs_comparison_is_kept_in_the_record_and_read_back_without_torch(tmp_path, monkeypatch):
    from launcher.features.preflight import climb
    from launcher.features.verify_resume.verdict import Verdict as Compared
    from launcher.run.status import RunStatus, Status

    made = []
    bitwise = Compared("bitwise", [3], 6, "metrics rows and 4 checkpoint files")
    monkeypatch.setattr(climb, "entry_status", lambda e: RunStatus(state=Status.completed))
    monkeypatch.setattr(climb, "_compared", lambda full, resumed, steps: made.append((full, resumed)) or bitwise)
    for name in ("full", "resume"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.yaml").write_text("train:\n  steps: 6\n")
    record = {"rungs": [{"name": "full", "run_dir": str(tmp_path / "full")},
                        {"name": "resume", "run_dir": str(tmp_path / "resume")}]}
    entry = record["rungs"][1]
    first = climb.judge_entry(entry, RunStatus(state=Status.completed), record)
    assert first.verdict == ladder.GO and len(made) == 1
    assert entry["compared"] == {"full": str(tmp_path / "full"), "verdict": bitwise.to_json()}
    again = climb.judge_entry(entry, RunStatus(state=Status.completed), record)  # (--show: the record's)
    assert again.verdict == ladder.GO and again.reasons == first.reasons and len(made) == 1
    record["rungs"][0]["run_dir"] = str(tmp_path / "other")  # another full run: compared again
    climb.judge_entry(entry, RunStatus(state=Status.completed), record)
    assert len(made) == 2
