"""The engine interface the step loop and the Checkpointer use, and what every engine shares: the
dtype of ``precision``, AdamW from ``cfg.optim`` with its param groups, the fp16 loss scaler, byte
counts. Node side (torch)."""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Dict, Iterable, List, Optional, Tuple

import torch
from torch import nn

from launcher.config.schema import enum_value

if TYPE_CHECKING:
    from launcher.config.schema import RunConfig

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
Batch = Tuple[torch.Tensor, torch.Tensor]


def dtype_name(cfg: RunConfig) -> str:
    name = enum_value(cfg.precision.dtype)
    if name not in DTYPES:
        raise ValueError(f"precision.dtype must be one of {sorted(DTYPES)}, got {name!r}")
    return name


def grad_reduce_dtype(cfg: RunConfig) -> torch.dtype:
    """``precision.grad_reduce_dtype``: the dtype data-parallel gradients travel in (fp32: the exact
    mean; bf16: half the bytes)."""
    name = enum_value(getattr(cfg.precision, "grad_reduce_dtype", "fp32"))
    if name not in ("fp32", "bf16"):
        raise ValueError(f"precision.grad_reduce_dtype must be fp32 or bf16, got {name!r}")
    return DTYPES[name]


def bf16_reduce_hook(group, bucket):  # (no annotations: DDP checks them, and these would be strings)
    """A DDP communication hook: the bucket cast to bf16, divided by the world, all-reduced and cast back
    in place (what torch's ``default_hooks.bf16_compress_hook`` does; that one refuses to register off
    CUDA/NCCL, this one runs on gloo too)."""
    import torch.distributed as dist

    buffer = bucket.buffer()
    low = buffer.to(torch.bfloat16).div_((group if group is not None else dist.group.WORLD).size())

    def back(fut: Any) -> torch.Tensor:
        return buffer.copy_(fut.value()[0])

    return dist.all_reduce(low, group=group, async_op=True).get_future().then(back)


def compress_ddp_grads(ddp: Any, cfg: RunConfig) -> None:
    """bf16 gradient reduction on a DistributedDataParallel (``bf16_reduce_hook``); fp32: DDP's own fp32
    all-reduce."""
    if ddp is not None and grad_reduce_dtype(cfg) == torch.bfloat16:
        ddp.register_comm_hook(None, bf16_reduce_hook)


def autocast_for(cfg: RunConfig, device_type: str) -> Callable[[], ContextManager]:
    """A context factory: autocast to bf16/fp16, or nothing for fp32."""
    name = dtype_name(cfg)
    if name == "fp32":
        return contextlib.nullcontext
    if not torch.amp.is_autocast_available(device_type):
        raise ValueError(f"precision.dtype={name} needs autocast, unavailable on {device_type}")
    dtype = DTYPES[name]
    return lambda: torch.autocast(device_type=device_type, dtype=dtype)


