"""The engine interface shared by the step loop, and helpers every engine uses."""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Callable, ContextManager, Dict, Iterator, List, Tuple

import torch
import torch.distributed as dist
from torch import nn

from launcher.schema import enum_value
from launcher.seeding import dropout_seed
from recipes.common.seeding import seed_everything
from recipes.gpt.model import GPT

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
Batch = Tuple[torch.Tensor, torch.Tensor]


def dtype_name(cfg: Any) -> str:
    name = enum_value(cfg.precision.dtype)
    if name not in DTYPES:
        raise ValueError(f"precision.dtype must be one of {sorted(DTYPES)}, got {name!r}")
    return name


def autocast_for(cfg: Any, device_type: str) -> Callable[[], ContextManager]:
    """A context factory: autocast to bf16/fp16, or nothing for fp32."""
    name = dtype_name(cfg)
    if name == "fp32":
        return contextlib.nullcontext
    if not torch.amp.is_autocast_available(device_type):
        raise ValueError(f"precision.dtype={name} needs autocast, unavailable on {device_type}")
    dtype = DTYPES[name]
    return lambda: torch.autocast(device_type=device_type, dtype=dtype)


def build_model(cfg: Any, rank_for_dropout: int) -> GPT:
    """The full GPT with the same init on every rank (seeded before construction); dropout
    masks then differ per data-parallel replica."""
    seed_everything(int(cfg.seed))
    model = GPT(cfg.model, recompute=enum_value(cfg.train.recompute), seed=int(cfg.seed))
    torch.manual_seed(dropout_seed(int(cfg.seed), rank_for_dropout))
    return model


def param_groups(params: List[Tuple[str, nn.Parameter]], weight_decay: float) -> List[Dict[str, Any]]:
    """AdamW groups: no weight decay on biases and norm weights (every parameter with ndim < 2)."""
    decay = [p for _, p in params if p.requires_grad and p.ndim >= 2]
    no_decay = [p for _, p in params if p.requires_grad and p.ndim < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def adamw_kwargs(optim: Any) -> Dict[str, Any]:
    """The AdamW hyper-parameters of ``cfg.optim`` (lr, betas, eps) as keyword arguments, the same for
    every AdamW an engine builds (torch's, ZeroRedundancyOptimizer's, DeepSpeedCPUAdam's); the weight
    decay goes per group (``param_groups``). Refuses any optimizer other than AdamW."""
    name = enum_value(getattr(optim, "name", "adamw")).lower()
    if name != "adamw":
        raise ValueError(f"optim.name={name!r} is not supported by recipes.gpt (only 'adamw')")
    return dict(lr=float(optim.lr), betas=(float(optim.beta1), float(optim.beta2)), eps=float(optim.eps))


def adamw(model: nn.Module, optim: Any) -> torch.optim.AdamW:
    return torch.optim.AdamW(param_groups(list(model.named_parameters()), float(optim.weight_decay)),
                             **adamw_kwargs(optim))


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
    summed over the group and divided by every micro batch: the same float on every rank."""
    if world > 1:
        dist.all_reduce(loss_sum, op=dist.ReduceOp.SUM, group=group)
    return float(loss_sum.item()) / (count * world)


def tensor_bytes(tensors) -> int:
    return int(sum(t.numel() * t.element_size() for t in tensors if t is not None))


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of tensor state the optimizer holds (Adam: exp_avg, exp_avg_sq; step counters excluded)."""
    return tensor_bytes(
        v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v) and v.dim() > 0
    )


class Engine:
    """One optimizer step over this rank's share of a global batch.

    Attributes the loop reads: ``dp`` and ``dp_rank`` (which samples this rank loads),
    ``num_params`` (total model parameters), ``is_logging_rank``.
    """

    dp: int = 1
    dp_rank: int = 0
    num_params: int = 0
    phases: Any = None  # recipes.common.phases.Phases, set by the training loop: where the step's time goes
    build_meter: Any = None  # recipes.common.memory.BuildMeter around the model's construction: memory it used

    def _phase(self, name: str) -> ContextManager[None]:
        return self.phases(name) if self.phases is not None else contextlib.nullcontext()

    def train_step(self, batches: List[Batch], lr: float) -> Tuple[float, float]:
        """Forward/backward over the micro batches, optimizer step at ``lr``.
        Returns (loss averaged over the whole global batch, global grad norm before clipping),
        the same on every rank."""
        raise NotImplementedError

    def eval_loss(self, batches: List[Batch]) -> float:
        """Forward only, no gradients, dropout off: the mean loss over ``batches`` of every dp rank (each
        rank passes its share of the same evaluation samples), the same on every rank. Touches neither
        the weights, the optimizer nor the RNG streams: the training after it is unchanged."""
        raise NotImplementedError

    def state_bytes(self) -> Dict[str, int]:
        """Bytes of parameters, gradients and optimizer state held on this rank (for the planner's
        exactness check): {"params", "grads", "optimizer"}."""
        raise NotImplementedError

    def describe(self) -> str:
        return type(self).__name__

    # ---- checkpoints (launcher.training.checkpoint) -----------------------------------------------
    def checkpoint_files(self) -> Dict[str, Any]:
        """File name -> state this rank writes into a checkpoint (model, optimizer, loss scaler: all it
        needs to continue bit for bit); the checkpointer copies it to host memory and writes it."""
        return {}

    def optimizers(self) -> List[torch.optim.Optimizer]:
        """The optimizers whose step changes the checkpointed state (an asynchronous save's copy must
        be done before they step); none: saves are synchronous."""
        return []

    def save_native(self, path: Path) -> None:
        """An engine with its own (collective, synchronous) save writes into ``path`` here."""

    def load_checkpoint(self, path: Path) -> None:
        """Restore this rank's state from the checkpoint directory ``path``."""
        raise NotImplementedError
