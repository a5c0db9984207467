"""Pre-submit checks (memory fits, bubble, ZeRO-3 over a slow link), their wiring into launch's check
of every point (launcher.submit.pipeline.validate), and `launcher plan`."""
from __future__ import annotations

import json
from functools import cache

import pytest
from hydra import compose, initialize_config_dir

from launcher.app import CONF_DIR, normalize_overrides
from launcher.config.layout import Facts
from launcher.config.rules import layout_of
from launcher.submit.pipeline import InvalidSweep, Point, validate as check_points
from recipes.gpt.plan import checks, spec
from recipes.gpt.plan.spec import GIB, ClusterSpec

GPT_1B3_A100 = ["model=gpt_1b3", "cluster=a100_80g", "precision=bf16"]


@cache
def cfg_with(*overrides):
    """Composed once per override set (Hydra composition is the slow part; checks never mutate it)."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=normalize_overrides(list(overrides)))


def test_fitting_default_run_has_no_errors_or_warnings():
    assert checks.check(cfg_with()) == ([], [])
    assert checks.check(cfg_with(*GPT_1B3_A100, "train.micro_batch_size=2", "train.global_batch_size=64")) == ([], [])


def test_memory_error_names_the_smallest_fix_and_the_fix_fits():
    over = [*GPT_1B3_A100, "cluster.gpu.memory_gb=16", "train.micro_batch_size=8", "train.global_batch_size=64"]
    errors, _ = checks.check(cfg_with(*over))
    (err,) = errors
    text = str(err)
    assert "cluster.gpu.memory_gb=16" in text and "14.4 GiB usable" in text and "10% headroom" in text
    assert "51.4 GiB per GPU" in text  # params 4.9 + grads 4.9 + optimizer 9.8 + activations 31.8 (ddp: no bucket copy)
    fix = err.fix.split(" (then")[0].split()
    assert err.key == fix[0].split("=")[0] and len(fix) == 1  # one key changed is enough here
    assert checks.check(cfg_with(*over, *fix)) == ([], [])


def test_memory_fix_respects_an_explicit_engine():
    over = ["model=llama_7b", "cluster=h100_80g", "precision=bf16", "parallelism.engine=ddp",
            "train.micro_batch_size=2", "train.global_batch_size=64"]
    (err,), _ = checks.check(cfg_with(*over))
    assert err.key == "zero.stage" and "parallelism.engine=deepspeed" in err.fix
    fix = err.fix.split(" (then")[0].split()
    assert checks.check(cfg_with(*over, *fix))[0] == []


def test_nothing_fits_names_the_memory_key():
    (err,), _ = checks.check(cfg_with("model=gpt_175b", "cluster=a100_80g", "precision=bf16",
                                      "train.micro_batch_size=1", "train.global_batch_size=64"))
    assert err.key == "cluster.gpu.memory_gb" and "no layout of the same world size" in err.fix


def test_local_backend_uses_host_memory(monkeypatch):
    monkeypatch.setattr(spec, "host_available_bytes", lambda path="/proc/meminfo": 8 * GIB)
    cfg = cfg_with("model=gpt_1b3", "cluster.gpus_per_node=2")
    assert ClusterSpec.from_cfg(cfg.cluster).memory_bytes == 4 * GIB
    (err,), _ = checks.check(cfg)
    assert "host MemAvailable / cluster.gpus_per_node=2" in str(err) and "3.6 GiB usable" in str(err)
    monkeypatch.setattr(spec, "host_available_bytes", lambda path="/proc/meminfo": 512 * GIB)
    assert checks.check(cfg_with("model=gpt_1b3", "cluster.gpus_per_node=2"))[0] == []


def test_meminfo_is_read(tmp_path):
    p = tmp_path / "meminfo"
    p.write_text("MemTotal:       16000000 kB\nMemFree:  1 kB\nMemAvailable:    8388608 kB\n")
    assert spec.host_available_bytes(str(p)) == 8 * GIB
    assert spec.host_available_bytes(str(tmp_path / "missing")) is None


def test_slurm_with_unknown_memory_skips_the_check():
    cfg = cfg_with("model=gpt_175b", "cluster=local_slurm")
    assert ClusterSpec.from_cfg(cfg.cluster).memory_bytes == 0
    assert checks.check(cfg) == ([], [])


def test_offload_host_memory_is_checked():
    cfg = cfg_with("model=llama_7b", "cluster=a100_80g", "precision=bf16", "zero=3", "zero.offload_optimizer=true",
                   "zero.offload_params=true", "cluster.mem_gb=64", "train.micro_batch_size=1",
                   "train.global_batch_size=64")
    errors, _ = checks.check(cfg)
    assert [e.key for e in errors] == ["cluster.mem_gb"]


def test_bubble_warning():
    cfg = cfg_with(*GPT_1B3_A100, "parallelism.pp=4", "train.micro_batch_size=4", "train.global_batch_size=32")
    errors, warnings = checks.check(cfg)
    assert errors == [] and len(warnings) == 1
    assert warnings[0].startswith("parallelism.pp: pipeline bubble 43%")
    ok = cfg_with(*GPT_1B3_A100, "parallelism.pp=4", "train.micro_batch_size=1", "train.global_batch_size=32")
    assert checks.check(ok) == ([], [])  # m = 16: 3/19 = 16%


def test_zero3_over_a_slow_link_warns_and_a_fast_one_does_not():
    base = [*GPT_1B3_A100, "cluster.nodes=4", "zero=3", "train.micro_batch_size=1", "train.global_batch_size=64"]
    _, warnings = checks.check(cfg_with(*base))
    assert len(warnings) == 1 and warnings[0].startswith("zero.stage: ZeRO-3 over the inter-node link")
    assert checks.check(cfg_with(*base, "cluster.inter_node_bandwidth=400")) == ([], [])
    assert checks.check(cfg_with(*base, "cluster.nodes=1")) == ([], [])  # one node: NVLink only


def test_launch_check_stops_on_warnings_unless_forced(capsys):
    over = [*GPT_1B3_A100, "parallelism.pp=4", "train.micro_batch_size=4", "train.global_batch_size=32"]
    with pytest.raises(InvalidSweep) as ei:
        check_points([Point(cfg_with(*over))])
    assert "submit.force=true" in str(ei.value) and "parallelism.pp" in str(ei.value)
    checked = check_points([Point(cfg_with(*over, "submit.force=true"))])
    assert len(checked) == 1 and checked[0].plan["layouts"][0]["pp"] == 4
    assert "parallelism.pp: pipeline bubble 43%" in capsys.readouterr().err


def test_force_never_overrides_errors():
    with pytest.raises(InvalidSweep) as ei:
        check_points([Point(cfg_with("model=gpt_175b", "cluster=a100_80g", "submit.force=true",
                                     "train.micro_batch_size=1", "train.global_batch_size=64"))])
    assert "cluster.gpu.memory_gb" in str(ei.value)


def test_sweep_with_one_point_that_does_not_fit_launches_nothing():
    points = [Point(cfg_with(*GPT_1B3_A100, f"cluster.gpu.memory_gb={gb}", "train.micro_batch_size=1",
                             "train.global_batch_size=64"), [f"cluster.gpu.memory_gb={gb}"]) for gb in (80, 8)]
    with pytest.raises(InvalidSweep) as ei:
        check_points(points)
    assert str(ei.value).startswith("1 of 2 point(s) invalid; nothing was submitted")
    assert "point 1 (cluster.gpu.memory_gb=8)" in str(ei.value)


def test_launch_check_returns_the_plan_for_the_archive():
    from launcher.host import host_gpus

    (checked,) = check_points([Point(cfg_with())])
    plan = checked.plan
    assert plan["model"]["params"] == 136_960
    lay = plan["layouts"][0]
    gpus = host_gpus()  # the default's processes: 2 on CPU, else the GPUs the default batch splits over
    dp = 2 if not gpus else max(k for k in (1, 2, 4) if k <= gpus)
    assert (lay["dp"], lay["tp"], lay["pp"], lay["zero"], lay["engine"]) == (dp, 1, 1, 0, "ddp")
    assert lay["grad_accum"] == 4 // dp
    assert lay["memory_bytes"]["params"] == 4 * 136_960 and lay["feasible"] is True
    json.dumps(plan)


# ---- launcher plan ----------------------------------------------------------------------------------


def plan_cli(capsys, *argv):
    from launcher.cli.main import main

    code = main(["plan", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_plan_json_for_the_configured_layout(capsys):
    code, out, _ = plan_cli(capsys, "--json", *GPT_1B3_A100, "train.micro_batch_size=2", "train.global_batch_size=64")
    assert code == 0
    report = json.loads(out)
    assert report["model"]["params"] == 1_315_819_520
    (lay,) = report["layouts"]
    for key in ("dp", "tp", "pp", "zero", "micro_batch_size", "grad_accum", "recompute", "sequence_parallel",
                "feasible", "bubble", "step_time_s", "tflops_per_gpu", "mfu", "reasons", "engine"):
        assert key in lay
    assert set(lay["memory_bytes"]) == {"params", "grads", "optimizer", "activations", "buffers", "total"}
    assert set(lay["comm_bytes"]) == {"dp", "tp", "pp"}
    assert (lay["dp"], lay["grad_accum"], lay["engine"], lay["feasible"]) == (8, 4, "ddp", True)
    assert 0 < lay["mfu"] < 1 and lay["tflops_per_gpu"] < 312


def test_plan_infeasible_layout_keeps_its_estimate(capsys):
    code, out, _ = plan_cli(capsys, "--json", "model=gpt_175b", "cluster=a100_80g", "train.global_batch_size=64")
    (lay,) = json.loads(out)["layouts"]
    assert code == 0 and lay["feasible"] is False and lay["reasons"] and lay["memory_bytes"]["total"] > 80 * GIB
    assert lay["step_time_s"] > 0


def test_plan_search_json_ranks_feasible_first(capsys):
    code, out, _ = plan_cli(capsys, "--search", "--json", "model=gpt_175b", "cluster=a100_80g", "cluster.nodes=16",
                            "precision=bf16", "train.global_batch_size=256")
    report = json.loads(out)
    lays = report["layouts"]
    assert code == 0 and len(lays) > 100
    n = sum(lay["feasible"] for lay in lays)
    assert 0 < n < len(lays) and all(lay["feasible"] for lay in lays[:n])
    assert [lay["step_time_s"] for lay in lays[:n]] == sorted(lay["step_time_s"] for lay in lays[:n])
    assert lays[0]["tp"] >= 4 and lays[0]["engine"] == "megatron"
    assert all(lay["engine"] == "megatron" for lay in lays if lay["tp"] > 1 or lay["pp"] > 1)


def test_plan_search_top_and_table(capsys):
    code, out, _ = plan_cli(capsys, "--search", "--json", "--top", "3", *GPT_1B3_A100)
    assert code == 0 and len(json.loads(out)["layouts"]) == 3
    code, out, _ = plan_cli(capsys, "--search", *GPT_1B3_A100)
    assert code == 0 and "gpt_1b3: 1,315,819,520 parameters" in out and "TFLOP/s" in out and "best 20 shown" in out


def test_plan_composition_error_exits_2(capsys):
    code, out, err = plan_cli(capsys, "--json", "model.hiden_size=3")
    assert code == 2 and out == "" and "hiden_size" in err
    code, _, err = plan_cli(capsys, "model=gpt_9000")
    assert code == 2 and "gpt_9000" in err


def test_plan_reports_rule_violations_and_unestimable_layouts(capsys):
    code, out, _ = plan_cli(capsys, "--json", "model.num_heads=3")
    assert code == 0 and "model.num_heads" in json.loads(out)["layouts"][0]["reasons"][0]
    code, out, err = plan_cli(capsys, "--json", "parallelism.tp=3")
    assert code == 2 and "parallelism.tp" in err



def test_other_recipes_are_not_planned_nor_enforced():
    """The planner is the GPT recipe's (its contract's): another recipe's run is neither estimated
    (no GPT plan in its archive) nor refused by the GPT's memory estimate."""
    from launcher.config import recipe_contract

    cfg = cfg_with("model=gpt_175b", "cluster=a100_80g", "recipe._target_=mypkg.train.main",
                   "train.micro_batch_size=1", "train.global_batch_size=64")
    assert recipe_contract.of("mypkg.train.main").planner is None
    gpt = recipe_contract.of("recipes.gpt.train.main").planner
    # the GPT's own run of that config would be refused
    assert gpt is not None and gpt(cfg, layout_of(Facts.from_cfg(cfg))).errors


