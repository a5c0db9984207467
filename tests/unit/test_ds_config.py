"""launcher.training.ds_config: the DeepSpeed config generated from a composed run config and its layout."""
import itertools
import json

import pytest
from hydra import compose, initialize_config_dir

from launcher.app import CONF_DIR, normalize_overrides
from launcher.config.rules import resolve
from launcher.config.schema import register_configs
from launcher.training.ds_config import BUCKET_ELEMENTS, build_ds_config

register_configs()


def _compose(*overrides):
    # the DeepSpeed config does not depend on where the job runs; a Slurm cluster allows any node count
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="config",
                       overrides=normalize_overrides(["cluster=local_slurm", "cluster.nodes=1", *overrides]))


def _ds(*overrides, dp=None):
    """build_ds_config of the composed config on its layout (``dp`` processes on one node when given),
    as the engine calls it; resolving the layout raises (naming the key) when a layout rule is broken."""
    cfg = _compose(*overrides, *([f"cluster.gpus_per_node={dp}"] if dp is not None else []))
    layout = resolve(cfg)
    if dp is not None:
        assert layout.dp == dp
    return build_ds_config(cfg, layout)


# every stage x precision x offload combination the layout rules admit
COMBOS = [
    (stage, dtype, off_opt, off_par)
    for stage, dtype, off_opt, off_par in itertools.product((0, 1, 2, 3), ("fp32", "bf16", "fp16"),
                                                            (False, True), (False, True))
    if not ((off_opt or off_par) and stage == 0) and not (off_par and stage != 3)
]


@pytest.mark.parametrize("stage,dtype,off_opt,off_par", COMBOS)
def test_every_stage_precision_offload_combination(stage, dtype, off_opt, off_par):
    cfg = _compose(
        "model=gpt_125m", f"zero={stage}", f"precision={dtype}", "cluster.nodes=2", "cluster.gpus_per_node=4",
        "train.global_batch_size=64", "train.micro_batch_size=2",
        f"zero.offload_optimizer={str(off_opt).lower()}", f"zero.offload_params={str(off_par).lower()}",
    )
    layout = resolve(cfg)
    assert layout.dp == 8
    ds = build_ds_config(cfg, layout)
    json.dumps(ds)  # plain JSON, nothing OmegaConf left in it

    assert ds["train_batch_size"] == 64
    assert ds["train_micro_batch_size_per_gpu"] == 2
    assert ds["gradient_accumulation_steps"] == 4  # 64 / (2 * 8)
    assert ds["train_batch_size"] == ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"] * 8
    assert ds["gradient_clipping"] == 1.0
    assert ds["steps_per_print"] >= 10**9 and ds["wall_clock_breakdown"] is False
    assert "optimizer" not in ds and "scheduler" not in ds  # client optimizer, loop-owned schedule

    assert ds["bf16"] == {"enabled": dtype == "bf16"}
    if dtype == "fp16":
        assert ds["fp16"] == {"enabled": True, "loss_scale": 0.0, "initial_scale_power": 16, "loss_scale_window": 1000,
                              "hysteresis": 2, "min_loss_scale": 1.0}
    else:
        assert ds["fp16"] == {"enabled": False}
    assert not (ds["fp16"]["enabled"] and ds["bf16"]["enabled"])

    z = ds["zero_optimization"]
    assert z["stage"] == stage
    if stage == 0:
        assert z == {"stage": 0}
    else:
        assert z["allgather_bucket_size"] == BUCKET_ELEMENTS and z["reduce_scatter"] and z["contiguous_gradients"]
        assert z["overlap_comm"] is (stage == 3)
    if off_opt:
        assert z["offload_optimizer"] == {"device": "cpu", "pin_memory": False}
        assert ds["zero_force_ds_cpu_optimizer"] is True
    else:
        assert "offload_optimizer" not in z and "zero_force_ds_cpu_optimizer" not in ds
    if off_par:
        assert z["offload_param"] == {"device": "cpu", "pin_memory": False}
    else:
        assert "offload_param" not in z
    h = 768  # gpt_125m
    if stage == 3:
        assert z["stage3_param_persistence_threshold"] == 10 * h
        assert z["stage3_prefetch_bucket_size"] == int(0.9 * h * h) and z["reduce_bucket_size"] == h * h
    else:
        assert not any(k.startswith("stage3_") for k in z)
        if stage:
            assert z["reduce_bucket_size"] == BUCKET_ELEMENTS


def test_precision_keys_map_through():
    fp16 = _ds("zero=1", "precision=fp16", "precision.loss_scale=128", "precision.initial_scale_power=12",
               "precision.loss_scale_window=200", "precision.hysteresis=4", "precision.min_loss_scale=0.5",
               dp=2)["fp16"]
    assert fp16 == {"enabled": True, "loss_scale": 128.0, "initial_scale_power": 12, "loss_scale_window": 200,
                    "hysteresis": 4, "min_loss_scale": 0.5}


def test_grad_clip_zero_turns_clipping_off():
    assert _ds("zero=2", "optim.grad_clip=0", dp=2)["gradient_clipping"] == 0.0
    assert _ds("zero=2", "optim.grad_clip=0.5", dp=2)["gradient_clipping"] == 0.5


@pytest.mark.parametrize("dp,accum", [(1, 8), (2, 4), (4, 2), (8, 1)])
def test_grad_accumulation_follows_dp(dp, accum):
    assert _ds("zero=1", "train.global_batch_size=16", "train.micro_batch_size=2", dp=dp)[
        "gradient_accumulation_steps"] == accum


@pytest.mark.parametrize(
    "overrides,dp,needle",
    [
        (["train.global_batch_size=16", "train.micro_batch_size=3"], 2, "train.global_batch_size"),
        (["train.global_batch_size=16", "train.micro_batch_size=2"], 3, "train.global_batch_size"),
        # the key the layout rule table names: offload at ZeRO stage 0
        (["zero=0", "zero.offload_optimizer=true"], 2, "zero.offload_optimizer"),
        (["zero=2", "zero.offload_params=true"], 2, "zero.offload_params"),
        (["zero=1", "optim.grad_clip=-1"], 2, "optim.grad_clip"),
    ],
)
def test_impossible_configs_raise_naming_the_key(overrides, dp, needle):
    with pytest.raises(ValueError, match=needle):
        _ds(*overrides, dp=dp)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_on_gpus_reduction_overlaps_the_backward_and_offload_is_pinned(stage):
    from omegaconf import OmegaConf

    from launcher.config.layout import Layout

    cfg = OmegaConf.create({"model": {"hidden_size": 64}, "optim": {"grad_clip": 1.0},
                            "precision": {"dtype": "bf16"}})
    lay = Layout(dp=2, zero=stage, micro_batch_size=1, grad_accum=1, offload_optimizer=True,
                 offload_params=stage == 3)
    gpu = build_ds_config(cfg, lay, "cuda")["zero_optimization"]
    cpu = build_ds_config(cfg, lay, "cpu")["zero_optimization"]
    assert gpu["overlap_comm"] is True and cpu["overlap_comm"] is (stage == 3)
    assert gpu["offload_optimizer"]["pin_memory"] is True and cpu["offload_optimizer"]["pin_memory"] is False
    if stage == 3:
        assert gpu["offload_param"]["pin_memory"] is True and cpu["offload_param"]["pin_memory"] is False
