"""Engines for any nn.Module (docs/training-api.md). Node side (torch)::

    from launcher.training.engines import build_engine
    engine = build_engine(cfg, ctx, lambda: MyNet(...))   # by ctx.layout.engine: ddp | fsdp | deepspeed

``model_fn`` builds the user's module; the engine builds it shard-first and initialises it the same on
every layout (``build``), and trains it by its ``ModelContract`` (``contract``: loss, blocks, init, TP
plan; None: ``contract_for``'s default). Every engine implements ``Engine``, so
``launcher.training.Checkpointer`` and ``StepLoop`` drive it as they drive a recipe's own engines.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional

from torch import nn

from launcher.training.engines.contract import (
    ModelContract,
    contract_for,
    hf_causal_lm_contract,
    plain_contract,
)
from launcher.training.engines.engine import Batch, Engine

if TYPE_CHECKING:
    from launcher.config.schema import RunConfig

ENGINES = ("ddp", "fsdp", "deepspeed")


def build_engine(cfg: RunConfig, ctx: Any, model_fn: Callable[[], nn.Module],
                 contract: Optional[ModelContract] = None) -> Engine:
    """The engine of the run's layout (``ctx.layout.engine``, resolved and checked at launch) over the
    model ``model_fn()`` builds."""
    name = ctx.layout.engine
    if int(ctx.layout.pp) > 1 or (int(ctx.layout.tp) > 1 and name != "fsdp"):
        raise ValueError(f"launcher.training.engines run data parallelism (ddp, fsdp, deepspeed), and tensor "
                         f"parallelism on fsdp only, but the layout has engine {name} tp={ctx.layout.tp} "
                         f"pp={ctx.layout.pp}: set parallelism.pp=1 (and parallelism.tp=1 off fsdp)")
    if name == "ddp":
        from launcher.training.engines.ddp import DDPEngine

        return DDPEngine(cfg, ctx, model_fn, contract)
    if name == "fsdp":
        from launcher.training.engines.fsdp import FSDPEngine

        return FSDPEngine(cfg, ctx, model_fn, contract)
    if name == "deepspeed":
        from launcher.training.engines.deepspeed import DeepSpeedEngine

        return DeepSpeedEngine(cfg, ctx, model_fn, contract)
    raise ValueError(f"layout engine {name!r} is not one of {', '.join(ENGINES)} (the megatron engine is a recipe's "
                     "own; use one of those, parallelism=dp, fsdp or zero)")


__all__ = ["Batch", "ENGINES", "Engine", "ModelContract", "build_engine", "contract_for", "hf_causal_lm_contract",
           "plain_contract"]