def test_the_warnings_force_let_through_stay_with_the_run_in_checks_json(tmp_path):
    """checks.json, a record added in one type (ChecksRecord) and one writer: staging writes it in every
    run dir from the checked point (launch's path; a Hydra app's marks its own), the run reads it back."""
    from launcher.run.checks_record import HYDRA_APP, LAUNCH, ChecksRecord
    from launcher.run.rundir import RunDir, SweepDir
    from launcher.submit import staging

    over = [*GPT_1B3_A100, "parallelism.pp=4", "train.micro_batch_size=4", "train.global_batch_size=32"]
    (forced,) = check_points([Point(cfg_with(*over, "submit.force=true"))])
    (plain,) = check_points([Point(cfg_with(*GPT_1B3_A100, "train.micro_batch_size=4", "train.global_batch_size=32"))])
    assert forced.checks.by == LAUNCH and len(forced.checks.forced) == 1
    assert forced.checks.forced[0].startswith("parallelism.pp: pipeline bubble 43%"), forced.checks
    assert plain.checks == ChecksRecord(LAUNCH, advice=plain.checks.advice) and not plain.checks.forced

    sd = SweepDir.new(tmp_path)
    points = [staging.Staged(index=i, config={"seed": 1}, run={"run_id": sd.run_id(i)}, overrides={},
                             checks=c) for i, c in enumerate((forced.checks, ChecksRecord(HYDRA_APP)))]
    staged = staging.stage(sd, points, {})
    assert [RunDir(rd.path).checks() for rd in staged] == [forced.checks, ChecksRecord(HYDRA_APP)]
    assert "1 warning(s) let through by submit.force=true: parallelism.pp" in forced.checks.describe()
    assert RunDir(tmp_path / "no-such-run").checks() is None  # a run staged before checks.json: none