def param_groups(params: Iterable[Tuple[str, Any]], weight_decay: float) -> List[Dict[str, Any]]:
    """AdamW groups: no weight decay on biases and norm weights (every parameter with ndim < 2)."""
    params = list(params)
    decay = [p for _, p in params if p.requires_grad and p.ndim >= 2]
    no_decay = [p for _, p in params if p.requires_grad and p.ndim < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def adamw_kwargs(optim: Any) -> Dict[str, Any]:
    """The AdamW hyper-parameters of ``cfg.optim`` (lr, betas, eps); the weight decay goes per group.
    Refuses any optimizer other than AdamW."""
    name = enum_value(getattr(optim, "name", "adamw")).lower()
    if name != "adamw":
        raise ValueError(f"optim.name={name!r} is not supported by the engines (only 'adamw')")
    return dict(lr=float(optim.lr), betas=(float(optim.beta1), float(optim.beta2)), eps=float(optim.eps))


def fused_kwargs(on_cuda: bool) -> Dict[str, Any]:
    """AdamW's ``fused=True`` (one multi-tensor kernel per step, no per-parameter step-counter reads)
    when its parameters are on CUDA; nothing elsewhere (the CPU keeps torch's default, foreach)."""
    return {"fused": True} if on_cuda else {}


def on_cuda(params: Iterable[torch.Tensor]) -> bool:
    """Every parameter a floating-point CUDA tensor (a DTensor by its device): fused AdamW can step them."""
    params = list(params)
    return bool(params) and all(p.device.type == "cuda" and p.is_floating_point() for p in params)


def adamw(model: nn.Module, optim: Any) -> torch.optim.AdamW:
    """AdamW over the model's param groups; fused when the parameters are on CUDA."""
    return torch.optim.AdamW(param_groups(model.named_parameters(), float(optim.weight_decay)),
                             **adamw_kwargs(optim), **fused_kwargs(on_cuda(model.parameters())))


def grad_scaler(cfg: RunConfig, device_type: str, kind: type = torch.amp.GradScaler,
                **extra: Any) -> Tuple[Optional[torch.amp.GradScaler], float]:
    """fp16: a GradScaler (``kind``: torch's, or FSDP's sharded one) from ``precision`` (a static scale
    when precision.loss_scale > 0, else dynamic from 2**initial_scale_power) and the static scale (0 =
    dynamic); other dtypes: (None, 0)."""
    if dtype_name(cfg) != "fp16":
        return None, 0.0
    prec = cfg.precision
    static = float(prec.loss_scale)
    scaler = kind(device_type, init_scale=static if static > 0 else 2.0 ** int(prec.initial_scale_power),
                  growth_interval=int(prec.loss_scale_window), **extra)
    return scaler, static


def grad_norm_and_clip(params: List[torch.Tensor], grad_clip: float) -> torch.Tensor:
    """The global norm of the parameters' gradients, after which they are clipped to ``grad_clip``
    (0: not clipped). Sharded (DTensor) gradients count whole; those on different meshes (FSDP2 over
    tensor parallelism: a TP-split weight on the dp x tp mesh, a norm on the dp mesh) by mesh."""
    with_grad = [p for p in params if p.grad is not None]
    meshes: Dict[Any, List[torch.Tensor]] = {}
    for p in with_grad:
        meshes.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
    if len(meshes) <= 1:
        norm = (torch.nn.utils.clip_grad_norm_(params, grad_clip) if grad_clip > 0
                else torch.nn.utils.get_total_norm([p.grad for p in with_grad]))
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    parts = [torch.nn.utils.get_total_norm([p.grad for p in group]) for group in meshes.values()]
    norm = torch.stack([n.full_tensor() if hasattr(n, "full_tensor") else n for n in parts]).norm()
    if grad_clip > 0:
        for group in meshes.values():
            torch.nn.utils.clip_grads_with_norm_(group, grad_clip, norm)
    return norm


def optimizer_step(optimizer: torch.optim.Optimizer, params: List[torch.Tensor], grad_clip: float,
                   scaler: Optional[torch.amp.GradScaler], static_scale: float, min_scale: float
                   ) -> Tuple[torch.Tensor, int]:
    """Unscale (fp16), clip at ``grad_clip`` (0: off), step, zero the gradients. Returns (the global
    gradient norm before clipping, bytes of the gradients this rank held). A sharded (DTensor)
    gradient's norm is over the whole tensor."""
    if scaler is not None:
        scaler.unscale_(optimizer)
    grads = [p.grad for p in params if p.grad is not None]
    norm = grad_norm_and_clip(params, grad_clip)
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update(static_scale if static_scale > 0 else None)
        if static_scale <= 0 and scaler.get_scale() < min_scale:
            scaler.update(min_scale)
    else:
        optimizer.step()
    held = tensor_bytes(_local(g) for g in grads)
    optimizer.zero_grad(set_to_none=True)
    return norm, held


class StepStats:
    """The step's scalars every rank must agree on, and the job's stop agreement, in one all-reduce and
    one host read: an engine appends this rank's stop votes (``RunContext.stop_votes``) to the tensor it
    all-reduces anyway (SUM: its loss), reads it once, and ``read`` settles the stop on the context
    (``settle_stop``), so the loop's ``should_stop`` needs no collective or device sync of its own.
    At world 1, or with a context without votes, nothing is appended."""

    def __init__(self, ctx: Any, world: int) -> None:
        self.ctx = ctx if world > 1 and hasattr(ctx, "stop_votes") else None
        self._votes = 0

    def with_votes(self, summed: torch.Tensor) -> torch.Tensor:
        """``summed`` (1-D float32, to be summed over the world) with this rank's stop votes after it."""
        if self.ctx is None:
            return summed
        votes = self.ctx.stop_votes(summed.device)
        self._votes = votes.numel()
        return torch.cat([summed, votes])

    def read(self, stats: torch.Tensor) -> List[float]:
        """The one host read of the step: ``stats`` (its tail the summed votes of ``with_votes``) as
        floats, the votes settled on the context and left out."""
        values = stats.tolist()
        if self.ctx is None or not self._votes:
            return values
        n, self._votes = self._votes, 0
        self.ctx.settle_stop(values[-n:])
        return values[:-n]


def tensor_bytes(tensors: Iterable[Optional[torch.Tensor]]) -> int:
    return int(sum(t.numel() * t.element_size() for t in tensors if t is not None))


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of tensor state the optimizer holds (Adam: exp_avg, exp_avg_sq; step counters excluded)."""
    return tensor_bytes(_local(v) for state in optimizer.state.values() for v in state.values()
                        if torch.is_tensor(v) and v.dim() > 0)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's own shard (FSDP2), any other tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


class Engine:
    """One optimizer step over this rank's share of a global batch (the interface of every engine:
    ``launcher.training.engines``' and a recipe's own).

    Attributes the loop reads: ``dp`` and ``dp_rank`` (which samples this rank loads), ``num_params``
    (total model parameters), ``phases`` (set by the loop: where a step's time goes) and
    ``build_meter`` (memory the model's construction used; None: not measured).
    """

    dp: int = 1
    dp_rank: int = 0
    num_params: int = 0
    phases: Any = None
    build_meter: Any = None

    def _phase(self, name: str) -> ContextManager[None]:
        return self.phases(name) if self.phases is not None else contextlib.nullcontext()

    def train_step(self, batches: List[Batch], lr: float) -> Tuple[float, float]:
        """Forward/backward over the micro batches, optimizer step at ``lr``.
        Returns (loss averaged over the whole global batch, global grad norm before clipping),
        the same on every rank."""
        raise NotImplementedError

    def eval_loss(self, batches: List[Batch]) -> float:
        """Forward only (no gradients, dropout off): the mean loss over the given micro batches of
        every data-parallel rank, the same on every rank."""
        raise NotImplementedError

    def state_bytes(self) -> Dict[str, int]:
        """Bytes of parameters, gradients and optimizer state held on this rank: {"params", "grads",
        "optimizer"}."""
        raise NotImplementedError

    def describe(self) -> str:
        return type(self).__name__

    # ---- checkpoints (launcher.training.checkpoint) -----------------------------------------------
    def checkpoint_files(self) -> Dict[str, Any]:
        """File name -> state this rank writes into a checkpoint (all it needs to continue bit for bit);
        the Checkpointer copies it to host memory and writes it."""
        return {}

    def optimizers(self) -> List[torch.optim.Optimizer]:
        """The optimizers whose step changes the checkpointed state (an asynchronous save's copy must be
        done before they step); none: saves are synchronous."""
        return []

    def save_native(self, path: Path) -> List[Path]:
        """An engine with its own (collective, synchronous) save writes into ``path`` here, and returns
        the files this rank wrote (this rank hashes them for the manifest, not the committing one)."""
        return []

    def load_checkpoint(self, path: Path) -> None:
        """Restore this rank's state from the checkpoint directory ``path``."""
        raise NotImplementedError

    # ---- resuming on another layout (launcher.training.universal) ---------------------------------
    def universal_state(self) -> Optional[Dict[str, Any]]:
        """This rank's model and optimizer state by parameter name, as torch.distributed.checkpoint
        saves it (``universal.module_state`` for a module and a torch optimizer); None: this engine's
        checkpoints load only on the layout they were saved on."""
        return None

    def universal_ok(self) -> bool:
        """Whether ``universal_state`` gives a state on this layout, asked without building it (a build
        may gather every tensor): an engine that overrides it does, unless it says otherwise here."""
        return type(self).universal_state is not Engine.universal_state

    def load_universal(self, path: Path) -> None:
        """Fill this rank's state, under this engine's layout, from the universal checkpoint ``path``."""
        raise NotImplementedError(f"{type(self).__name__} does not load layout-independent checkpoints")
