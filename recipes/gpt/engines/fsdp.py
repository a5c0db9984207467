"""The GPT on the fsdp engine: torch FSDP2 from ``launcher.training.engines`` (one unit per decoder
block), with the GPT's own shard-stable init (``recipes.gpt.init``) as the contract's init, so the
weights it starts from are bitwise those of every other GPT layout."""
from __future__ import annotations

from typing import Any

from torch import nn

from launcher.schema import enum_value
from launcher.training.engines import Engine, ModelContract, build_engine
from recipes.gpt.init import init_values
from recipes.gpt.model import GPT


def gpt_contract(cfg: Any) -> ModelContract:
    """forward(tokens, labels) is the loss; the blocks are ``model.blocks``; a module's parameters get
    ``init_values`` by their full name (a tied head is the embedding's parameter, initialised once); the
    GPT recomputes by itself (train.recompute, selective included)."""
    seed, layers = int(cfg.seed), int(cfg.model.num_layers)

    def init(model: nn.Module, module: nn.Module, name: str) -> None:
        for pname, p in module.named_parameters(recurse=False):
            p.copy_(init_values(seed, f"{name}.{pname}" if name else pname, p.shape, layers))

    return ModelContract(loss=lambda module, batch: module(batch[0], labels=batch[1]),
                         blocks=lambda model: list(model.blocks), init=init, recompute_blocks=False, name="gpt")


def fsdp_engine(cfg: Any, ctx: Any) -> Engine:
    recompute = enum_value(cfg.train.recompute)
    return build_engine(cfg, ctx, lambda: GPT(cfg.model, recompute=recompute, seed=None), gpt_contract(cfg))
