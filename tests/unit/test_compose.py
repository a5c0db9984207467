"""Every shipped config composes against the schema; bad keys and types fail at composition."""
import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException as HydraCompositionError

from launcher.app import CONF_DIR, normalize_overrides
from launcher.config.schema import register_configs

register_configs()


def _compose(*overrides):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=normalize_overrides(list(overrides)))


@pytest.mark.parametrize("group", ["model", "cluster", "precision", "zero", "parallelism", "optim", "data", "recipe"])
def test_every_option_composes(group):
    for path in sorted((CONF_DIR / group).glob("*.yaml")):
        cfg = _compose(f"{group}={path.stem}")
        assert cfg[group] is not None


def test_required_keys_present():
    cfg = _compose("model=gpt_1b3")
    for key in ["num_layers", "hidden_size", "num_heads", "ffn_hidden_size", "vocab_size", "seq_len"]:
        assert cfg.model[key] > 0
    assert cfg.model.num_layers == 24 and cfg.model.hidden_size == 2048
    assert cfg.parallelism.dp is None and cfg.zero.stage == 0
    assert cfg.cluster.gpu.memory_gb == 0


def test_unknown_key_fails_naming_it():
    with pytest.raises(HydraCompositionError) as ei:
        _compose("model.hiden_size=10")
    assert "hiden_size" in str(ei.value) or "hiden_size" in str(ei.value.__cause__)


def test_wrong_type_fails_naming_it():
    with pytest.raises(Exception) as ei:
        _compose("train.steps=abc")
    text = str(ei.value) + str(ei.value.__cause__)
    assert "train.steps" in text
    # the key named as OmegaConf's type check names it (not only the echoed override), with the type
    assert "full_key: train.steps" in text and "could not be converted to Integer" in text, text


def test_bad_enum_lists_choices():
    with pytest.raises(Exception) as ei:
        _compose("precision.dtype=fp8")
    text = str(ei.value) + str(ei.value.__cause__)
    assert "fp32" in text and "bf16" in text


@pytest.mark.parametrize("steps,want", [(1, 1), (3, 3), (5, 5), (60, 5)])
def test_default_warmup_never_exceeds_the_run(steps, want):
    """The default warm-up is min(5, train.steps): a short run is not refused because of it."""
    from launcher.config.rules import problems
    from launcher.config.schema import warmup_steps

    cfg = _compose(f"train.steps={steps}")
    assert warmup_steps(cfg) == want and problems(cfg) == []
    assert warmup_steps(_compose(f"train.steps={steps}", "optim.warmup_steps=0")) == 0
    assert [e.key for e in problems(_compose("train.steps=3", "optim.warmup_steps=4"))] == ["optim.warmup_steps"]
