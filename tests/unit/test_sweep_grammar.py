"""Numeric config-group names (zero/0.yaml .. zero/3.yaml) with Hydra's whole override grammar: a
plain choice, quoted or not, and every sweep form (comma list, range, choice, glob, Optuna's choice),
in single-run and -m mode."""

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException

from launcher.app import CONF_DIR


def _compose(*overrides):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides), return_hydra_config=True)


@pytest.mark.parametrize("given,stage", [("zero=2", 2), ("zero='2'", 2), ('zero="3"', 3), ("zero=0", 0)])
def test_plain_choice_quoted_or_not(given, stage):
    cfg = _compose(given)
    assert cfg.zero.stage == stage
    assert cfg.hydra.runtime.choices.zero == str(stage)
    assert list(cfg.hydra.overrides.task) == [given]  # archived as the user wrote it


def test_plain_keys_keep_their_ints():
    cfg = _compose("seed=3", "train.steps=7", "cluster.nodes=1")
    assert cfg.seed == 3 and cfg.train.steps == 7 and isinstance(cfg.seed, int)


def test_unknown_option_named_by_hydra():
    with pytest.raises(Exception) as ei:
        _compose("zero=7")
    text = str(ei.value)
    assert "zero/7" in text and "Available options" in text and "'2'" not in text.split("zero/7")[0]


@pytest.mark.parametrize("sweep", ["zero=1,2", "zero=range(0,2)", "zero=choice(0,1)", "zero=glob(*)"])
def test_sweeps_need_multirun_in_single_run_mode(sweep):
    """Hydra's rule for any key: a sweep in a single run is refused, saying --multirun."""
    with pytest.raises(ConfigCompositionException, match="--multirun"):
        _compose(sweep)


def test_optuna_choice_points_compose():
    """Optuna reads `zero=choice(0,1)` as a categorical of ints and hands back `zero=<int>`."""
    import optuna

    from hydra_plugins.hydra_optuna_sweeper._impl import create_params_from_overrides

    dists, fixed = create_params_from_overrides(["zero=choice(0,1)", "optim.lr=interval(1e-4,1e-2)"])
    assert not fixed and list(dists["zero"].choices) == [0, 1]
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=3))
    seen = set()
    for _ in range(6):
        trial = study.ask()
        z = trial._suggest("zero", dists["zero"])
        cfg = _compose(f"zero={z}", f"optim.lr={trial._suggest('optim.lr', dists['optim.lr'])}")
        assert cfg.zero.stage == z
        seen.add(z)
    assert seen == {0, 1}


# ---- through `launch`, as a user types it -----------------------------------------------------




@pytest.mark.parametrize("overrides,points", [
    (["seed=1,2,3", "optim.lr=choice(1e-3,3e-3)"], 6),
    (["seed=range(0,1000)", "train.steps=range(10,40,10)"], 3000),
    (["optim.lr=range(0,1,0.1)"], 10),  # a float range: counted as Hydra expands it
    (["seed=1,2", "hydra.sweep.dir=x,y", "zero=0"], 2),  # hydra's own keys are no points
    (["optim.lr=interval(0,1)"], None),  # a sweeper's search space: no grid
    (["zero=glob(*)"], None),  # the options on the search path: counted as points, once composed
])
def test_a_grid_is_counted_from_its_overrides_alone(overrides, points):
    from launcher.config.compose import grid_points

    assert grid_points(overrides) == points


def test_a_grid_past_submit_max_points_is_refused_naming_the_key():
    from launcher.app import grid_too_large

    err = grid_too_large(["-m", "seed=range(0,1000)", "optim.lr=range(0,1000)"])
    assert err is not None and err.key == "submit.max_points" and "1,000,000 points" in err.problem
    assert "submit.max_points=1000000" in err.fix
    assert grid_too_large(["-m", "seed=range(0,1000)", "optim.lr=range(0,1000)", "submit.max_points=1000000"]) is None
    assert grid_too_large(["seed=1"]) is None and grid_too_large(["-m", "seed=1,2"]) is None
    # a sweeper that sizes its own trials (Optuna's n_trials) is not a grid
    assert grid_too_large(["-m", "hydra/sweeper=optuna", "seed=range(0,1000)", "optim.lr=range(0,1000)"]) is None
