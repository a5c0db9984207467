"""The verdict of `launcher verify-resume` from the differences found (pure: launcher.features.
verify_resume.verdict). The runs themselves: tests/integration/test_verify_resume.py."""
import json
import math

import pytest

from launcher.features.verify_resume.verdict import Diff, component_of, decide, row_diffs

ROWS = [{"step": s, "loss": 1.0 / s, "lr": 0.1, "step_time_s": 0.01 * s, "tokens_per_s": 100.0 * s}
        for s in range(1, 9)]
TENSORS = "metrics rows and 24 checkpoint files"


def test_machine_measures_are_never_compared_and_equal_rows_are_bitwise():
    other = [dict(r, step_time_s=9.9, tokens_per_s=1.0, host_rss_bytes=5) for r in ROWS]
    assert row_diffs(ROWS, other) == []
    v = decide([], [], [4], 8, TENSORS)
    assert v.kind == "bitwise" and v.line().startswith("bitwise: resumed after step 4, every step to 8 equal")


def test_a_missing_step_and_a_changed_loss_are_differences():
    other = [dict(r) for r in ROWS if r["step"] != 6]
    other[4]["loss"] += 1e-7  # step 5
    diffs = row_diffs(ROWS, other)
    assert [(d.step, d.key, d.component) for d in diffs] == [(5, "loss", "forward"), (6, "(the row)", "metric")]
    assert math.isinf(diffs[1].max_abs)


def test_components_from_the_names_checkpoints_use():
    assert component_of("rng_rank_00000.pt", "torch") == "rng"
    assert component_of("state_rank_00001.pt", "sampler.pos") == "data"
    assert component_of("state.pt", "optimizer.state.3.exp_avg") == "optimizer"
    assert component_of("state.pt", "optimizer.param_groups[0].lr") == "scheduler"
    assert component_of("state.pt", "scheduler.last_epoch") == "scheduler"
    assert component_of("zero_pp_rank_0_mp_rank_00_optim_states.pt", "optimizer_state_dict.state.0.exp_avg_sq") \
        == "optimizer"
    assert component_of("model.pt", "model.layers.0.weight") == "weights"
    assert component_of("state.pt", "scaler.scale") == "scaler"


def _d(step, key, comp, where="state.pt", big=0.5):
    return Diff(step, where, key, comp, big, big)


def test_the_first_step_after_the_stop_is_named_by_what_it_restored_first():
    # the optimizer differs with the weights at step 5 (a fresh optimizer after a stop at 4): the optimizer
    v = decide([], [_d(5, "model.0.weight", "weights"), _d(5, "optimizer.state.0.exp_avg", "optimizer"),
                    _d(6, "model.0.weight", "weights")], [4], 8, TENSORS)
    assert (v.kind, v.first_step, v.component) == ("diverges", 5, "optimizer")
    assert v.line().startswith("diverges at step 5: optimizer state differs: optimizer.state.0.exp_avg in state.pt")
    assert "every checkpoint tensor equal at step 4" in v.line() and "optimizer in the checkpoint" in v.cause
    # an RNG state differing outranks what the step then computed
    v = decide([_d(5, "loss", "forward", "metrics")], [_d(5, "torch", "rng", "rng_rank_00000.pt"),
                                                       _d(5, "model.0.weight", "weights")], [4], 8, TENSORS)
    assert v.component == "rng" and "RNG not restored" in v.cause
    # the loss of the step after the stop, with the state at the stop equal: its inputs
    v = decide([_d(5, "loss", "forward", "metrics")], [_d(5, "model.0.weight", "weights")], [4], 8, TENSORS)
    assert v.component == "forward" and "data loader that starts over" in v.cause
    # the learning rate: the scheduler, even where the update it made differs too
    v = decide([_d(5, "lr", "scheduler", "metrics")], [_d(5, "model.0.weight", "weights")], [4], 8, TENSORS)
    assert v.component == "scheduler"
    # a reported number alone: state outside the checkpoint
    v = decide([_d(5, "loss_ema", "metric", "metrics")], [], [4], 8, TENSORS)
    assert v.component == "metric" and "module global" in v.cause


def test_weights_alone_with_no_optimizer_state_saved_name_the_optimizer():
    diffs = [_d(5, "model.0.weight", "weights")]
    assert decide([], diffs, [4], 8, TENSORS, held=["weights", "rng"]).component == "optimizer"
    assert "hold no optimizer state" in decide([], diffs, [4], 8, TENSORS, held=["weights", "rng"]).detail
    assert decide([], diffs, [4], 8, TENSORS, held=["weights", "optimizer", "rng"]).component == "weights"


def test_a_difference_before_the_stop_is_not_a_resume_but_unseeded_streams_are_left_out():
    v = decide([_d(2, "loss", "forward", "metrics")], [], [4], 8, TENSORS)
    assert v.component == "before" and v.first_step == 2 and "not deterministic" in v.cause
    # NumPy's stream, never seeded, differs from step 1 in every checkpoint while the metrics agree
    numpy = [_d(s, "numpy[1]", "rng", "rng_rank_00000.pt") for s in range(1, 9)]
    v = decide([], numpy, [4], 8, TENSORS)
    assert v.kind == "bitwise" and "numpy[1] in rng_rank_00000.pt" in v.notes[0]


def test_a_tolerance_takes_small_differences_as_equal_and_names_the_largest():
    small = [_d(5, "loss", "forward", "metrics", 1e-9), _d(6, "model.0.weight", "weights", big=3e-9)]
    v = decide(small[:1], small[1:], [4], 8, TENSORS, tolerance=1e-6)
    assert v.kind == "tolerance" and v.largest["key"] == "model.0.weight" and v.largest["step"] == 6
    assert decide(small[:1], small[1:], [4], 8, TENSORS).kind == "diverges"


def test_a_hydra_apps_run_is_refused_naming_what_verify_resume_runs(tmp_path):
    from launcher.config.errors import ConfigErrors
    from launcher.features.verify_resume.run import _points

    run = tmp_path / "S" / "0"
    run.mkdir(parents=True)
    (run / "run.json").write_text(json.dumps({"run_id": "S-0", "sweep_id": "S", "kind": "hydra_app"}))
    with pytest.raises(ConfigErrors, match="a Hydra app's run: verify-resume runs launch's recipes and scripts"):
        _points([], run, 6, [3], tmp_path)


def test_a_script_compared_by_its_rows_alone_never_claims_equal_tensors():
    v = decide([_d(5, "loss", "forward", "metrics")], [], [4], 8,
               "metrics rows only: the program keeps its own checkpoints, whose tensors the launcher cannot read")
    assert v.equal_before == "the metrics equal to step 4" and "tensor" not in v.line(), v.line()
