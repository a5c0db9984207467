"""recipe=lm (recipes/lm): any nn.Module trained as a causal LM. Dry runs of `recipe=lm model=hf_llama_tiny`
and of a user's own module (a package written outside the tree, found from the launch dir), the model built
from its config group as the job builds it, and every mistake refused at launch naming its key: no
model, a typo'd class, a module that is not there, an engine that is not for any module, and
hf_llama_tiny picked without recipe=lm (the GPT recipe's model group)."""
from __future__ import annotations

import sys

import pytest
from hydra import compose, initialize_config_dir

from launcher.app import CONF_DIR, normalize_overrides
from launcher.submit.pipeline import InvalidSweep, Point, validate

USER_NET = '''import torch


class Net(torch.nn.Module):
    def __init__(self, vocab, hidden=16):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, hidden)
        self.head = torch.nn.Linear(hidden, vocab)

    def forward(self, tokens):
        return self.head(self.emb(tokens))
'''


@pytest.fixture
def user_net(tmp_path, monkeypatch):
    """A user's package ``mynet`` (outside the tree, not on sys.path: `launch` runs from its dir)."""
    pkg = tmp_path / "mynet"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "net.py").write_text(USER_NET)
    monkeypatch.chdir(tmp_path)
    yield "mynet.net.Net"
    for m in [m for m in sys.modules if m == "mynet" or m.startswith("mynet.")]:
        sys.modules.pop(m)


def _cfg(*overrides):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=normalize_overrides(list(overrides)))


def _validate(*overrides):
    (c,) = validate([Point(_cfg(*overrides), list(overrides))])
    return c


def _refused(*overrides) -> str:
    with pytest.raises(InvalidSweep) as ei:
        _validate(*overrides)
    return str(ei.value)


@pytest.mark.parametrize("engine,picked", [("parallelism=fsdp", "fsdp"), ("zero=3", "deepspeed"),
                                           ("parallelism=dp", "ddp")])
@pytest.mark.usefixtures("cpu_host")  # its premise: local processes on the CPU
def test_hf_llama_tiny_dry_run_is_named_after_it_and_never_imports_transformers(engine, picked):
    sys.modules.pop("recipes.lm.hf", None)
    c = _validate("recipe=lm", "model=hf_llama_tiny", engine, "cluster.gpus_per_node=2")
    assert "recipes.lm.hf" not in sys.modules  # the factory is found by its source, never imported
    assert c.resolved["name"] == "hf_llama_tiny" and c.layout.engine == picked and c.layout.dp == 2
    model = c.resolved["model"]
    assert model["_target_"] == "recipes.lm.hf.causal_lm"
    # the LlamaConfig's vocabulary and positions are the data's shape (lm.*), dropout off
    assert model["config"]["vocab_size"] == c.resolved["lm"]["vocab_size"] == 512
    assert model["config"]["max_position_embeddings"] == c.resolved["lm"]["seq_len"] == 64
    assert model["config"]["attention_dropout"] == 0.0
    assert c.plan is None  # no GPT planner for any module


def test_a_users_module_with_its_own_arguments_dry_runs(user_net):
    c = _validate("recipe=lm", f"model._target_={user_net}", "+model.hidden=32", "+model.vocab=${lm.vocab_size}",
                  "lm.vocab_size=128")
    assert c.resolved["model"] == {"_target_": user_net, "hidden": 32, "vocab": 128}
    assert c.resolved["name"] == "lm" and c.layout.engine == "ddp"


def test_the_model_is_built_from_its_group_as_the_job_builds_it(user_net):
    from recipes.lm.train import model_fn

    cfg = _cfg("recipe=lm", f"model._target_={user_net}", "+model.hidden=8", "+model.vocab=${lm.vocab_size}",
               "+model.name=mine", "lm.vocab_size=32")
    sys.path.insert(0, ".")  # the job imports the user's package from its code snapshot
    try:
        net = model_fn(cfg.model)()
    finally:
        sys.path.remove(".")
    assert type(net).__name__ == "Net" and net.emb.weight.shape == (32, 8)  # model.name is not an argument


