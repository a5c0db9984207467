"""Megatron-style tensor parallelism, hand-written on torch.distributed collectives.

Why not torch.distributed.tensor.parallel (DTensor)? It works with gloo for this model
(parallelize_module with Colwise/RowwiseParallel and loss_parallel gave the single-process losses
to 1e-6), but on CPU its per-op dispatch made a gpt_tiny step ~13x slower than one process
(92 ms vs 7 ms), the tied head/embedding needs re-tying after parallelize_module, every
non-sharded parameter must stay a plain tensor (mixed DTensor/tensor inputs fail) so clipping,
ZeRO and the DP all-reduce need DTensor special cases anyway, and sequence parallelism needs the
embedding/attention code reshaped around DTensor layouts. The Megatron primitives below are a few
dozen lines, run at plain-tensor speed and compose with pipeline stages, ZeRO-1 and autocast.

Layout: activations are batch-first [b, s, h] like ``recipes.gpt.model``; the sequence dim is 1.

Regions (autograd functions; identity when tp == 1):
    copy_to_tp          fwd identity        bwd all-reduce     (input of a column-parallel linear)
    reduce_from_tp      fwd all-reduce      bwd identity       (output of a row-parallel linear)
    gather_from_seq     fwd all-gather(s)   bwd reduce-scatter (sequence parallel, before column)
    reduce_scatter_seq  fwd reduce-scatter  bwd all-gather(s)  (sequence parallel, after row)

Layers are built from the full (unsharded) modules by slicing, so a sharded model starts from
exactly the single-process initialisation. Parameter attributes used by the engine:
``tensor_parallel`` (sharded across tp: its squared norm is summed over the tp group) and
``sequence_parallel`` (replicated, but with sequence parallelism each rank sees only its sequence
chunk, so its gradient is partial and must be all-reduced over tp).

Dropout (``recipes.gpt.rng``): every dropout site draws from a stream of the RNG tracker the engine
attaches (``rng.attach``): the attention-probability dropout (this rank's heads) from the
model-parallel stream, distinct per tp rank; the embedding and residual dropouts from the replicated
stream, the same on every tp rank - or, under sequence parallelism (this rank's sequence chunk), from
the model-parallel one. Without a tracker (``rng`` None) they draw from the default generator.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from launcher.training.engines import contract
from launcher.training.engines.contract import cross_entropy
from recipes.gpt import rng

SEQ_DIM = 1


@dataclass(frozen=True)
class TPContext:
    """The tensor-parallel group this rank belongs to."""

    group: Any
    rank: int
    size: int
    sequence_parallel: bool = False

    @staticmethod
    def single() -> TPContext:
        return TPContext(group=None, rank=0, size=1, sequence_parallel=False)


# ----------------------------------------------------------------------------- collectives


def _all_reduce(x: torch.Tensor, tp: TPContext) -> torch.Tensor:
    if tp.size == 1:
        return x
    out = x.clone(memory_format=torch.contiguous_format)  # never modify a tensor autograd may hold
    dist.all_reduce(out, group=tp.group)
    return out


def _all_gather_seq(x: torch.Tensor, tp: TPContext) -> torch.Tensor:
    if tp.size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(tp.size)]
    dist.all_gather(parts, x, group=tp.group)
    return torch.cat(parts, dim=SEQ_DIM)


def _reduce_scatter_seq(x: torch.Tensor, tp: TPContext) -> torch.Tensor:
    if tp.size == 1:
        return x
    if x.shape[SEQ_DIM] % tp.size:
        raise ValueError(f"sequence length {x.shape[SEQ_DIM]} is not divisible by tp={tp.size}")
    chunks = [c.contiguous() for c in x.chunk(tp.size, dim=SEQ_DIM)]
    out = torch.empty_like(chunks[tp.rank])
    dist.reduce_scatter(out, chunks, group=tp.group)
    return out


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.tp), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        return _all_reduce(x, tp)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return _all_gather_seq(x, tp)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_seq(grad, ctx.tp), None


class _ReduceScatterSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return _reduce_scatter_seq(x, tp)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_seq(grad, ctx.tp), None


def copy_to_tp(x: torch.Tensor, tp: TPContext) -> torch.Tensor:
    return x if tp.size == 1 else _CopyToTP.apply(x, tp)


def reduce_from_tp(x: torch.Tensor, tp: TPContext) -> torch.Tensor:
    return x if tp.size == 1 else _ReduceFromTP.apply(x, tp)


def gather_from_seq(x: torch.Tensor, tp: TPContext) -> torch.Tensor:
    return x if tp.size == 1 else _GatherFromSeq.apply(x, tp)


def reduce_scatter_seq(x: torch.Tensor, tp: TPContext) -> torch.Tensor:
    return x if tp.size == 1 else _ReduceScatterSeq.apply(x, tp)


def enter_column(x: torch.Tensor, tp: TPContext) -> torch.Tensor:
    """What a column-parallel layer does to its (replicated or sequence-sharded) input."""
    return gather_from_seq(x, tp) if tp.sequence_parallel else copy_to_tp(x, tp)


def leave_row(x: torch.Tensor, tp: TPContext) -> torch.Tensor:
    """What a row-parallel layer does to its partial-sum output."""
    return reduce_scatter_seq(x, tp) if tp.sequence_parallel else reduce_from_tp(x, tp)


# ------------------------------------------------------------------------- vocab-parallel loss


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross entropy from vocab-sharded fp32 logits [N, V/tp]; the logits are never gathered
    (three all-reduces of [N] vectors: max, target logit, sum of exp)."""

    @staticmethod
    def forward(ctx, logits, target, tp, vocab_start):
        logits = logits.float()
        vmax = logits.max(dim=-1).values
        if tp.size > 1:
            dist.all_reduce(vmax, op=dist.ReduceOp.MAX, group=tp.group)
        shifted = logits - vmax.unsqueeze(-1)
        n_local = shifted.shape[-1]
        local_target = target - vocab_start
        outside = (local_target < 0) | (local_target >= n_local)
        local_target = local_target.masked_fill(outside, 0)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        if tp.size > 1:
            both = torch.stack([target_logit, sum_exp])
            dist.all_reduce(both, group=tp.group)
            target_logit, sum_exp = both[0], both[1]
        loss = torch.log(sum_exp) - target_logit
        exp.div_(sum_exp.unsqueeze(-1))  # softmax, kept for backward
        ctx.save_for_backward(exp, local_target, outside)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_target, outside = ctx.saved_tensors
        grad = softmax.clone()
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, local_target] -= (~outside).to(grad.dtype)
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad, None, None, None


