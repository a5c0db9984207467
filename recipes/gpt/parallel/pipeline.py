"""Pipeline stages of the GPT and the 1F1B schedule (torch.distributed.pipelining).

``model.blocks`` is split evenly into pp stages; the first stage also holds the embedding, the last
the final norm and the output head. A stage is an ``nn.Module`` whose forward maps the previous
stage's activations (tokens for the first stage) to the next stage's input (vocab-sharded fp32
logits for the last stage); the loss is computed by the schedule's ``loss_fn`` on the last stage.
With pp == 1 the single stage is the whole (tensor-parallel) model and no schedule is used.
"""
from __future__ import annotations

from typing import Any, Callable, ContextManager, Optional, Tuple

import torch
from torch import nn

from recipes.gpt import rng
from recipes.gpt.parallel.tensor_parallel import (
    ParallelBlock,
    ParallelHead,
    TPContext,
    VocabParallelEmbedding,
    chunk_of,
    mark_replicated,
    shard,
)


def stage_layers(num_layers: int, pp: int, stage: int) -> Tuple[int, int]:
    """[start, end) of the blocks held by ``stage``: an even split (the layout rules refuse a
    model.num_layers that pp does not divide before the job starts)."""
    if not 0 <= stage < pp:
        raise ValueError(f"stage {stage} outside [0, {pp})")
    per = num_layers // pp
    return stage * per, (stage + 1) * per


class GPTStage(nn.Module):
    """One pipeline stage of a tensor-parallel GPT, built by slicing the full model (on the meta device:
    then ``tensor_parallel.materialize`` creates only this stage's shards)."""

    def __init__(self, full: Any, tp: TPContext, pp: int, stage: int, recompute: str,
                 autocast: Callable[[], ContextManager], act_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.tp, self.stage, self.num_stages = tp, stage, pp
        # the dtype of the activations (and their gradients) sent to the next stage: the training's
        # 16-bit dtype under mixed precision, half the bytes of the fp32 residual stream
        self.act_dtype = act_dtype
        self.is_first, self.is_last = stage == 0, stage == pp - 1
        self.recompute = recompute
        self.autocast = autocast
        self.rng: Optional[rng.RNGTracker] = None  # the dropout streams (rng.attach): restored for recompute
        self.vocab_size = int(full.vocab_size)
        self.vocab_start = tp.rank * (self.vocab_size // tp.size)
        start, end = stage_layers(len(full.blocks), pp, stage)
        self.layer_range = (start, end)
        self.embedding: Optional[VocabParallelEmbedding] = (VocabParallelEmbedding(full.embedding, tp)
                                                            if self.is_first else None)
        self.blocks = nn.ModuleList(ParallelBlock(full.blocks[i], tp) for i in range(start, end))
        self.final_norm: Optional[nn.Module] = None
        self.head: Optional[ParallelHead] = None
        self.tied = bool(full.tie_embeddings)
        self.head_is_copy = False  # the tied word embedding duplicated on the last stage
        if self.is_last:
            self.final_norm = mark_replicated(full.final_norm, tp)
            if full.tie_embeddings and self.embedding is not None:
                weight = self.embedding.weight  # same stage: the very same parameter
            elif full.tie_embeddings:
                word = full.embedding.word.weight
                weight = shard(word, chunk_of(word.shape[0], tp), tensor_parallel=True, sequence_parallel=False,
                               shared_embedding_copy=True)
                self.head_is_copy = True
            else:
                weight = shard(full.head.weight, chunk_of(full.head.weight.shape[0], tp), tensor_parallel=True,
                               sequence_parallel=False)
            self.head = ParallelHead(weight, tp)

    def set_recompute(self, mode: str) -> None:
        self.recompute = mode
        for block in self.blocks:
            block.attn.recompute_core = mode == "selective"

    def embedding_param(self) -> Optional[nn.Parameter]:
        """The word-embedding shard kept in sync across the embedding group (first stage: the table;
        last stage: the head copy), or None."""
        if self.tied and self.is_first and self.num_stages > 1:
            return self.embedding.weight
        if self.head_is_copy:
            return self.head.weight
        return None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with self.autocast():
            if self.embedding is not None:
                x = self.embedding(x)
            full = self.recompute == "full" and torch.is_grad_enabled()
            for block in self.blocks:
                x = rng.checkpoint(block, x, tracker=self.rng) if full else block(x)
            if self.head is not None:
                return self.head(self.final_norm(x))  # vocab-sharded logits, in the compute dtype (the loss upcasts)
        return x.to(self.act_dtype)


def activation_shape(micro_batch: int, seq_len: int, hidden: int, tp: TPContext) -> Tuple[int, int, int]:
    """Shape of the activations sent between stages (sequence-sharded under SP)."""
    return (micro_batch, seq_len // tp.size if tp.sequence_parallel else seq_len, hidden)


def build_schedule(stage_module: GPTStage, mesh: Any, n_microbatches: int, micro_batch: int, seq_len: int,
                   hidden: int, device: torch.device, loss_fn: Callable) -> Any:
    """A ``Schedule1F1B`` over ``PipelineStage(stage_module)`` on the mesh's pp group, with static
    shapes (no runtime shape inference: that would run the forward, collectives included, on
    uninitialised buffers)."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    tp = stage_module.tp
    # n_microbatches >= pp: a layout rule (launcher.config.rules.RULES), and Schedule1F1B's own check
    # requires_grad matters: it tells the stage to compute and send the input gradient upstream
    act = torch.empty(activation_shape(micro_batch, seq_len, hidden, tp), dtype=stage_module.act_dtype, device=device,
                      requires_grad=True)
    if stage_module.is_first:
        inputs: Any = torch.empty((micro_batch, seq_len), dtype=torch.long, device=device)
    else:
        inputs = act
    if stage_module.is_last:
        outputs: Any = torch.empty((micro_batch, seq_len, stage_module.vocab_size // tp.size),
                                   dtype=stage_module.act_dtype, device=device, requires_grad=True)
    else:
        outputs = act
    stage = PipelineStage(stage_module, mesh.pp_rank, mesh.pp, device, input_args=inputs, output_args=outputs,
                          group=mesh.pp_group)
    return Schedule1F1B(stage, n_microbatches, loss_fn=loss_fn, scale_grads=True)


__all__ = ["GPTStage", "activation_shape", "build_schedule", "stage_layers"]
