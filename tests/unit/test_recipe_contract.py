"""The recipe contract (launcher.config.recipe_contract): a user's recipe is held only to the shared rules, is
named after itself and gets no GPT plan; the GPT recipe's rows, planner and steps come from its own
contract (recipes/gpt/contract.py), commbench's settings check from its."""
from __future__ import annotations

import sys

import pytest
from hydra import compose, initialize_config_dir

from launcher.app import CONF_DIR, normalize_overrides
from launcher.config import recipe_contract, rules
from launcher.submit.pipeline import InvalidSweep, Point, validate

GPT = "recipes.gpt.train.main"
# 3 processes, micro batch 4, global batch 16: 16 is not a multiple of 3*4, the GPT's batch rule
THREE = ["cluster.gpus_per_node=3"]


@pytest.fixture
def user_recipe(tmp_path, monkeypatch):
    """A user's package ``mlp`` whose main(cfg, ctx) never reads train.global_batch_size; no contract."""
    pkg = tmp_path / "mlp"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "train.py").write_text("def main(cfg, ctx):\n    return {'final_loss': 0.5}\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "mlp.train.main"
    sys.modules.pop("mlp", None)


def _cfg(*overrides):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=normalize_overrides(list(overrides)))


def _validate(*overrides):
    return validate([Point(_cfg(*overrides), list(overrides))])


@pytest.mark.usefixtures("cpu_host")  # its premise: local processes on the CPU
def test_a_user_recipe_is_not_held_to_the_gpt_rules(user_recipe):
    with pytest.raises(InvalidSweep, match="train.global_batch_size: 16 is not a multiple of dp"):
        _validate(*THREE)  # the GPT recipe (the default) on the same processes: refused
    (c,) = _validate(f"recipe._target_={user_recipe}", *THREE)
    assert c.layout.dp == 3 and c.layout.world_size == 3 and c.layout.grad_accum == 1
    assert c.resolved["name"] == "mlp" and c.resolved["submit"]["job_name"] == "mlp"  # not gpt_tiny
    assert c.plan is None  # no GPT plan: nothing for show / report to print
    # nor a GPT model rule (a tp the GPT's heads cannot be split over is the shared layout's business only)
    (c,) = _validate(f"recipe._target_={user_recipe}", "cluster.gpus_per_node=3", "parallelism.tp=3",
                     "parallelism.engine=megatron")
    assert c.layout.tp == 3


def test_a_user_recipe_is_still_held_to_the_shared_rules(user_recipe):
    with pytest.raises(InvalidSweep, match="parallelism.tp"):
        _validate(f"recipe._target_={user_recipe}", *THREE, "parallelism.tp=2")  # 2 does not divide 3
    with pytest.raises(InvalidSweep, match="cluster.nodes"):
        _validate(f"recipe._target_={user_recipe}", "cluster.nodes=0")


def test_the_gpt_contract_holds_its_rows_planner_steps_and_name():
    gpt = recipe_contract.of(GPT)
    assert gpt.planner is not None and gpt.steps_key == "train.steps" and gpt.named_by_model
    shared = {(r.key, r.problem) for r in rules.RULES}
    own = {(r.key, r.problem) for r in gpt.rules}
    assert not shared & own and {r.key for r in gpt.rules} >= {"train.global_batch_size", "model.num_heads",
                                                                 "model.ffn_hidden_size", "model.vocab_size"}
    assert len(rules.table(GPT)) == len(rules.RULES) + len(gpt.rules)
    assert rules.table("mlp.train.main") == tuple(sorted(rules.RULES, key=lambda r: rules.ALL_KINDS.index(r.kind)))
    assert recipe_contract.run_name(GPT, "gpt_125m") == "gpt_125m"
    assert recipe_contract.run_name("mlp.train.main", "gpt_125m") == "mlp"
    assert recipe_contract.steps(GPT, {"train.steps": 60}.get) == 60
    assert recipe_contract.steps("mlp.train.main", {"train.steps": 60}.get) is None
    assert recipe_contract.of("mlp.train.main") is recipe_contract.NO_CONTRACT


def test_commbench_settings_are_checked_by_its_contract():
    bench = recipe_contract.of("recipes.commbench.bench.main")
    assert bench.check is not None and bench.name == "commbench"
    with pytest.raises(InvalidSweep, match=r"recipe.params: recipe.params.factor=1 must be >= 2"):
        _validate("recipe=commbench", "recipe.params.factor=1")


def test_finding_a_contract_imports_nothing_of_a_recipe_without_one(user_recipe):
    sys.modules.pop("mlp", None)
    assert recipe_contract.of("mlp.other.main") is recipe_contract.NO_CONTRACT
    assert "mlp" not in sys.modules  # found by spec: the user's package is not imported


def test_launcher_plan_refuses_a_recipe_without_a_planner(user_recipe, capsys):
    from launcher.cli.main import main

    assert main(["plan", f"recipe._target_={user_recipe}"]) == 2
    assert "has no planner" in capsys.readouterr().err
    assert main(["plan", "--json"]) == 0  # the GPT's (the default recipe's) planner