def test_hf_llama_tiny_builds_a_llama_of_its_config():
    pytest.importorskip("transformers")
    from recipes.lm.train import model_fn

    cfg = _cfg("recipe=lm", "model=hf_llama_tiny")
    model = model_fn(cfg.model)()
    assert type(model).__name__ == "LlamaForCausalLM"
    c = model.config
    assert (c.vocab_size, c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.max_position_embeddings) == \
        (512, 64, 2, 4, 64)
    assert c._attn_implementation == "eager" and c.attention_dropout == 0.0


def test_no_model_is_refused_naming_model_target():
    text = _refused("recipe=lm")
    assert "- model._target_: must be set" in text and "model=hf_llama_tiny" in text


def test_a_typod_class_or_a_missing_module_is_refused_before_queueing(user_net):
    text = _refused("recipe=lm", "model._target_=mynet.net.Nett", "+model.vocab=8")
    assert "- model._target_: mynet.net" in text and "has no name 'Nett'" in text
    text = _refused("recipe=lm", "model._target_=nosuchpkg.net.Net")
    assert "- model._target_: module 'nosuchpkg' of 'nosuchpkg.net.Net' is not importable here" in text
    assert "nothing was submitted" in text


def test_the_megatron_engine_is_not_for_any_module():
    text = _refused("recipe=lm", "model=hf_llama_tiny", "cluster.gpus_per_node=2", "parallelism.tp=2")
    assert "- parallelism.engine: megatron (tp=2, pp=1) is the GPT's Megatron-style engine" in text


def test_the_batch_and_data_rules_hold_for_any_module():
    text = _refused("recipe=lm", "model=hf_llama_tiny", "cluster.gpus_per_node=3")  # 16 % (3*4) != 0
    assert "- train.global_batch_size: 16 is not a multiple of dp*micro_batch_size" in text
    text = _refused("recipe=lm", "model=hf_llama_tiny", "lm.vocab_size=2")
    assert "- data.branching: 4 successors per token cannot be drawn from a vocabulary of lm.vocab_size=2" in text
    assert "- lm.seq_len: must be a positive integer, got 0" in _refused("recipe=lm", "model=hf_llama_tiny",
                                                                         "lm.seq_len=0")


@pytest.mark.parametrize("model", [("recipe=gpt", "model=hf_llama_tiny"), ("model._target_=mypkg.net.Net",)])
def test_a_model_for_recipe_lm_under_the_gpt_recipe_names_recipe_lm(model):
    text = _refused(*model)
    assert "- model._target_:" in text and "any other module trains with recipe=lm" in text
    assert "add recipe=lm" in text
    assert "num_layers" not in text  # the GPT's shape rows say nothing of a model that is not a GPT


def test_a_model_option_that_is_a_module_selects_recipe_lm():
    """`model=hf_llama_tiny` alone is `recipe=lm model=hf_llama_tiny` (the option names a _target_; the
    GPT's options do not): added before Hydra composes, so the overrides record it."""
    from launcher.app import recipe_for_model

    assert recipe_for_model(["model=hf_llama_tiny", "parallelism=fsdp"]) == (
        ["recipe=lm", "model=hf_llama_tiny", "parallelism=fsdp"], "recipe=lm")
    for kept in (["model=gpt_125m"], ["recipe=gpt", "model=hf_llama_tiny"], ["model=gpt_tiny,hf_llama_tiny"],
                 ["recipe._target_=mypkg.train.main", "model=hf_llama_tiny"], ["model=no_such_option"], []):
        assert recipe_for_model(kept) == (kept, None)
    c = _validate("model=hf_llama_tiny")
    assert c.resolved["recipe"]["_target_"] == "recipes.lm.train.main" and c.resolved["name"] == "hf_llama_tiny"


