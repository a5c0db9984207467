"""The lm recipe's contract with the launcher (launcher.config.recipe_contract): its schema (the open
``model`` group and the data's shape ``lm``, recipes/lm/schema.py), the rows only its runs are held to
(a model named and found before anything queues, the batch split, an engine it trains on, the
synthetic data's branching and a tokenized dataset's vocabulary within ``lm.vocab_size``), the step
count progress shows, runs named after ``model.name``. Light: the login side imports it (no torch, no
transformers).
"""
from __future__ import annotations

from typing import Any, Optional

from launcher.config.recipe_contract import RecipeSpec
from launcher.config.recipe_target import target_problem
from launcher.config.rules import RUN, Rule, bound_rows
from launcher.data import checks as data_checks
from recipes.common.rules import BATCH_SPLITS, WARMUP_WITHIN_STEPS
from recipes.lm import schema

ENGINES = ("ddp", "fsdp", "deepspeed")  # launcher.training.engines: any nn.Module


def _model_problem(f: Any) -> Optional[str]:
    """Why ``model._target_`` names no class or factory the job can build the model with, or None."""
    target = f.values.get("model._target_")
    if target in (None, "", "???"):
        return "must be set: the model's class or factory (the job builds it with hydra.utils.instantiate)"
    if not isinstance(target, str):
        return f"must be a dotted path, got {target!r}"
    problem = target_problem(target, recipe=False)
    return f"{problem}: the job could not build the model" if problem else None


RULES = (
    *bound_rows(schema.LMRunConfig, schema.SIZES),
    Rule("model._target_", lambda f: _model_problem(f) is not None, lambda f: _model_problem(f),
         "pick a model (model=hf_llama_tiny) or name your module: model._target_=mypkg.net.Net "
         "(its arguments: +model.hidden=32 ...)", RUN),
    BATCH_SPLITS,
    Rule("parallelism.engine", lambda f: f.resolved_engine not in ENGINES,
         lambda f: (f"{f.resolved_engine} (tp={f.tp}, pp={f.pp}) is the GPT's Megatron-style engine: recipe=lm "
                    f"trains any module on {', '.join(ENGINES)}"),
         "use parallelism=dp, parallelism=zero or parallelism=fsdp (tp > 1 there: with the model's TP plan)"),
    WARMUP_WITHIN_STEPS,
    Rule("data.branching",
         lambda f: (isinstance(f.values.get("data.branching"), int)
                    and f.values.get("data.branching") > f.model.vocab_size),
         lambda f: (f"{f.values.get('data.branching')} successors per token cannot be drawn from a vocabulary of "
                    f"lm.vocab_size={f.model.vocab_size} tokens"),
         "lower data.branching or raise lm.vocab_size", RUN),
    Rule("lm.vocab_size", lambda f: _tokenizer(f)[0] > f.model.vocab_size,
         lambda f: (f"{f.model.vocab_size} is smaller than the tokenizer's vocabulary of {_tokenizer(f)[0]} tokens "
                    f"(the dataset {_tokenizer(f)[1]}): its larger token ids would index past the model's embedding"),
         lambda f: f"set lm.vocab_size={_tokenizer(f)[0]} or more", RUN),
)


def _tokenizer(f: Any) -> Any:
    """(vocabulary, dataset) of the largest tokenizer among a data=tokens run's datasets; (0, "") else."""
    return data_checks.tokenizer_vocab(f.values.tree) or (0, "")

RECIPE = RecipeSpec(
    name="lm",
    named_by_model=True,
    schema=schema.LMRunConfig,
    facts=schema.facts,
    sizes=schema.SIZES,
    rules=RULES,
    steps_key="train.steps",
)
