"""recipes/commbench: the bandwidth arithmetic (nccl-tests' conventions) and the settings."""
import pytest
from omegaconf import OmegaConf

from recipes.commbench import math as cbmath, settings


@pytest.mark.parametrize("n,ar,ag", [(1, 0.0, 0.0), (2, 1.0, 0.5), (4, 1.5, 0.75), (8, 1.75, 0.875)])
def test_bus_factors(n, ar, ag):
    assert cbmath.bus_factor("all_reduce", n) == pytest.approx(ar)
    assert cbmath.bus_factor("all_gather", n) == pytest.approx(ag)
    assert cbmath.bus_factor("reduce_scatter", n) == pytest.approx(ag)
    assert cbmath.bus_factor("sendrecv", n) == 1.0


def test_bus_factor_refuses_unknown_op_and_empty_world():
    with pytest.raises(ValueError, match="broadcast"):
        cbmath.bus_factor("broadcast", 2)
    with pytest.raises(ValueError):
        cbmath.bus_factor("all_reduce", 0)


def test_algbw_and_busbw():
    # 1 GB in 0.5 s is 2 GB/s; on 4 ranks an all_reduce's busbw is 2 * 2 * 3/4
    assert cbmath.algbw(10**9, 0.5) == pytest.approx(2.0)
    assert cbmath.busbw("all_reduce", 10**9, 0.5, 4) == pytest.approx(3.0)
    assert cbmath.busbw("all_gather", 10**9, 0.5, 4) == pytest.approx(1.5)
    assert cbmath.busbw("sendrecv", 10**9, 0.5, 4) == pytest.approx(2.0)
    with pytest.raises(ValueError):
        cbmath.algbw(1, 0.0)


def test_message_sizes():
    assert cbmath.message_sizes(1024, 262144, 2) == [1024 << i for i in range(9)]
    assert cbmath.message_sizes(1, 100, 10) == [1, 10, 100]
    assert cbmath.message_sizes(8, 70, 4) == [8, 32]  # max not on the series: not added
    assert cbmath.message_sizes(5, 5, 2) == [5]
    for bad in ((0, 8, 2), (16, 8, 2), (1, 8, 1)):
        with pytest.raises(ValueError):
            cbmath.message_sizes(*bad)


def test_element_count_splits_evenly():
    assert cbmath.element_count("all_reduce", 1024, 4, 3) == 256
    assert cbmath.element_count("all_gather", 1024, 4, 3) == 255  # 85 elements per rank
    assert cbmath.element_count("reduce_scatter", 4, 4, 8) == 8  # at least one element per rank
    assert cbmath.element_count("sendrecv", 1, 4, 2) == 1


def test_scope():
    assert cbmath.scope(["a", "a"], "all_reduce") == "intra"
    assert cbmath.scope(["a", "b"], "all_reduce") == "inter"
    assert cbmath.scope(["a", "b", "a"], "sendrecv") == "intra"  # only rank 0 and the last rank talk
    assert cbmath.scope(["a", "a", "b"], "sendrecv") == "inter"


def test_peaks():
    rows = [{"op": "all_reduce", "busbw_gbs": 1.0}, {"op": "all_reduce", "busbw_gbs": 3.0},
            {"op": "sendrecv", "busbw_gbs": 2.0}]
    assert cbmath.peaks(rows) == {"all_reduce": 3.0, "sendrecv": 2.0}


def test_math_does_not_import_torch():
    import ast
    from pathlib import Path

    tree = ast.parse(Path(cbmath.__file__).read_text())
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
    assert not [m for m in names if m.split(".")[0] == "torch"]


def _cfg(params=None, dtype="fp32"):
    return OmegaConf.create({"precision": {"dtype": dtype}, "recipe": {"params": params or {}}})


def test_settings_defaults_and_overrides():
    assert settings.from_cfg(_cfg()) == settings.Settings()
    assert settings.from_cfg(_cfg(dtype="bf16")).dtype == "bf16"  # the run's dtype by default
    s = settings.from_cfg(_cfg({"max_bytes": 4096, "iters": 3, "dtype": "fp16", "warmup_iters": 0, "unused": "x"}))
    assert (s.max_bytes, s.iters, s.warmup_iters, s.dtype) == (4096, 3, 0, "fp16")


@pytest.mark.parametrize("params,key", [
    ({"iters": "many"}, "recipe.params.iters"),
    ({"iters": 0}, "recipe.params.iters"),
    ({"factor": 1}, "recipe.params.factor"),
    ({"dtype": "fp8"}, "recipe.params.dtype"),
    ({"min_bytes": 4096, "max_bytes": 1024}, "recipe.params.max_bytes"),
])
def test_settings_errors_name_the_key(params, key):
    with pytest.raises(ValueError, match=key):
        settings.from_cfg(_cfg(params))
