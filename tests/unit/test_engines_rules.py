"""parallelism=fsdp: the config group, and the rule rows that name the key a layout breaks."""
import pytest
from hydra import compose, initialize_config_dir

from launcher.app import CONF_DIR, normalize_overrides
from launcher.config import rules
from launcher.config.layout import Facts
from launcher.training.ds_config import build_ds_config


def cfg_with(*overrides):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=normalize_overrides(list(overrides)))


@pytest.mark.usefixtures("cpu_host")  # its premise: local processes on the CPU
def test_fsdp_group_resolves_to_the_fsdp_engine():
    cfg = cfg_with("parallelism=fsdp", "parallelism.cpu_offload=true", "parallelism.reshard_after_forward=false")
    lay = rules.resolve(cfg)
    assert (lay.engine, lay.dp, lay.zero, lay.tp, lay.pp) == ("fsdp", 2, 0, 1, 1)
    assert cfg.parallelism.cpu_offload is True and cfg.parallelism.reshard_after_forward is False


@pytest.mark.parametrize("overrides,key,needle", [
    (["zero=2"], "zero.stage", "DeepSpeed"),
    (["cluster.gpus_per_node=4", "parallelism.pp=2"], "parallelism.pp", "no pipeline"),
    (["cluster.gpus_per_node=4", "parallelism.tp=2"], "parallelism.tp", "no TP plan"),  # the GPT's own row
    (["zero.offload_optimizer=true"], "zero.offload_optimizer", "parallelism.cpu_offload=true"),
])
@pytest.mark.usefixtures("cpu_host")  # its premise: local processes on the CPU
def test_fsdp_refuses_what_it_does_not_run(overrides, key, needle):
    errs = rules.problems(cfg_with("parallelism=fsdp", *overrides))
    assert [e.key for e in errs] == [key], errs
    assert needle in str(errs[0])


def test_cpu_offload_on_another_engine_is_refused():
    (err,) = rules.problems(cfg_with("parallelism.cpu_offload=true"))
    assert err.key == "parallelism.cpu_offload" and "engine is ddp" in str(err)


def test_unknown_engine_lists_fsdp():
    f = Facts(nodes=1, gpus_per_node=1, tp=1, pp=1, micro_batch_size=1, global_batch_size=1, engine="bogus")
    (err,) = [r.error(f) for r in rules.RULES if r.key == "parallelism.engine" and r.broken(f)]
    assert "auto, ddp, fsdp, deepspeed or megatron" in str(err)
    assert not [r for r in rules.RULES if r.key == "parallelism.engine" and r.broken(f.with_(engine="fsdp"))]


def test_zero3_bucket_sizes_from_the_width_the_engine_passes():
    cfg = cfg_with("zero=3")
    lay = rules.resolve(cfg)
    z = build_ds_config(cfg, lay, hidden_size=64)["zero_optimization"]
    assert z["reduce_bucket_size"] == 64 * 64 and z["stage3_param_persistence_threshold"] == 640
    # without it: the GPT's model.hidden_size, as before
    h = int(cfg.model.hidden_size)
    assert build_ds_config(cfg, lay)["zero_optimization"]["reduce_bucket_size"] == h * h
