"""The GPT recipe's config schema: its ``model`` group (conf/model/, composed only when the recipe is
picked: conf/recipe/gpt.yaml's defaults) and ``ModelSpec``, the shape its rules and planner read.

``GPTRunConfig`` is the launcher's RunConfig with the ``model`` group; the contract declares it
(``RecipeSpec.schema``), and the launcher types, checks and bounds its keys as it does its own.
Light: the login side imports it (no torch).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional

from omegaconf import MISSING

from launcher.config.schema import RunConfig, num


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
    # another recipe's model (recipe=lm: model=hf_llama_tiny, model._target_=mypkg.Net): composes here
    # only so that the contract can name the recipe that trains it (NOT_THE_GPT)
    _target_: Optional[str] = None
    config: Optional[Dict[str, Any]] = None


@dataclass
class GPTRunConfig(RunConfig):
    model: ModelConfig = field(default_factory=ModelConfig)


# keys whose bound rows are sizes (checked before any rule divides by them), read from Facts.model
SIZES = tuple(f"model.{n}" for n in ("num_layers", "hidden_size", "num_heads", "ffn_hidden_size", "vocab_size",
                                     "seq_len"))


@dataclass(frozen=True)
class ModelSpec:
    """The shape of a decoder-only transformer (the fields of ModelConfig): what the
    recipe's rules read (``Facts.model``) and what its planner's estimators take."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    ffn_hidden_size: int
    vocab_size: int
    seq_len: int
    tie_embeddings: bool = True
    dropout: float = 0.0

    @classmethod
    def from_cfg(cls, m: Any) -> ModelSpec:
        """From a ModelConfig-like object (DictConfig, dataclass or namespace)."""
        return cls(
            name=str(getattr(m, "name", "model")),
            num_layers=int(m.num_layers),
            hidden_size=int(m.hidden_size),
            num_heads=int(m.num_heads),
            ffn_hidden_size=int(m.ffn_hidden_size),
            vocab_size=int(m.vocab_size),
            seq_len=int(m.seq_len),
            tie_embeddings=bool(getattr(m, "tie_embeddings", True)),
            dropout=float(getattr(m, "dropout", 0.0) or 0.0),
        )



# the shape read for another recipe's model (it has no GPT shape): the contract's NOT_THE_GPT refuses it
NOT_A_GPT = ModelSpec("not_a_gpt", 1, 1, 1, 1, 1, 1)


def facts(cfg: GPTRunConfig) -> ModelSpec:
    """What ``launcher.config.layout.Facts.model`` holds for a GPT run."""
    return NOT_A_GPT if getattr(cfg.model, "_target_", None) else ModelSpec.from_cfg(cfg.model)
