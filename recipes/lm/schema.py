"""The lm recipe's config schema: an OPEN ``model`` group (any keys: ``model._target_`` names the
module's class or factory, the other keys are its arguments; ``model.name`` names the run and is not
passed) and the ``lm`` group, the shape of the data it trains on (``lm.seq_len``, ``lm.vocab_size``:
what the data makes and what the dataset's vocabulary is checked against).

Light: the login side imports it (no torch).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict

from omegaconf import MISSING

from launcher.config.schema import RunConfig, num

NOT_ARGUMENTS = ("name",)  # keys of the model group that are the launcher's, never the module's


@dataclass
class LMShape:
    seq_len: int = num(64, ge=1)  # tokens per sample (labels: the same tokens shifted by one)
    vocab_size: int = num(512, ge=1)  # token ids are < vocab_size (a tokenized dataset's must fit)


def _no_model() -> Dict[str, Any]:
    return {"_target_": MISSING}


@dataclass
class LMRunConfig(RunConfig):
    model: Dict[str, Any] = field(default_factory=_no_model)
    lm: LMShape = field(default_factory=LMShape)


SIZES: tuple = ()  # its bound rows read the config (RUN rows): Facts.model is LMSpec, not the group


@dataclass(frozen=True)
class LMSpec:
    """What the lm recipe's rules read (``Facts.model``): the run's name for its model and the shape
    of its data (the fields a GPT ModelSpec shares, so a check of the data's vocabulary reads either)."""

    name: str
    target: str
    vocab_size: int
    seq_len: int


def facts(cfg: LMRunConfig) -> LMSpec:
    model, lm = cfg.model, cfg.lm
    get = model.get if hasattr(model, "get") else lambda k, d=None: getattr(model, k, d)
    return LMSpec(name=str(get("name", "") or ""), target=str(get("_target_", "") or ""),
                  vocab_size=int(lm.vocab_size), seq_len=int(lm.seq_len))
