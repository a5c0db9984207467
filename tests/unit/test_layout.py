"""Layout derivation and the config rules, as pure functions over composed configs."""
import pytest
from hydra import compose, initialize_config_dir

from launcher import layout
from launcher.app import CONF_DIR, normalize_overrides


def cfg_with(*overrides):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=normalize_overrides(list(overrides)))


def keys(cfg):
    return [e.key for e in layout.check(cfg)]


def test_default_layout_is_valid_and_derived():
    lay = layout.resolve(cfg_with())
    assert (lay.world_size, lay.dp, lay.tp, lay.pp) == (2, 2, 1, 1)
    # global 16 = dp 2 * micro 4 * accum 2
    assert lay.grad_accum == 2


@pytest.mark.parametrize(
    "nodes,gpn,mb,gbs,accum",
    [(1, 1, 4, 16, 4), (2, 4, 2, 64, 4), (4, 8, 1, 32, 1), (1, 2, 8, 64, 4)],
)
def test_grad_accum(nodes, gpn, mb, gbs, accum):
    cfg = cfg_with(f"cluster.nodes={nodes}", f"cluster.gpus_per_node={gpn}",
                   f"train.micro_batch_size={mb}", f"train.global_batch_size={gbs}")
    lay = layout.resolve(cfg)
    assert lay.dp == nodes * gpn and lay.grad_accum == accum
    assert lay.dp * lay.micro_batch_size * lay.grad_accum == gbs


def test_tp_pp_not_dividing_world_names_key_and_fix():
    errs = layout.check(cfg_with("parallelism.tp=3"))
    assert errs[0].key == "parallelism.tp"
    msg = str(errs[0])
    assert "does not divide the world size" in msg and "fix:" in msg


@pytest.mark.parametrize(
    "overrides,key",
    [
        (["train.global_batch_size=18"], "train.global_batch_size"),
        (["parallelism.dp=3"], "parallelism.dp"),
        (["model.num_heads=5"], "model.num_heads"),
        (["model.num_layers=0"], "model.num_layers"),
        (["cluster.nodes=0"], "cluster.nodes"),
        (["zero.stage=4"], "zero.stage"),
        (["zero=1", "parallelism.engine=ddp"], "zero.stage"),  # ZeRO needs the deepspeed engine
        (["zero.offload_optimizer=true"], "zero.offload_optimizer"),
        (["zero=2", "zero.offload_params=true"], "zero.offload_params"),
        (["parallelism.sequence_parallel=true"], "parallelism.sequence_parallel"),
        (["optim.lr=0"], "optim.lr"),
        (["optim.warmup_steps=1000"], "optim.warmup_steps"),
        (["model.dropout=1.5"], "model.dropout"),
        (["train.fail_at_step=1", "train.fail_rank=5"], "train.fail_rank"),
        (["parallelism.tp=2", "parallelism.engine=ddp"], "parallelism.engine"),
        (["parallelism=3d", "zero=2"], "zero.stage"),
        (["parallelism=pp", "cluster.gpus_per_node=2", "train.global_batch_size=4", "train.micro_batch_size=4"],
         "train.global_batch_size"),
        (["parallelism=tp", "parallelism.sequence_parallel=true", "model.seq_len=63"], "parallelism.sequence_parallel"),
        (["parallelism=tp", "model.dropout=0.1"], "model.dropout"),
        (["parallelism=zero", "zero=0", "precision=fp16"], "precision.dtype"),
        (["parallelism=tp", "parallelism.engine=deepspeed"], "parallelism.engine"),
    ],
)
def test_bad_values_name_their_key(overrides, key):
    found = keys(cfg_with(*overrides))
    assert key in found, found


def test_resolve_raises_with_every_error():
    with pytest.raises(layout.ConfigErrors) as ei:
        layout.resolve(cfg_with("parallelism.tp=3", "model.num_heads=5"))
    text = str(ei.value)
    assert "parallelism.tp" in text and "model.num_heads" in text
