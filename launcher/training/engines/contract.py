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

from launcher.training.engines.engine import Batch


@dataclass(frozen=True)
class ModelContract:
    loss: Callable[[nn.Module, Batch], torch.Tensor]
    blocks: Callable[[nn.Module], List[nn.Module]]
    init: Optional[Callable[[nn.Module, nn.Module, str], None]] = None
    tp_plan: Optional[Callable[[nn.Module], Dict[str, Any]]] = None
    recompute_blocks: bool = True
    name: str = "plain"


IGNORE_INDEX = -100  # F.cross_entropy's: a label that counts in neither the sum nor the mean
CHUNK_BYTES = 64 << 20  # fp32 working set of the 16-bit loss, per chunk of rows


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Mean cross entropy of 16-bit logits [N, V], computed in fp32 a chunk of rows at a time: what it
    keeps for the backward is the logits themselves and one fp32 log-sum-exp per row, never an fp32
    copy of all logits (nor of their log-softmax); the gradient is written chunk by chunk in the
    logits' dtype."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, labels: torch.Tensor, rows: int) -> torch.Tensor:
        valid = labels != IGNORE_INDEX
        safe = torch.where(valid, labels, torch.zeros_like(labels))
        lse = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
        for i in range(0, logits.shape[0], rows):
            lse[i:i + rows] = torch.logsumexp(logits[i:i + rows].float(), dim=-1)
        picked = logits.gather(1, safe[:, None]).squeeze(1).float()
        count = valid.sum()
        ctx.rows = rows
        ctx.save_for_backward(logits, safe, valid, lse, count)
        return torch.where(valid, lse - picked, torch.zeros_like(lse)).sum() / count

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        logits, safe, valid, lse, count = ctx.saved_tensors
        rows, out = ctx.rows, torch.empty_like(logits)
        weight = valid.float() * (grad.float() / count)  # d loss / d row
        for i in range(0, logits.shape[0], rows):
            g = torch.exp(logits[i:i + rows].float() - lse[i:i + rows, None])  # softmax
            g.scatter_add_(1, safe[i:i + rows, None], torch.full_like(g[:, :1], -1.0))
            out[i:i + rows] = g.mul_(weight[i:i + rows, None])
        return out, None, None


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean token cross entropy in fp32. fp32 logits: F.cross_entropy itself; 16-bit logits: upcast a
    chunk of rows at a time (``_ChunkedCrossEntropy``), so no fp32 copy of every logit is made."""
    flat, target = logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)
    if flat.dtype == torch.float32:
        return F.cross_entropy(flat, target)
    rows = max(1, CHUNK_BYTES // (4 * flat.shape[-1]))
    return _ChunkedCrossEntropy.apply(flat, target, rows)


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
