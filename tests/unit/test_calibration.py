"""The planner's calibration: the fit (recipes/gpt/plan/calibrate.py), the constants in the schema and
every estimate (cluster.calibration), the cluster file's block, `launcher plan --calibrate` on
synthetic run dirs (real layouts, made-up measurements), the report's before/after table, and the
activation meter of the GPT recipe (recipes/common/activations.py)."""
from __future__ import annotations

import dataclasses
import json
import os
import random
from functools import cache
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from launcher.app import CONF_DIR
from launcher.config.layout import Facts
from launcher.config.rules import layout_of
from launcher.run.rundir import RunDir
from recipes.gpt.plan import calibrate
from recipes.gpt.plan.calibrate import CalibrationError, Sample
from recipes.gpt.plan.estimate import estimate
from recipes.gpt.plan.search import search
from recipes.gpt.plan.spec import Calibration, ClusterSpec, LayoutSpec
from recipes.gpt.plan.timing import StepParts
from recipes.gpt.schema import ModelSpec

REPO = Path(__file__).resolve().parents[2]


@cache
def cfg_with(*overrides):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def sample(i, compute, comm, other=0.0, measured=1.0, planned_act=100, measured_act=None, **kw):
    base = dict(run_id=f"r{i}", run_dir=f"/x/r{i}", layout="dp1", parts=StepParts(compute, comm, other),
                measured_step_s=measured, steps_measured=5, planned_activation_bytes=planned_act,
                measured_activation_bytes=measured_act, cluster_name="local", cluster_choice="local")
    base.update(kw)
    return Sample(**base)


# ---- the fit -------------------------------------------------------------------------------------------


def test_the_fit_recovers_known_constants_from_synthetic_measurements():
    rng = random.Random(3)
    true = Calibration(compute_scale=850.0, comm_scale=37.5, step_overhead_s=0.0125, activation_scale=0.8)
    samples = []
    for i in range(6):
        parts = StepParts(rng.uniform(1e-4, 1e-3), rng.uniform(0, 5e-4) if i else 0.0, rng.uniform(0, 1e-3))
        planned = rng.randint(10**5, 10**7)
        samples.append(sample(i, *dataclasses.astuple(parts), measured=parts.step_time(true),
                              planned_act=planned, measured_act=int(planned * 0.8)))
    fit = calibrate.fit(samples)
    for k, v in true.as_dict().items():
        assert getattr(fit.calibration, k) == pytest.approx(v, rel=1e-6), k
    assert fit.fitted == ("compute_scale", "comm_scale", "step_overhead_s", "activation_scale") and not fit.notes
    after = calibrate.rows(samples, fit.calibration)
    assert all(abs(r["step_time_s"]["error_after"]) < 1e-9 for r in after)
    assert all(abs(r["step_time_s"]["error_before"]) > 0.5 for r in after)


def test_the_fit_is_least_squares_under_noise_and_never_negative():
    rng = random.Random(5)
    true = Calibration(compute_scale=100.0, comm_scale=10.0, step_overhead_s=0.01)
    samples = [sample(i, c, m, measured=StepParts(c, m, 0).step_time(true) * rng.uniform(0.97, 1.03))
               for i, (c, m) in enumerate([(1e-3, 1e-4), (2e-3, 5e-4), (4e-3, 1e-4), (1e-3, 2e-3), (3e-3, 3e-3)])]
    fit = calibrate.fit(samples).calibration
    assert fit.compute_scale == pytest.approx(100, rel=0.1) and fit.comm_scale == pytest.approx(10, rel=0.3)
    # communication that makes nothing slower: its constant is 0, not negative
    flat = [sample(i, c, m, measured=200 * c) for i, (c, m) in enumerate([(1e-3, 1e-3), (2e-3, 0), (3e-3, 5e-3)])]
    got = calibrate.fit(flat).calibration
    assert got.comm_scale == 0 and got.step_overhead_s == pytest.approx(0, abs=1e-12)
    assert got.compute_scale == pytest.approx(200)