class _ChunkedVocabParallelCrossEntropy(torch.autograd.Function):
    """The same loss from 16-bit vocab-sharded logits, in fp32 a chunk of ``rows`` rows at a time (as
    ``contract._ChunkedCrossEntropy``): no fp32 copy of the shard is made, and what the backward keeps
    is the 16-bit logits and two fp32 numbers per row (the global max and sum of exp), not an fp32
    softmax; the gradient is written chunk by chunk in the logits' dtype."""

    @staticmethod
    def forward(ctx, logits, target, tp, vocab_start, rows):
        vmax = logits.max(dim=-1).values.float()  # exact: the max of 16-bit values is one of them
        if tp.size > 1:
            dist.all_reduce(vmax, op=dist.ReduceOp.MAX, group=tp.group)
        local_target = target - vocab_start
        outside = (local_target < 0) | (local_target >= logits.shape[-1])
        local_target = local_target.masked_fill(outside, 0)
        picked = logits.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).float()
        target_logit = (picked - vmax).masked_fill(outside, 0.0)
        sum_exp = torch.empty_like(vmax)
        for i in range(0, logits.shape[0], rows):
            sum_exp[i:i + rows] = (logits[i:i + rows].float() - vmax[i:i + rows, None]).exp().sum(dim=-1)
        if tp.size > 1:
            both = torch.stack([target_logit, sum_exp])
            dist.all_reduce(both, group=tp.group)
            target_logit, sum_exp = both[0], both[1]
        ctx.rows = rows
        ctx.save_for_backward(logits, local_target, outside, vmax, sum_exp)
        return torch.log(sum_exp) - target_logit

    @staticmethod
    def backward(ctx, grad_loss):
        logits, local_target, outside, vmax, sum_exp = ctx.saved_tensors
        rows, out = ctx.rows, torch.empty_like(logits)
        hit = (~outside).float()  # 1 where this shard holds the row's target
        for i in range(0, logits.shape[0], rows):
            g = (logits[i:i + rows].float() - vmax[i:i + rows, None]).exp_().div_(sum_exp[i:i + rows, None])
            g.scatter_add_(1, local_target[i:i + rows, None], -hit[i:i + rows, None])
            out[i:i + rows] = g.mul_(grad_loss[i:i + rows, None].float())
        return out, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, tp: TPContext,
                                 vocab_start: int) -> torch.Tensor:
    """Mean cross entropy of vocab-sharded ``logits`` [..., V/tp] against global ``labels`` [...].
    fp32 logits: on the whole shard; 16-bit logits: in fp32 a chunk of rows at a time (no fp32 copy
    of the shard). tp == 1: the model's own loss (``contract.cross_entropy``, chunked the same way)."""
    flat = logits.reshape(-1, logits.shape[-1])
    target = labels.reshape(-1)
    if tp.size == 1:
        return cross_entropy(flat, target)
    if flat.dtype == torch.float32:
        return _VocabParallelCrossEntropy.apply(flat, target, tp, int(vocab_start)).mean()
    rows = max(1, contract.CHUNK_BYTES // (4 * flat.shape[-1]))
    return _ChunkedVocabParallelCrossEntropy.apply(flat, target, tp, int(vocab_start), rows).mean()


# --------------------------------------------------------------------------------- layers


def cut(full: torch.Tensor, rows: Any = None, cols: Optional[slice] = None) -> torch.Tensor:
    """``full[rows][:, cols]``: a shard's part of its full tensor (None: the whole of that dim)."""
    t = full if rows is None else full[rows]
    return t if cols is None else t[:, cols]


def shard(full: nn.Parameter, rows: Any = None, cols: Optional[slice] = None, **attrs: bool) -> nn.Parameter:
    """A parameter holding ``full[rows][:, cols]``, remembering where it came from (``init_spec``:
    the full parameter's name and shape, rows, cols) so that a shard sliced from a meta-device model
    is initialised with exactly its part of the full values (``materialize``)."""
    p = nn.Parameter(cut(full, rows, cols).detach().clone().contiguous())
    if full.is_meta:
        p.init_spec = (*source(full), rows, cols)
    for k, v in attrs.items():
        setattr(p, k, v)
    return p


def source(p: nn.Parameter) -> Tuple[str, Tuple[int, ...]]:
    """(name, shape) of the full-model parameter ``p`` is, or is a shard of."""
    spec = getattr(p, "init_spec", None)
    return (spec[0], spec[1]) if spec is not None else (p.global_name, tuple(p.shape))


def chunk_of(n: int, tp: TPContext) -> slice:
    """This rank's contiguous 1/tp of ``n`` (``torch.chunk``'s split, n divisible by tp)."""
    per = n // tp.size
    return slice(tp.rank * per, (tp.rank + 1) * per)


def mark_replicated(module: nn.Module, tp: TPContext) -> nn.Module:
    """Flag a replicated module's parameters (layer norms) for the sequence-parallel grad reduce."""
    for p in module.parameters():
        p.tensor_parallel = False
        p.sequence_parallel = tp.sequence_parallel
    return module


class ColumnParallelLinear(nn.Module):
    """Y_i = X A_i^T + b_i: the output features split over tp (``rows`` picks them from the full
    weight; default contiguous chunks). The output stays sharded (no gather)."""

    def __init__(self, full: nn.Linear, tp: TPContext, rows: Optional[torch.Tensor] = None) -> None:
        super().__init__()
        self.tp = tp
        pick = rows if rows is not None else chunk_of(full.weight.shape[0], tp)
        self.weight = shard(full.weight, pick, tensor_parallel=True, sequence_parallel=False)
        self.bias = None
        if full.bias is not None:
            self.bias = shard(full.bias, pick, tensor_parallel=True, sequence_parallel=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(enter_column(x, self.tp), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """Y = sum_i X_i A_i^T + b: the input features split over tp; partial outputs are all-reduced
    (or reduce-scattered along the sequence); the bias is replicated and added after."""

    def __init__(self, full: nn.Linear, tp: TPContext) -> None:
        super().__init__()
        self.tp = tp
        self.weight = shard(full.weight, cols=chunk_of(full.weight.shape[1], tp), tensor_parallel=True,
                            sequence_parallel=False)
        self.bias = None
        if full.bias is not None:
            self.bias = shard(full.bias, tensor_parallel=False, sequence_parallel=tp.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = leave_row(F.linear(x, self.weight), self.tp)
        return y if self.bias is None else y + self.bias


def head_rows(num_heads: int, head_dim: int, tp: TPContext) -> torch.Tensor:
    """Rows of the fused qkv weight [3*heads*head_dim, h] that hold this rank's heads, in the
    (3, local_heads, head_dim) order the attention forward views them in."""
    local = num_heads // tp.size
    idx = torch.arange(3 * num_heads * head_dim).view(3, num_heads, head_dim)
    return idx[:, tp.rank * local:(tp.rank + 1) * local].reshape(-1)


class VocabParallelEmbedding(nn.Module):
    """Token + position embedding with the token table split by vocabulary rows.

    Each rank looks up the tokens in its vocabulary range (others give 0); the partial sums are
    all-reduced, or with sequence parallelism reduce-scattered so each rank keeps its sequence chunk.
    Position embeddings (replicated) are added after the reduction, for this rank's positions."""

    def __init__(self, full: Any, tp: TPContext) -> None:  # full: recipes.gpt.model.Embedding
        super().__init__()
        self.tp = tp
        vocab = full.word.weight.shape[0]
        self.vocab_start = tp.rank * (vocab // tp.size)
        self.weight = shard(full.word.weight, chunk_of(vocab, tp), tensor_parallel=True, sequence_parallel=False)
        self.position = shard(full.position.weight, tensor_parallel=False, sequence_parallel=tp.sequence_parallel)
        self.dropout = nn.Dropout(full.dropout.p)
        self.rng: Optional[rng.RNGTracker] = None  # rng.attach
        self.seq_len = int(full.seq_len)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        if length > self.seq_len:
            raise ValueError(f"sequence of {length} tokens exceeds model.seq_len={self.seq_len}")
        if self.tp.size > 1:
            local = tokens - self.vocab_start
            outside = (local < 0) | (local >= self.weight.shape[0])
            word = F.embedding(local.masked_fill(outside, 0), self.weight)
            word = word.masked_fill(outside.unsqueeze(-1), 0.0)
        else:
            word = F.embedding(tokens, self.weight)
        if self.tp.sequence_parallel:
            word = reduce_scatter_seq(word, self.tp)
            chunk = length // self.tp.size
            positions = torch.arange(self.tp.rank * chunk, (self.tp.rank + 1) * chunk, device=tokens.device)
        else:
            word = reduce_from_tp(word, self.tp)
            positions = torch.arange(length, device=tokens.device)
        return rng.dropout(self.dropout, word + self.position[positions], self.rng,
                           rng.residual_stream(self.tp.sequence_parallel))


class ParallelAttention(nn.Module):
    """``recipes.gpt.model.CausalSelfAttention`` with this rank's heads: qkv column-parallel split
    by heads, the SDPA core on local heads, output projection row-parallel."""

    def __init__(self, full: Any, tp: TPContext) -> None:  # full: CausalSelfAttention
        super().__init__()
        self.tp = tp
        self.num_heads = full.num_heads // tp.size
        self.head_dim = full.head_dim
        self.qkv = ColumnParallelLinear(full.qkv, tp, rows=head_rows(full.num_heads, full.head_dim, tp))
        self.proj = RowParallelLinear(full.proj, tp)
        self.attn_dropout = full.attn_dropout
        self.resid_dropout = nn.Dropout(full.resid_dropout.p)
        self.recompute_core = bool(full.recompute_core)
        self.rng: Optional[rng.RNGTracker] = None  # rng.attach

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        p = self.attn_dropout if self.training else 0.0
        with rng.fork(self.rng if p > 0 else None, rng.MODEL_PARALLEL):  # this rank's heads: its own masks
            return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)  # [b, s, 3 * local_heads * head_dim] (full sequence under SP)
        b, s = qkv.shape[:2]
        q, k, v = qkv.view(b, s, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        if self.recompute_core and torch.is_grad_enabled():
            y = rng.checkpoint(self.core, q, k, v, tracker=self.rng)
        else:
            y = self.core(q, k, v)
        y = y.transpose(1, 2).reshape(b, s, self.num_heads * self.head_dim)
        return rng.dropout(self.resid_dropout, self.proj(y), self.rng, rng.residual_stream(self.tp.sequence_parallel))


class ParallelMLP(nn.Module):
    def __init__(self, full: Any, tp: TPContext) -> None:  # full: recipes.gpt.model.MLP
        super().__init__()
        self.tp = tp
        self.fc1 = ColumnParallelLinear(full.fc1, tp)
        self.act = full.act
        self.fc2 = RowParallelLinear(full.fc2, tp)
        self.dropout = nn.Dropout(full.dropout.p)
        self.rng: Optional[rng.RNGTracker] = None  # rng.attach

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rng.dropout(self.dropout, self.fc2(self.act(self.fc1(x))), self.rng,
                           rng.residual_stream(self.tp.sequence_parallel))


class ParallelBlock(nn.Module):
    """Pre-LN block; layer norms replicated (on sequence chunks under SP)."""

    def __init__(self, full: Any, tp: TPContext) -> None:  # full: recipes.gpt.model.Block
        super().__init__()
        self.ln1 = mark_replicated(full.ln1, tp)
        self.attn = ParallelAttention(full.attn, tp)
        self.ln2 = mark_replicated(full.ln2, tp)
        self.mlp = ParallelMLP(full.mlp, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class ParallelHead(nn.Module):
    """The output layer, column-parallel over the vocabulary; returns vocab-sharded logits.
    ``weight`` is the embedding's own shard (tied, same stage), a copy of it (tied, other stage:
    kept equal by all-reducing grads in the embedding group) or a shard of an untied head."""

    def __init__(self, weight: nn.Parameter, tp: TPContext) -> None:
        super().__init__()
        self.tp = tp
        self.weight = weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(enter_column(x, self.tp), self.weight)


# --------------------------------------------------------------------------------- shard-first build


def name_parameters(full: nn.Module) -> None:
    """Tag every parameter of the full (meta-device) model with its name, for ``shard``/``materialize``."""
    for name, p in full.named_parameters():
        p.global_name = name


def materialize(module: nn.Module, seed: int, num_layers: int, device: torch.device) -> None:
    """Replace every meta-device parameter of ``module`` with its values on ``device``: each is a full
    parameter or a shard of one (``shard``), initialised with exactly its part of the full values
    (``recipes.gpt.init``). Parameters shared between modules (a tied head) stay shared; their flags
    (tensor_parallel, sequence_parallel, ...) are kept."""
    from recipes.gpt.init import init_values

    made: Dict[int, Tuple[nn.Parameter, nn.Parameter]] = {}  # id(meta) -> (meta, real): meta kept alive
    for sub in module.modules():
        for key, p in list(sub._parameters.items()):
            if p is None or not p.is_meta:
                continue
            if id(p) not in made:
                name, shape = source(p)
                rows, cols = (p.init_spec[2], p.init_spec[3]) if hasattr(p, "init_spec") else (None, None)
                values = init_values(seed, name, shape, num_layers, rows=rows, cols=cols)
                real = nn.Parameter(values.to(device), requires_grad=p.requires_grad)
                real.__dict__.update(p.__dict__)
                made[id(p)] = (p, real)
            sub._parameters[key] = made[id(p)][1]
