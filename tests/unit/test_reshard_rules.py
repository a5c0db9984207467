"""Which layout changes a resumed run may make (launcher.submit.reshard, launcher.config.layout.moved): pure;
the reshard itself is tests/integration/test_reshard.py."""
import pytest

from launcher.config.errors import ConfigErrors
from launcher.config.layout import Layout, moved
from launcher.submit import reshard


def _lay(**kw):
    return Layout(**{"dp": 2, "micro_batch_size": 2, "grad_accum": 4, "engine": "ddp", **kw}).to_json()


def _universal(tmp_path):
    ckpt = tmp_path / "step_00000004"
    (ckpt / "universal").mkdir(parents=True)
    (ckpt / "universal" / ".metadata").write_bytes(b"x")
    return ckpt


def test_moved_names_only_the_keys_that_move_state():
    old = _lay()
    assert moved(old, old) == {}
    assert moved(old, _lay(dp=1, grad_accum=8)) == {"dp": [2, 1]}
    assert moved(old, _lay(engine="fsdp", procs_per_node=1)) == {"engine": ["ddp", "fsdp"]}
    assert moved(None, _lay(dp=4)) == {}  # a checkpoint that recorded no layout loads as it always did


def test_dp_engine_and_node_changes_with_the_same_global_batch_pass(tmp_path):
    ckpt = _universal(tmp_path)
    reshard.check("r", _lay(), _lay(dp=1, grad_accum=8), {"cluster.gpus_per_node": (2, 1)}, ckpt)
    reshard.check("r", _lay(), _lay(engine="fsdp", dp=4, grad_accum=2), {"parallelism.engine": ("ddp", "fsdp")},
                  ckpt)
    reshard.check("r", _lay(), _lay(dp=1, grad_accum=8), {}, None)  # no checkpoint yet: it starts from step 0 anyway
    linked = tmp_path / "step_00000006"  # the universal form named in the engine's own files (DDP's)
    linked.mkdir()
    (linked / "universal.links.00000.json").write_text("{}")
    reshard.check("r", _lay(), _lay(dp=1, grad_accum=8), {"cluster.gpus_per_node": (2, 1)}, linked)
    with pytest.raises(ConfigErrors, match="no layout-independent state"):
        reshard.check("r", _lay(), _lay(dp=1, grad_accum=8), {"cluster.gpus_per_node": (2, 1)}, tmp_path / "none")


def _refused(old, new, changed, ckpt):
    with pytest.raises(ConfigErrors) as e:
        reshard.check("r", old, new, changed, ckpt)
    return e.value.errors


def test_tp_and_pp_changes_pass_on_the_megatron_engine_at_zero_0(tmp_path):
    ckpt = _universal(tmp_path)
    three_d = _lay(engine="megatron", dp=2, tp=2, pp=2, grad_accum=4)
    reshard.check("r", three_d, _lay(engine="deepspeed", zero=2, dp=4, grad_accum=2), {"parallelism.tp": (2, 1)}, ckpt)
    reshard.check("r", three_d, _lay(engine="megatron", pp=4, dp=1, grad_accum=8), {"parallelism.pp": (2, 4)}, ckpt)
    reshard.check("r", _lay(engine="megatron", pp=4, dp=1, grad_accum=8), _lay(dp=1, grad_accum=8),
                  {"parallelism.pp": (4, 1)}, ckpt)


def test_the_megatron_engine_reshards_at_zero_1_too(tmp_path):
    ckpt = _universal(tmp_path)
    reshard.check("r", _lay(), _lay(engine="megatron", zero=1, tp=2, dp=1, grad_accum=8),
                  {"parallelism.tp": (1, 2), "zero.stage": (0, 1)}, ckpt)
    reshard.check("r", _lay(engine="megatron", zero=1, dp=2), _lay(dp=1, grad_accum=8), {"zero.stage": (1, 0)}, ckpt)


def test_deepspeed_at_zero_0_is_refused_naming_the_key_and_the_fix(tmp_path):
    errs = _refused(_lay(), _lay(engine="deepspeed", zero=0),
                    {"parallelism.engine": ("ddp", "deepspeed"), "zero.stage": (1, 0)}, _universal(tmp_path))
    assert [e.key for e in errs] == ["parallelism.engine, zero.stage"], errs
    assert "DeepSpeed ZeRO-0" in str(errs[0]) and "set zero.stage" in errs[0].fix


def test_a_changed_global_batch_is_refused_unless_asked_for(tmp_path):
    ckpt = _universal(tmp_path)
    errs = _refused(_lay(), _lay(dp=1, grad_accum=4), {"cluster.gpus_per_node": (2, 1)}, ckpt)
    assert [e.key for e in errs] == ["cluster.gpus_per_node"] and "global batch" in str(errs[0])
    assert "train.global_batch_size=16" in errs[0].fix
    reshard.check("r", _lay(), _lay(dp=1, grad_accum=4), {"train.global_batch_size": (16, 8)}, ckpt)


def test_a_checkpoint_without_universal_state_is_refused(tmp_path):
    ckpt = tmp_path / "step_00000004"
    ckpt.mkdir()
    errs = _refused(_lay(), _lay(dp=1, grad_accum=8), {"cluster.gpus_per_node": (2, 1)}, ckpt)
    assert "no layout-independent state" in str(errs[0]) and "universal=false" in str(errs[0])


def test_deepspeed_reshards_at_every_partitioned_zero_stage_offloaded_or_not(tmp_path):
    ckpt = _universal(tmp_path)
    for new in (*(_lay(engine="deepspeed", zero=stage) for stage in (1, 2, 3)),
                _lay(engine="deepspeed", zero=2, offload_optimizer=True),
                _lay(engine="deepspeed", zero=3, offload_optimizer=True, offload_params=True)):
        reshard.check("r", _lay(), new, {"zero.stage": (0, new["zero"])}, ckpt)
    errs = _refused(_lay(engine="deepspeed", zero=0), _lay(), {"zero.stage": (0, 1)}, ckpt)
    assert any("saved on DeepSpeed ZeRO-0" in str(e) and "stage 1, 2 or 3" in e.fix for e in errs), errs
    # ZeRO-0 in fp32 is any module's state (DeepSpeed steps the torch optimizer as given); in bf16, not
    reshard.check("r", _lay(engine="deepspeed", zero=0), _lay(), {"zero.stage": (0, 1)}, ckpt, ("fp32", "fp32"))
    with pytest.raises(ConfigErrors, match="DeepSpeed ZeRO-0 in bf16"):
        reshard.check("r", _lay(), _lay(engine="deepspeed", zero=0), {"precision.dtype": ("fp32", "bf16")}, ckpt,
                      ("fp32", "bf16"))


def test_a_config_group_given_to_resume_is_refused_naming_it_alone():
    """`launcher resume RUN parallelism=fsdp zero.stage=0` names parallelism (a group chosen at launch),
    not the keys it came with; the keys alone are taken."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from launcher.app import CONF_DIR, normalize_overrides
    from launcher.submit import resume

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=normalize_overrides(["cluster.gpus_per_node=2"]))
    plain = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    with pytest.raises(ConfigErrors) as e:
        resume._apply(plain, ["parallelism=fsdp", "zero.stage=0", "cluster.gpus_per_node=1"], "r")
    (err,) = e.value.errors
    assert err.key == "parallelism" and "parallelism.tp=2" in err.fix, err
    out = resume._apply(plain, ["parallelism.engine=fsdp", "zero.stage=0", "cluster.gpus_per_node=1"], "r")
    assert (out["parallelism"]["engine"], out["cluster"]["gpus_per_node"]) == ("fsdp", 1)
