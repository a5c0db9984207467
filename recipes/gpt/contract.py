"""The GPT recipe's contract with the launcher (launcher.config.recipe_contract): its config schema (the
``model`` group, recipes/gpt/schema.py) and the model shape its rules read, the rows of the rule table
only a GPT run is held to (heads, ffn, vocab and layers against tp and pp, the batch splitting into
micro batches, the 1F1B pipeline's micro batches, the data's vocabulary, the warm-up), its planner (the
estimators of recipes.gpt.plan: memory fits, bubble, ZeRO-3 link; plan.json; `launcher plan` and its
calibration; the report's calibration; what fits a preflight rung), the step count progress
shows and runs named after the model. Light: the login side imports
it (no torch).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from launcher.config.recipe_contract import RecipeSpec
from launcher.config.rules import RUN, VALUE, Rule, bound_rows
from launcher.data import checks as data_checks
from recipes.common.rules import BATCH_SPLITS, WARMUP_WITHIN_STEPS
from recipes.gpt import schema

if TYPE_CHECKING:
    from recipes.gpt.schema import GPTRunConfig


def _plan(cfg: GPTRunConfig, layout: Any) -> Any:
    from recipes.gpt.plan import checks  # the estimators: only a launch that plans pays for them

    return checks.evaluate(cfg, layout)


def _plan_command(cfg: GPTRunConfig, args: Any) -> int:
    from recipes.gpt.plan import cli  # the planner's commands: only `launcher plan` pays for them

    return cli.plan_command(cfg, args)


def _calibrate_command(run_dirs: Any, args: Any) -> int:
    from recipes.gpt.plan import cli

    return cli.calibrate_command(run_dirs, args)


def _calibration(run_dir: Any, layout: Any, overrides: Any) -> Any:
    from recipes.gpt.plan import calibrate  # only a report of a run pays for it

    return calibrate.view(run_dir, layout, overrides)


def _fits(cfg: GPTRunConfig, num_layers: int, layout: Any, recompute: str, dtype: str) -> bool:
    from recipes.gpt.plan import checks

    return checks.fits(cfg, num_layers, layout, recompute, dtype)


# a model for recipe=lm (it has a _target_) composed into the GPT's model group: the recipe it needs
NOT_THE_GPT = Rule("model._target_", lambda f: bool(f.values.get("model._target_")),
                   lambda f: (f"{f.values.get('model._target_')} is not the GPT this recipe builds: "
                              "any other module trains with recipe=lm"),
                   "add recipe=lm (docs/models.md)", VALUE)  # VALUE: alone, no shape rows of a model it is not

RULES = (
    NOT_THE_GPT,
    *bound_rows(schema.GPTRunConfig, schema.SIZES),  # the model group's bounds (recipes/gpt/schema.py)
    BATCH_SPLITS,
    Rule("model.num_heads", lambda f: f.model.hidden_size % f.model.num_heads != 0,
         lambda f: f"hidden_size {f.model.hidden_size} is not divisible by num_heads {f.model.num_heads}",
         "pick num_heads dividing model.hidden_size"),
    Rule("model.num_heads", lambda f: f.model.num_heads % f.tp != 0,
         lambda f: f"{f.model.num_heads} heads cannot be split over tp={f.tp}",
         "make parallelism.tp divide model.num_heads"),
    Rule("model.ffn_hidden_size", lambda f: f.model.ffn_hidden_size % f.tp != 0,
         lambda f: f"{f.model.ffn_hidden_size} is not divisible by tp={f.tp}",
         "make parallelism.tp divide model.ffn_hidden_size"),
    Rule("model.vocab_size", lambda f: f.model.vocab_size % f.tp != 0,
         lambda f: f"{f.model.vocab_size} is not divisible by tp={f.tp}",
         "pad model.vocab_size to a multiple of parallelism.tp"),
    Rule("model.num_layers", lambda f: f.model.num_layers % f.pp != 0,
         lambda f: f"{f.model.num_layers} layers cannot be split evenly into pp={f.pp} stages",
         "make parallelism.pp divide model.num_layers"),
    Rule("train.global_batch_size",
         lambda f: f.resolved_engine == "megatron" and f.pp > 1 and f.grad_accum is not None and f.grad_accum < f.pp,
         lambda f: (f"gives {f.grad_accum} micro-batch(es) per step but the 1F1B pipeline has pp={f.pp} stages "
                    "and needs at least one micro-batch per stage"),
         lambda f: (f"raise train.global_batch_size to >= {f.pp * (f.per_step or 1)} or lower "
                    "train.micro_batch_size")),
    Rule("parallelism.sequence_parallel",
         lambda f: f.resolved_engine == "megatron" and f.sequence_parallel and f.model.seq_len % f.tp != 0,
         lambda f: f"model.seq_len={f.model.seq_len} cannot be split over tp={f.tp}",
         "make parallelism.tp divide model.seq_len, or set parallelism.sequence_parallel=false"),
    Rule("parallelism.tp", lambda f: f.resolved_engine == "fsdp" and f.tp > 1,
         lambda f: (f"the GPT declares no TP plan for the fsdp engine (tp={f.tp}): its tensor parallelism is the "
                    "megatron engine's"),
         "use parallelism=tp (or 3d) for the GPT's tensor parallelism, or parallelism.tp=1 with parallelism=fsdp"),
    WARMUP_WITHIN_STEPS,
    Rule("data.branching",
         lambda f: (isinstance(f.values.get("data.branching"), int)
                    and f.values.get("data.branching") > f.model.vocab_size),
         lambda f: (f"{f.values.get('data.branching')} successors per token cannot be drawn from a vocabulary of "
                    f"model.vocab_size={f.model.vocab_size} tokens"),
         "lower data.branching or raise model.vocab_size", RUN),
    Rule("model.vocab_size", lambda f: _tokenizer(f)[0] > f.model.vocab_size,
         lambda f: (f"{f.model.vocab_size} is smaller than the tokenizer's vocabulary of {_tokenizer(f)[0]} tokens "
                    f"(the dataset {_tokenizer(f)[1]}): its larger token ids would index past the embedding"),
         lambda f: (f"set model.vocab_size={-(-_tokenizer(f)[0] // f.tp) * f.tp} or more (a multiple of "
                    "parallelism.tp)"), RUN),
)


def _tokenizer(f: Any) -> Any:
    """(vocabulary, dataset) of the largest tokenizer among a data=tokens run's datasets; (0, "") else."""
    return data_checks.tokenizer_vocab(f.values.tree) or (0, "")


RECIPE = RecipeSpec(
    named_by_model=True,
    schema=schema.GPTRunConfig,
    facts=schema.facts,
    sizes=schema.SIZES,
    rules=RULES,
    planner=_plan,
    plan_command=_plan_command,
    calibrate_command=_calibrate_command,
    calibration=_calibration,
    fits=_fits,
    steps_key="train.steps",
    metrics=("loss", "eval_loss", "tokens_per_s", "samples_per_s", "step_time_s", "lr", "grad_norm", "tflops", "mfu",
             "activation_bytes", "peak_memory_bytes", "host_rss_bytes", "time_*_s"),
)