def test_nnls_against_brute_force():
    rng = random.Random(11)
    for _ in range(50):
        cols = [[rng.uniform(-1, 1) for _ in range(6)] for _ in range(3)]
        y = [rng.uniform(-1, 1) for _ in range(6)]
        x = calibrate.nnls(cols, y)
        assert all(v >= 0 for v in x)
        res = sum((yi - sum(x[j] * cols[j][i] for j in range(3))) ** 2 for i, yi in enumerate(y))
        grid = [a / 10 for a in range(0, 31)]
        best = min(sum((yi - a * cols[0][i] - b * cols[1][i] - c * cols[2][i]) ** 2 for i, yi in enumerate(y))
                   for a in grid for b in grid for c in grid)
        assert res <= best + 1e-12


def test_fewer_runs_than_constants_keeps_the_rest_neutral_and_says_why():
    one = calibrate.fit([sample(0, 1e-3, 1e-4, measured=0.5)])
    assert one.fitted == ("compute_scale",)
    assert one.calibration.comm_scale == 1 and one.calibration.step_overhead_s == 0
    assert one.calibration.compute_scale == pytest.approx((0.5 - 1e-4) / 1e-3)
    assert len(one.notes) == 3 and "1 run(s) determine at most 1" in one.notes[0]
    assert "activation_scale kept at 1: no run recorded activation_bytes" in one.notes[-1]
    two = calibrate.fit([sample(0, 1e-3, 1e-4, measured=0.5), sample(1, 2e-3, 3e-4, measured=1.1)])
    assert two.fitted == ("compute_scale", "comm_scale")
    assert any(n.startswith("step_overhead_s kept at 0: 2 run(s)") for n in two.notes)


def test_runs_without_communication_fit_compute_and_overhead():
    fit = calibrate.fit([sample(0, 1e-3, 0.0, measured=0.3), sample(1, 3e-3, 0.0, measured=0.7)])
    assert fit.fitted == ("compute_scale", "step_overhead_s")
    assert fit.calibration.compute_scale == pytest.approx(200) and fit.calibration.step_overhead_s == pytest.approx(0.1)
    assert "comm_scale kept at 1: no run has predicted communication time" in fit.notes


def test_an_overhead_that_would_leave_no_compute_time_is_dropped():
    # step times that do not grow with the predicted compute: a constant would explain them all
    runs = [sample(i, c, 0.0, measured=y) for i, (c, y) in enumerate([(1e-3, 0.030), (2e-3, 0.020), (3e-3, 0.025)])]
    fit = calibrate.fit(runs)
    assert fit.fitted == ("compute_scale",) and fit.calibration.step_overhead_s == 0
    assert fit.calibration.compute_scale > 0
    assert any(n.startswith("step_overhead_s kept at 0: with it the fit left no compute time") for n in fit.notes)


def test_the_fit_weighs_every_run_by_its_own_time():
    # a slow run 10% off the others' rate must not outweigh them (plain least squares on seconds would
    # fit it exactly and leave both fast runs 10% off)
    runs = [sample(0, 1e-3, 0.0, measured=0.1), sample(1, 2e-3, 0.0, measured=0.2), sample(2, 1.0, 0.0, measured=110.0)]
    fit = calibrate.fit(runs)
    errors = [r["step_time_s"]["error_after"] for r in calibrate.rows(runs, fit.calibration)]
    assert max(abs(e) for e in errors) < 0.07 and abs(errors[0]) < 0.05 and abs(errors[1]) < 0.05


def test_proportional_columns_are_not_told_apart():
    fit = calibrate.fit([sample(i, c, c / 10, measured=150 * c) for i, c in enumerate([1e-3, 2e-3, 5e-3])])
    assert "comm_scale" not in fit.fitted
    assert any("proportional to that of compute_scale" in n for n in fit.notes)


def test_activation_scale_minimises_the_relative_error():
    pairs = [(100, 80), (200, 190), (50, 30)]
    s = calibrate.fit_activation_scale(pairs)
    def cost(x):
        return sum(((x * p - m) / m) ** 2 for p, m in pairs)
    assert cost(s) <= min(cost(s * (1 + d)) for d in (-1e-3, 1e-3))
    assert calibrate.fit_activation_scale([]) is None


