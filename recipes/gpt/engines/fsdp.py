"""The GPT on the fsdp engine: torch FSDP2 from ``launcher.training.engines`` (one unit per decoder
block), with the GPT's own shard-stable init (``recipes.gpt.init``) as the contract's init, so the
weights it starts from are bitwise those of every other GPT layout."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from launcher.config.schema import enum_value
from launcher.training.engines import Engine, build_engine
from recipes.gpt.engines.base import gpt_contract
from recipes.gpt.model import GPT

if TYPE_CHECKING:
    from recipes.gpt.schema import GPTRunConfig


def fsdp_engine(cfg: GPTRunConfig, ctx: Any) -> Engine:
    recompute = enum_value(cfg.train.recompute)
    return build_engine(cfg, ctx, lambda: GPT(cfg.model, recompute=recompute, seed=None), gpt_contract(cfg))