def test_a_tokenized_dataset_is_checked_against_the_data_shape_lm(tmp_path):
    from launcher.data.manifest import write_dataset

    ds = tmp_path / "ds"
    write_dataset(ds, {"train": [[(i * 7 + j) % 900 + 1 for j in range(40)] for i in range(30)], "val": [[5, 6, 7]]},
                  vocab_size=1000, eos_id=0, tokenizer_json='{"model": {"vocab": {}}}')
    lm = ["recipe=lm", "model=hf_llama_tiny", "data=tokens", f"data.path={ds}"]
    text = _refused(*lm, "data.packing=false", "lm.vocab_size=512")  # lm.seq_len=64: documents of 41 tokens
    assert "- lm.vocab_size: 512 is smaller than the tokenizer's vocabulary of 1000 tokens" in text
    assert "set lm.vocab_size=1000 or more" in text
    assert "- lm.seq_len: 64 needs documents of seq_len+1 = 65 tokens" in text
    c = _validate(*lm, "lm.vocab_size=1024", "lm.seq_len=32")
    assert c.resolved["model"]["config"]["vocab_size"] == 1024  # the model's embedding follows the data's shape
    c = _validate(*lm, "lm.seq_len=32")  # unset: the dataset's vocabulary
    assert c.resolved["lm"]["vocab_size"] == c.resolved["model"]["config"]["vocab_size"] == 1000


@pytest.mark.timeout(120)
def test_the_loop_trains_a_users_module_in_one_process_with_eval(user_net, tmp_path):
    """recipes.lm.train.main in this process (a world of 1, gloo): the loss falls, the eval loss of the
    validation split is in the metrics every data.eval_every steps and at the end."""
    import json

    import torch.distributed as dist
    from omegaconf import OmegaConf

    from launcher.config import schema
    from launcher.config.rules import resolve
    from launcher.run.rundir import RunDir
    from launcher.runtime.context import RunContext
    from recipes.lm.train import main

    composed = _cfg("recipe=lm", f"model._target_={user_net}", "+model.vocab=${lm.vocab_size}", "lm.vocab_size=64",
                    "lm.seq_len=16", "train.steps=6", "data.eval_every=4", "optim.lr=1e-2",
                    "wandb.enabled=false",  # default off: the pure tier starts no process (wandb's service is one)
                    "train.log_interval=0", "cluster.gpus_per_node=1")
    cfg = schema.typed(OmegaConf.to_container(composed, resolve=True))
    run = tmp_path / "run"
    run.mkdir()
    ctx = RunContext(rank=0, world_size=1, local_rank=0, local_world_size=1, node_rank=0, hostname="localhost",
                     rundir=RunDir(run), layout=resolve(cfg), device="cpu", backend="gloo")
    dist.init_process_group("gloo", init_method=f"file://{run / 'store'}", rank=0, world_size=1)
    sys.path.insert(0, ".")  # the job imports the user's package from its code snapshot
    try:
        summary = main(cfg, ctx)
    finally:
        sys.path.remove(".")
        ctx.close()
        dist.destroy_process_group()
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert [r["step"] for r in rows if "eval_loss" in r] == [4, 6]
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.1, rows
    assert summary["final_eval_loss"] == rows[-1]["eval_loss"] and summary["params"] == 64 * 16 + 16 * 64 + 64


def test_the_snapshot_holds_a_users_module_the_launchers_recipe_builds(user_net, tmp_path):
    """`launch recipe=lm model._target_=mynet.net.Net` from the user's project (not in git): the code
    snapshot is the project, where the job imports the module from (the recipe is the launcher's)."""
    from pathlib import Path

    from launcher.submit import pipeline

    c = _validate("recipe=lm", f"model._target_={user_net}", "+model.vocab=8")
    targets = pipeline.config_targets(c.resolved)
    assert sorted(targets) == sorted(["recipes.lm.train.main", user_net])
    assert pipeline.source_root(Path.cwd(), targets) == tmp_path
    assert pipeline.source_root(Path.cwd(), ["recipes.lm.train.main"]) != tmp_path  # the recipe alone: not here