def test_measured_step_time_is_the_median_after_two_warmup_steps():
    rows = [{"step_time_s": t} for t in (9.0, 5.0, 1.0, 3.0, 2.0, 100.0)]
    assert calibrate.measured_step_time(rows) == (2.5, 4)
    assert calibrate.measured_step_time(rows[:2]) == (None, 0)


def test_runs_of_different_clusters_are_refused_naming_the_key():
    a, b = sample(0, 1, 1), sample(1, 1, 1, cluster_name="a100_80g")
    with pytest.raises(CalibrationError, match=r"^cluster\.name: the runs are of different clusters"):
        calibrate.check_one_cluster([a, b])
    c = sample(1, 1, 1, hardware=(("gpu.peak_tflops", 312.0),))
    with pytest.raises(CalibrationError, match=r"^cluster\.gpu\.peak_tflops"):
        calibrate.check_one_cluster([sample(0, 1, 1, hardware=(("gpu.peak_tflops", 0.0),)), c])


# ---- the constants in the schema and in every estimate ---------------------------------------------------

GPT_1B3 = ModelSpec(name="gpt_1b3", num_layers=24, hidden_size=2048, num_heads=16, ffn_hidden_size=8192,
                    vocab_size=50304, seq_len=2048)
A100x32 = ClusterSpec("a100_80g", 4, 8, memory_bytes=80 << 30, peak_flops=312e12, intra_bw=300e9, inter_bw=25e9)
LAYOUTS = [
    LayoutSpec(dp=32, micro_batch_size=2, grad_accum=4, zero=0, engine="ddp"),
    LayoutSpec(dp=32, micro_batch_size=2, grad_accum=4, zero=3, engine="deepspeed", dtype="bf16"),
    LayoutSpec(dp=8, tp=2, pp=2, micro_batch_size=1, grad_accum=32, engine="megatron", dtype="bf16", zero=1),
    LayoutSpec(dp=4, tp=8, micro_batch_size=1, grad_accum=64, engine="megatron", dtype="bf16",
               sequence_parallel=True, recompute="selective"),
    LayoutSpec(dp=32, micro_batch_size=1, grad_accum=8, zero=2, engine="deepspeed", dtype="bf16",
               offload_optimizer=True),
]
def test_the_default_calibration_changes_no_estimate():
    """The oracle is the uncalibrated model itself: the step time is the plain sum of its parts (no
    scale, no overhead), memory is what the timing constants leave alone, and the activations are
    those a calibration scaling them by 2 doubles (so the default scales them by exactly 1)."""
    timing_only = Calibration(compute_scale=1.7, comm_scale=3.0, step_overhead_s=0.25)
    doubled = Calibration(activation_scale=2.0)
    for lay in LAYOUTS:
        e = estimate(GPT_1B3, A100x32, lay)
        p = e.timing.parts
        assert e.timing.step_time_s == pytest.approx(p.compute_s + p.comm_s + p.other_s, rel=1e-12), lay
        t = estimate(GPT_1B3, dataclasses.replace(A100x32, calibration=timing_only), lay)
        assert (t.memory.total, t.memory.activations) == (e.memory.total, e.memory.activations)
        d = estimate(GPT_1B3, dataclasses.replace(A100x32, calibration=doubled), lay)
        assert d.memory.activations == pytest.approx(2 * e.memory.activations, abs=2)
        assert d.memory.total - d.memory.activations == e.memory.total - e.memory.activations
        assert d.timing.step_time_s == e.timing.step_time_s
        assert e.memory.activations > 0 and e.timing.step_time_s > 0
    cl = ClusterSpec.from_cfg(cfg_with("cluster=a100_80g").cluster)
    assert cl.calibration == Calibration() and cl.calibration.is_default
    assert A100x32.calibration == Calibration()
    assert "calibration" not in json.dumps(calibrate_free_json())


def calibrate_free_json():
    from recipes.gpt.plan.estimate import cluster_json

    return cluster_json(A100x32)


