"""What the engines need of a model (``ModelContract``), with the defaults for a plain ``nn.Module`` and
for a Hugging Face causal LM.

- ``loss(module, batch)``: the scalar training loss of one micro batch ``(tokens, labels)`` (labels
  already shifted); ``module`` is what the engine runs (the model, or its DDP / DeepSpeed wrapper).
- ``blocks(model)``: the repeated units (decoder layers) FSDP2 shards one by one and ZeRO-3 partitions
  one by one as they are built.
- ``init(model, module, name)``: initialise ``module``'s own parameters (``recurse=False``) in place,
  after it was materialised from the meta device (``name``: its name in ``model``, "" for the model
  itself); torch's RNG is seeded by (run seed, name) before the call (``launcher.training.engines.build``).
  None: the module's own ``reset_parameters()``.
- ``tp_plan(model)``: {module name pattern: torch ParallelStyle} for ``parallelize_module``, applied by
  the fsdp engine with ``parallelism.tp > 1`` (None: the model has no tensor parallelism).
- ``recompute_blocks``: with ``train.recompute=full`` the engines recompute each block's forward in its
  backward (``torch.utils.checkpoint``, non-reentrant); False: the model recomputes by itself (or not).

A model states its own by a ``launcher_contract()`` method returning a ModelContract (e.g.
``dataclasses.replace(plain_contract(self), blocks=lambda m: list(m.stages))``); a recipe may pass one
to ``build_engine``. Otherwise ``contract_for`` picks: a ``transformers.PreTrainedModel`` with an
output embedding (a causal-LM head): ``hf_causal_lm_contract``; anything else: ``plain_contract``.
"""
from __future__ import annotations

import inspect
import sys
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.nn.functional as F
from torch import nn

from launcher.training.engines.base import Batch


@dataclass(frozen=True)
class ModelContract:
    loss: Callable[[nn.Module, Batch], torch.Tensor]
    blocks: Callable[[nn.Module], List[nn.Module]]
    init: Optional[Callable[[nn.Module, nn.Module, str], None]] = None
    tp_plan: Optional[Callable[[nn.Module], Dict[str, Any]]] = None
    recompute_blocks: bool = True
    name: str = "plain"


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean token cross entropy in fp32 (16-bit logits are upcast first)."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))


def largest_module_list(model: nn.Module) -> List[nn.Module]:
    """The children of the model's nn.ModuleList holding the most parameters ([] without one)."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m)]
    if not lists:
        return []
    return list(max(lists, key=lambda m: sum(p.numel() for p in m.parameters())))


def _takes_labels(model: nn.Module) -> bool:
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
    return "labels" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def plain_contract(model: nn.Module) -> ModelContract:
    """A plain module: ``forward(tokens, labels=labels)`` returning the loss when its forward takes
    ``labels`` (a scalar; an output with a ``.loss``), else ``forward(tokens)`` returning logits, scored by
    cross entropy; blocks: the children of its largest nn.ModuleList; init: each module's
    ``reset_parameters``."""
    with_labels = _takes_labels(model)

    def loss(module: nn.Module, batch: Batch) -> torch.Tensor:
        tokens, labels = batch
        if not with_labels:
            return cross_entropy(module(tokens), labels)
        out = module(tokens, labels=labels)
        out = getattr(out, "loss", out)
        if not (torch.is_tensor(out) and out.dim() == 0):
            raise TypeError(f"{type(model).__name__}.forward(tokens, labels=labels) returned "
                            f"{type(out).__name__}{tuple(out.shape) if torch.is_tensor(out) else ''}, not a scalar "
                            "loss: return the loss, or give the model a launcher_contract() (docs/training-api.md)")
        return out

    return ModelContract(loss=loss, blocks=largest_module_list, name="plain")


def is_hf_causal_lm(model: nn.Module) -> bool:
    """A transformers PreTrainedModel with an output embedding (its LM head); transformers is not
    imported unless the model came from it."""
    if "transformers" not in sys.modules:
        return False
    from transformers import PreTrainedModel

    return isinstance(model, PreTrainedModel) and model.get_output_embeddings() is not None


def hf_causal_lm_contract(model: nn.Module) -> ModelContract:
    """A Hugging Face causal LM: ``model(input_ids=tokens).logits`` scored against our (already
    shifted) labels; blocks: its decoder layers (the largest nn.ModuleList); init: its own
    ``_init_weights`` per module."""

    def loss(module: nn.Module, batch: Batch) -> torch.Tensor:
        tokens, labels = batch
        return cross_entropy(module(input_ids=tokens, use_cache=False).logits, labels)

    def init(root: nn.Module, module: nn.Module, name: str) -> None:
        root._init_weights(module)

    return ModelContract(loss=loss, blocks=largest_module_list, init=init, name="hf_causal_lm")


def contract_for(model: nn.Module, contract: Optional[ModelContract] = None) -> ModelContract:
    """The contract the engines use for ``model``: ``contract`` if given, else the model's
    ``launcher_contract()``, else the Hugging Face causal-LM or the plain default."""
    if contract is not None:
        return contract
    own = getattr(model, "launcher_contract", None)
    if callable(own):
        got = own()
        if not isinstance(got, ModelContract):
            raise TypeError(f"{type(model).__name__}.launcher_contract() returned {type(got).__name__}, "
                            "not a launcher.training.engines.ModelContract")
        return got
    return hf_causal_lm_contract(model) if is_hf_causal_lm(model) else plain_contract(model)
