"""Training engines: how one optimizer step is computed over a layout.

Every engine implements ``launcher.training.engines.engine.Engine``; ``build_engine`` picks one by
the engine of the run's layout (``ctx.layout.engine``: ddp, deepspeed, megatron, or fsdp: the generic
FSDP2 engine of ``launcher.training.engines`` with the GPT's init; resolved and
checked at launch, never recomputed here). The step loop in ``recipes.gpt.train``
is shared, so data order, schedule, metrics and fault injection are identical across engines.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from launcher.training.engines.engine import Engine

if TYPE_CHECKING:
    from recipes.gpt.schema import GPTRunConfig


def build_engine(cfg: GPTRunConfig, ctx: Any) -> Engine:
    name = ctx.layout.engine
    if name == "ddp":
        from recipes.gpt.engines.ddp import DDPEngine

        return DDPEngine(cfg, ctx)
    if name == "deepspeed":
        from recipes.gpt.engines.deepspeed import DeepSpeedEngine

        return DeepSpeedEngine(cfg, ctx)
    if name == "fsdp":
        from recipes.gpt.engines.fsdp import fsdp_engine

        return fsdp_engine(cfg, ctx)
    if name == "megatron":
        from recipes.gpt.engines.megatron import MegatronEngine

        return MegatronEngine(cfg, ctx)
    raise ValueError(f"layout engine {name!r} is not one of ddp, deepspeed, fsdp, megatron")