def test_a_calibration_scales_every_estimate_as_declared():
    cal = Calibration(compute_scale=1.7, comm_scale=3.0, step_overhead_s=0.25, activation_scale=1.5)
    cl = dataclasses.replace(A100x32, calibration=cal)
    for lay in LAYOUTS:
        e0, e1 = estimate(GPT_1B3, A100x32, lay), estimate(GPT_1B3, cl, lay)
        p = e0.timing.parts
        assert e0.timing.step_time_s == pytest.approx(p.step_time(Calibration()), rel=1e-12)
        want = 1.7 * p.compute_s + 3.0 * p.comm_s + p.other_s + 0.25
        assert e1.timing.step_time_s == pytest.approx(want, rel=1e-12)
        assert e1.timing.parts == p  # the parts stay uncalibrated
        assert e1.memory.activations == pytest.approx(1.5 * e0.memory.activations, abs=2)
        assert e1.memory.total - e1.memory.activations == e0.memory.total - e0.memory.activations
        assert e1.timing.compute_s == pytest.approx(1.7 * e0.timing.compute_s)
    # the search ranks with it too
    ranked = search(GPT_1B3, cl, 256, "bf16", top=3)
    assert all(r.timing.step_time_s >= 0.25 for r in ranked)


def test_the_constants_come_from_the_cluster_config():
    cfg = cfg_with("cluster=a100_80g", "train.global_batch_size=64", "cluster.calibration.compute_scale=2.5",
                   "cluster.calibration.comm_scale=0.5",
                   "cluster.calibration.step_overhead_s=0.1", "cluster.calibration.activation_scale=0.9")
    cl = ClusterSpec.from_cfg(cfg.cluster)
    assert cl.calibration == Calibration(2.5, 0.5, 0.1, 0.9)
    from recipes.gpt.plan import checks

    plan = checks.evaluate(cfg).plan
    assert plan["cluster"]["calibration"] == {"compute_scale": 2.5, "comm_scale": 0.5, "step_overhead_s": 0.1,
                                              "activation_scale": 0.9}
    # a config archived before the key existed (no cluster.calibration at all) reads as the defaults
    old = OmegaConf.create({k: v for k, v in OmegaConf.to_container(cfg_with().cluster).items() if k != "calibration"})
    assert ClusterSpec.from_cfg(old).calibration == Calibration()


@pytest.mark.parametrize("key,value", [("compute_scale", 0), ("comm_scale", -1), ("step_overhead_s", -0.5),
                                       ("activation_scale", 0)])
def test_out_of_bounds_constants_are_refused_naming_the_key(key, value):
    from launcher.config.rules import problems

    errors = problems(cfg_with(f"cluster.calibration.{key}={value}"))
    assert [e.key for e in errors] == [f"cluster.calibration.{key}"]


# ---- the cluster file's block ---------------------------------------------------------------------------

CAL = Calibration(compute_scale=1234.56789, comm_scale=0.0, step_overhead_s=1.5e-05, activation_scale=0.97)
BLOCK = calibrate.calibration_block(CAL, ["run-a", "run-b"], "2026-01-01T00:00:00+00:00")


def test_the_block_is_yaml_of_the_constants():
    doc = yaml.safe_load(BLOCK)["calibration"]
    assert doc == {"compute_scale": 1234.57, "comm_scale": 0.0, "step_overhead_s": 0.000015, "activation_scale": 0.97,
                   "runs": ["run-a", "run-b"], "fitted_at": "2026-01-01T00:00:00+00:00"}


def test_an_existing_block_is_replaced_and_every_other_byte_kept():
    head = "# my cluster\nname: x   # trailing comment\ngpu:\n  memory_gb: 80\n\n"
    old_block = ("calibration:\n  compute_scale: 2.0\n# a column-0 comment inside the block\n\n"
                 "  comm_scale: 3.0   # note\n  runs:\n    - a\n")
    tail = "\n# about the next key\nenv:\n  A: \"1\"\nsetup: []\n"
    text = head + old_block + tail
    new = calibrate.replace_block(text, BLOCK)
    assert new == head + BLOCK + tail
    assert calibrate.replace_block(new, BLOCK) == new  # idempotent
    flow = "name: x\ncalibration: {compute_scale: 2.0}\nnodes: 1"
    assert calibrate.replace_block(flow, BLOCK) == "name: x\n" + BLOCK + "nodes: 1"


