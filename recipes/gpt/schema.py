"""The GPT recipe's config schema: its ``model`` group (conf/model/, composed only when the recipe is
picked: conf/recipe/gpt.yaml's defaults) and ``ModelSpec``, the shape its rules and planner read.

``GPTRunConfig`` is the launcher's RunConfig with the ``model`` group; the contract declares it
(``RecipeSpec.schema``), and the launcher types, checks and bounds its keys as it does its own.
Light: the login side imports it (no torch).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING

from launcher.layout import ModelSpec
from launcher.schema import RunConfig, num


@dataclass
class ModelConfig:
    name: str = MISSING
    num_layers: int = num(MISSING, ge=1)
    hidden_size: int = num(MISSING, ge=1)
    num_heads: int = num(MISSING, ge=1)
    ffn_hidden_size: int = num(MISSING, ge=1)
    vocab_size: int = num(MISSING, ge=1)
    seq_len: int = num(MISSING, ge=1)
    dropout: float = num(0.0, ge=0.0, lt=1.0, fix="set model.dropout=0.0")
    tie_embeddings: bool = True


@dataclass
class GPTRunConfig(RunConfig):
    model: ModelConfig = field(default_factory=ModelConfig)


# keys whose bound rows are sizes (checked before any rule divides by them), read from Facts.model
SIZES = tuple(f"model.{n}" for n in ("num_layers", "hidden_size", "num_heads", "ffn_hidden_size", "vocab_size",
                                     "seq_len"))


def facts(cfg: Any) -> ModelSpec:
    """What ``launcher.layout.Facts.model`` holds for a GPT run."""
    return ModelSpec.from_cfg(cfg.model)