def test_the_launcher_code_names_no_recipe():
    """What the launcher knows of a recipe is in its contract: no line of launcher/ or hydra_plugins/
    code (strings, names, docstrings and comments alike, as `grep` reads it) names one."""
    import re
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    pattern = re.compile(r"gpt|commbench|RECIPE_SETTINGS|PLANNED_RECIPES|DEEPSPEED_CONFIG", re.I)
    bad = [f"{path.relative_to(repo).as_posix()}:{n}: {line.strip()[:60]!r}"
           for root in ("launcher", "hydra_plugins") for path in sorted((repo / root).rglob("*.py"))
           for n, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert not bad, bad


def test_a_broken_contract_is_a_config_error(user_recipe, tmp_path):
    (tmp_path / "mlp" / "contract.py").write_text("import no_such_module_here\n")
    with pytest.raises(InvalidSweep, match=r"recipe._target_: its contract mlp.contract cannot be loaded: "
                                           r"ModuleNotFoundError"):
        _validate(f"recipe._target_={user_recipe}", *THREE)


@pytest.mark.usefixtures("cpu_host")  # its premise: local processes on the CPU
def test_a_user_recipe_declares_its_own_rows_name_and_steps(tmp_path, monkeypatch):
    """A project's recipe with a contract, run from the project's dir (not on sys.path, as `launch`
    finds it): its rows, name and steps are the launcher's for its runs."""
    pkg = tmp_path / "myproj"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "train.py").write_text("def main(cfg, ctx):\n    return {}\n")
    (pkg / "contract.py").write_text(
        "from launcher.config.recipe_contract import RecipeSpec\n"
        "from launcher.config.rules import RUN, Rule\n\n"
        "RECIPE = RecipeSpec(name='mine', steps_key='train.steps', rules=(\n"
        "    Rule('cluster.gpus_per_node', lambda f: f.world % 2 == 1, 'my model splits in two',\n"
        "         'use an even world size', RUN),))\n")
    monkeypatch.chdir(tmp_path)
    try:
        with pytest.raises(InvalidSweep, match="cluster.gpus_per_node: my model splits in two"):
            _validate("recipe._target_=myproj.train.main", *THREE)
        (c,) = _validate("recipe._target_=myproj.train.main", "cluster.gpus_per_node=4")
        assert c.resolved["name"] == "mine" and c.layout.grad_accum == 1 and c.plan is None
        assert recipe_contract.steps("myproj.train.main", {"train.steps": 60}.get) == 60
    finally:
        for m in [m for m in sys.modules if m == "myproj" or m.startswith("myproj.")]:
            sys.modules.pop(m)


@pytest.mark.usefixtures("cpu_host")  # its premise: local processes on the CPU
def test_the_model_group_is_the_gpt_recipes_own(user_recipe):
    """The GPT's schema (recipes/gpt/schema.py) is composed only for it: a user's recipe has no `model`
    section (neither picked over the default option nor when typed from its archive); the GPT's keys
    are typed and bounded as the launcher's are."""
    from launcher.config import schema

    (c,) = _validate(f"recipe._target_={user_recipe}")
    assert "model" not in c.resolved and c.layout.world_size == 2
    assert "model" not in schema.typed(c.resolved)
    assert "model" not in _cfg("recipe=commbench")
    assert _cfg("model=gpt_125m", "+model.extra=1").model.extra == 1  # Hydra adds it; the rules refuse it
    (c,) = _validate("model=gpt_125m", "cluster.gpu.memory_gb=80", "train.micro_batch_size=1")
    assert c.resolved["model"]["name"] == "gpt_125m" and c.plan is not None
    with pytest.raises(Exception, match="model.num_layers"):
        _cfg("model.num_layers=abc")  # Hydra's type check names the key
    with pytest.raises(InvalidSweep, match=r"model.num_heads: must be a positive integer, got 0"):
        _validate("model.num_heads=0")
    with pytest.raises(InvalidSweep, match=r"model.extra: is not a key of the run config"):
        _validate("+model.extra=1")


def test_a_model_group_the_user_asks_for_is_kept_for_their_recipe_and_typed(user_recipe):
    """A user's recipe built on the GPT's model (`model=gpt_tiny model.dropout=0.1
    recipe._target_=...`): the group the overrides name is kept, never silently dropped, and typed by
    the GPT's schema when the run's archived config is read back (the job's `typed`)."""
    from launcher.config import schema

    (c,) = _validate(f"recipe._target_={user_recipe}", "model=gpt_tiny", "model.dropout=0.1")
    assert c.resolved["model"]["dropout"] == 0.1 and c.resolved["model"]["name"] == "gpt_tiny"
    cfg = schema.typed(c.resolved)
    assert cfg.model.dropout == 0.1 and cfg.model.num_layers == c.resolved["model"]["num_layers"]
    assert schema.override_groups(["+model.x=1", "~zero", "model@m=a", "++optim.lr=1", "seed=2"]) == \
        {"model", "zero", "optim", "seed"}
    (c,) = _validate(f"recipe._target_={user_recipe}", "seed=3")  # not asked for: not there
    assert "model" not in c.resolved


def test_calibrating_runs_of_a_recipe_without_a_planner_is_refused(tmp_path, capsys):
    """`launcher plan --calibrate` finds the planner through the runs' recipe's contract."""
    from launcher.cli.main import main

    run = tmp_path / "r1"
    run.mkdir()
    (run / "config.yaml").write_text("recipe:\n  _target_: mlp.train.main\n")
    assert main(["plan", "--calibrate", str(run), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "mlp.train.main: its recipe has no planner to calibrate" in err and "nothing was written" in err