def test_a_file_without_a_block_gets_it_appended():
    assert calibrate.replace_block("name: x\nnodes: 1", BLOCK) == "name: x\nnodes: 1\n" + BLOCK
    local = (REPO / "conf" / "cluster" / "local.yaml").read_text()
    new = calibrate.updated_cluster_file(local, CAL, ["r"], "t")
    assert new.startswith(local) and yaml.safe_load(new)["calibration"]["compute_scale"] == 1234.57


def test_a_file_the_edit_would_break_is_refused():
    with pytest.raises(CalibrationError, match="2 top-level `calibration:` keys"):
        calibrate.replace_block("calibration: {}\ncalibration: {}\n", BLOCK)
    with pytest.raises(CalibrationError, match="not YAML"):
        calibrate.updated_cluster_file("name: [x\n", CAL, ["r"], "t")


# ---- `launcher plan --calibrate` on run dirs ---------------------------------------------------------------

TRUE = Calibration(compute_scale=3000.0, comm_scale=40.0, step_overhead_s=0.02, activation_scale=0.9)
BASE = ["model=gpt_tiny", "precision=fp32", "train.global_batch_size=16", "train.micro_batch_size=2", "cluster=local"]
RUNS = {"single": ["cluster.gpus_per_node=1"], "dp2": ["cluster.gpus_per_node=2"],
        "tp2": ["cluster.gpus_per_node=2", "parallelism=tp"], "pp2": ["cluster.gpus_per_node=2", "parallelism=pp"]}


def make_run(root: Path, name: str, overrides, steps=6, truth=TRUE, acts=True, step_times=None) -> Path:
    """A run dir as a launch and its job leave it, with measurements made from ``truth``."""
    cfg = cfg_with(*BASE, *overrides)
    rd = RunDir(root / name / "0")
    rd.path.mkdir(parents=True)
    rd.write_config(yaml.safe_load(OmegaConf.to_yaml(cfg, resolve=True)))
    rd.write_overrides(list(overrides), {"cluster": "local", "model": "gpt_tiny"})
    lay = layout_of(Facts.from_cfg(cfg))
    _, parts, planned_act = calibrate.planned(cfg)
    t = parts.step_time(truth)
    if step_times is None:
        step_times = [5 * t, 2 * t] + [t * f for f in (0.99, 1.0, 1.01, 1.0)][:steps - 2]
    times = step_times
    rd.rewrite_metrics([{"step": i + 1, "loss": 1.0, "step_time_s": x} for i, x in enumerate(times)])
    for r in range(lay.world_size):
        rd.write_state(r, {"rank": r, "params": 1, "grads": 1, "optimizer": 1,
                           **({"activation_bytes": int(planned_act * truth.activation_scale) - r} if acts else {})})
    rd.write_run({"run_id": f"{name}-0", "sweep_id": name, "layout": lay.to_json()})
    return rd.path


