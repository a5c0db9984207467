"""What only the GPT's engines share: the GPT built alike on every rank, and their evaluation helpers.
The Engine interface and the helpers of every engine (dtype, AdamW and its param groups, the fp16 loss
scaler, byte counts) are ``launcher.training.engines.engine``'s."""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Iterator

import torch
import torch.distributed as dist
from torch import nn

from launcher.config.schema import enum_value
from launcher.config.seeding import dropout_seed
from launcher.training.engines import ModelContract
from recipes.common.seeding import seed_everything
from recipes.gpt.init import init_values
from recipes.gpt.model import GPT

if TYPE_CHECKING:
    from recipes.gpt.schema import GPTRunConfig


def build_model(cfg: GPTRunConfig, rank_for_dropout: int) -> GPT:
    """The full GPT with the same init on every rank (seeded before construction); dropout
    masks then differ per data-parallel replica."""
    seed_everything(int(cfg.seed))
    model = GPT(cfg.model, recompute=enum_value(cfg.train.recompute), seed=int(cfg.seed))
    torch.manual_seed(dropout_seed(int(cfg.seed), rank_for_dropout))
    return model


@contextlib.contextmanager
def evaluating(module: nn.Module) -> Iterator[None]:
    """``module`` in eval mode (no dropout) under no_grad, back in its former mode afterwards."""
    was = module.training
    module.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        module.train(was)


def mean_over(loss_sum: torch.Tensor, count: int, group: Any = None, world: int = 1) -> float:
    """``loss_sum`` (a sum of ``count`` micro-batch losses on each of ``world`` ranks of ``group``)
    summed over the group and divided by every micro batch: the same float on every rank. (Not the
    generic engines' ``mean_over_ranks``: that divides by the count before the all-reduce, in the
    tensor's dtype, and the GPT's evaluation keeps its own numerics.)"""
    if world > 1:
        dist.all_reduce(loss_sum, op=dist.ReduceOp.SUM, group=group)
    return float(loss_sum.item()) / (count * world)


def gpt_contract(cfg: GPTRunConfig) -> ModelContract:
    """forward(tokens, labels) is the loss; the blocks are ``model.blocks``; a module's parameters get
    ``init_values`` by their full name (a tied head is the embedding's parameter, initialised once); the
    GPT recomputes by itself (train.recompute, selective included)."""
    seed, layers = int(cfg.seed), int(cfg.model.num_layers)

    def init(model: nn.Module, module: nn.Module, name: str) -> None:
        for pname, p in module.named_parameters(recurse=False):
            p.copy_(init_values(seed, f"{name}.{pname}" if name else pname, p.shape, layers))

    return ModelContract(loss=lambda module, batch: module(batch[0], labels=batch[1]),
                         blocks=lambda model: list(model.blocks), init=init, recompute_blocks=False, name="gpt")