def plan_main(capsys, *argv):
    from launcher.cli.main import main

    code = main(["plan", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture
def cluster_file(tmp_path):
    p = tmp_path / "local.yaml"
    p.write_text((REPO / "conf" / "cluster" / "local.yaml").read_text())
    return p


def test_calibrate_fits_the_runs_and_writes_the_cluster_file(tmp_path, capsys, cluster_file):
    runs = [make_run(tmp_path / "runs", n, o) for n, o in RUNS.items()]
    before = cluster_file.read_text()
    code, out, err = plan_main(capsys, "--calibrate", *map(str, runs), "--cluster-file", str(cluster_file), "--json")
    assert code == 0, err
    rep = json.loads(out)
    assert rep["written"] and rep["cluster"] == "local" and len(rep["runs"]) == 4
    for k, v in TRUE.as_dict().items():
        assert rep["calibration"][k] == pytest.approx(v, rel=1e-3), k
    for r in rep["runs"]:
        assert abs(r["step_time_s"]["error_after"]) < 0.01 < abs(r["step_time_s"]["error_before"])
        assert abs(r["activation_bytes"]["error_after"]) < 0.01
    text = cluster_file.read_text()
    assert text.startswith(before)
    block = yaml.safe_load(text)["calibration"]
    assert block["runs"] == [f"{n}-0" for n in RUNS] and block["fitted_at"]
    assert block["compute_scale"] == pytest.approx(TRUE.compute_scale, rel=1e-3)
    # the table
    code, out, err = plan_main(capsys, "--calibrate", *map(str, runs), "--dry-run")
    assert code == 0, err
    assert "mean |error| of step time: 100.0% before" in out and "dry run:" in out and "dp1 tp1 pp2" in out


def _refused(capsys, cluster_file, *argv):
    before = cluster_file.read_text()
    code, out, err = plan_main(capsys, "--calibrate", *argv, "--cluster-file", str(cluster_file))
    assert code == 2 and "nothing was written" in err, (code, out, err)
    assert cluster_file.read_text() == before
    return err


def test_bad_input_is_refused_and_nothing_is_written(tmp_path, capsys, cluster_file):
    good = make_run(tmp_path / "runs", "dp2", RUNS["dp2"])
    err = _refused(capsys, cluster_file, str(good), str(tmp_path))
    assert "is not a run directory" in err
    err = _refused(capsys, cluster_file, str(good), "no-such-run", "--root", str(tmp_path / "runs"))
    assert "'no-such-run' names 0 runs" in err
    short = make_run(tmp_path / "runs", "short", RUNS["tp2"], step_times=[1.0, 1.0])
    assert "needs at least 3" in _refused(capsys, cluster_file, str(good), str(short))
    empty = make_run(tmp_path / "runs", "empty", RUNS["pp2"], step_times=[])
    assert "has no metrics" in _refused(capsys, cluster_file, str(good), str(empty))
    other = make_run(tmp_path / "runs", "other", RUNS["single"])
    cfg = yaml.safe_load((other / "config.yaml").read_text())
    cfg["cluster"]["name"] = "elsewhere"
    os.chmod(other / "config.yaml", 0o644)
    (other / "config.yaml").write_text(yaml.safe_dump(cfg))
    assert "cluster.name: the runs are of different clusters" in _refused(capsys, cluster_file, str(good), str(other))
    assert "given more than once" in _refused(capsys, cluster_file, str(good), str(good))
    code, _, err = plan_main(capsys, "--calibrate", str(good), "model=gpt_1b3")
    assert code == 2 and "not overrides" in err


# ---- the report ------------------------------------------------------------------------------------------


def test_the_report_shows_the_estimate_before_and_after_calibration(tmp_path):
    from launcher import report

    run = make_run(tmp_path / "runs", "pp2", RUNS["pp2"])
    assert report.read_run(run)["calibration"] is None  # conf/cluster/local.yaml has none: no section
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    cfg["cluster"]["calibration"].update(TRUE.as_dict())
    os.chmod(run / "config.yaml", 0o644)
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    data = report.read_run(run)
    view = data["calibration"]
    assert view["calibration"] == TRUE and "this run's config" in view["source"]
    rows = {r["quantity"]: r for r in report.calibration_rows(view, data["metrics"], data["states"])}
    step = rows["step time (s)"]
    assert abs(step["error_after"]) < 0.02 and step["error_before"] > 100
    act = rows["activation bytes per rank (largest)"]
    assert abs(act["error_after"]) < 0.01 and act["before"] > act["after"]
    page = report.run_page(data, [])
    assert "before and after calibration" in page and "planned, calibrated" in page


# ---- the meter the recipe measures activations with --------------------------------------------------------


def test_the_activation_meter_counts_saved_storages_once_and_no_parameters():
    import torch

    from recipes.common.activations import ActivationMeter

    lin = torch.nn.Linear(16, 16, bias=False)
    x = torch.randn(8, 16, requires_grad=True)
    with ActivationMeter() as meter:
        y = lin(x)  # saves x (its storage) and the weight (a parameter: not counted)
        z = (y * y).sum()  # saves y, once
        z.backward()
    assert meter.peak_bytes == x.untyped_storage().nbytes() + y.untyped_storage().nbytes()
    assert meter.live_bytes == 0
