"""Parameter counts of our GPT (recipes/gpt/model.py), whole and per rank. Pure integer arithmetic.

Notation: l layers, h hidden, f ffn hidden, V vocab, s sequence length (learned positions), t = tp,
p = pp. Per decoder layer (pre-LN block):

    ln1 2h + qkv (3h*h + 3h) + proj (h*h + h) + ln2 2h + fc1 (h*f + f) + fc2 (f*h + h)
      = 4h^2 + 2hf + 9h + f                                  (= 12h^2 + 13h when f = 4h)

Whole model: V*h (token embedding) + s*h (positions) + l * layer + 2h (final norm)
+ V*h more when the head is untied (no bias). The usual formula (Narayanan et al. 2021; Megatron-LM)
12*l*h^2*(1 + 13/(12h) + (V+s)/(12*l*h)) = 12lh^2 + 13lh + (V+s)h is exact for f = 4h, tied
embeddings, without the final norm: our count = formula + 2h.

Per tensor-parallel rank (Megatron split): qkv and fc1 are column-parallel (weight and bias split by
t), proj and fc2 row-parallel (weight split, bias replicated), layer norms replicated, the token
embedding vocab-parallel (V/t rows), position embedding replicated, head column-parallel:

    layer/t-rank = (4h^2 + 2hf + 3h + f)/t + 6h

Per pipeline stage: l/p layers each; the first stage also holds the embeddings (V*h/t + s*h), the
last the final norm (2h) and the head (V*h/t: the untied head, or with tied embeddings and p > 1 a
copy of the word embedding that Megatron keeps in sync with an all-reduce). With p = 1 one stage
holds everything and a tied head adds nothing.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Tuple

from recipes.gpt.schema import ModelSpec


def layer_params(m: ModelSpec) -> int:
    """Parameters of one decoder layer: 4h^2 + 2hf + 9h + f."""
    h, f = m.hidden_size, m.ffn_hidden_size
    return 4 * h * h + 2 * h * f + 9 * h + f


def param_count(m: ModelSpec) -> int:
    """Exact number of distinct parameters of recipes.gpt.model.GPT (a tied weight counts once):
    equals ``count_parameters(GPT(cfg.model))``."""
    h, v, s = m.hidden_size, m.vocab_size, m.seq_len
    head = 0 if m.tie_embeddings else v * h
    return v * h + s * h + m.num_layers * layer_params(m) + 2 * h + head


def param_count_formula(num_layers: int, hidden_size: int, vocab_size: int, seq_len: int) -> int:
    """The usual formula 12*l*h^2*(1 + 13/(12h) + (V+s)/(12*l*h)), evaluated exactly in integers:
    12lh^2 + 13lh + (V+s)h. Assumes f = 4h, tied embeddings, and ignores the final norm."""
    l, h = num_layers, hidden_size
    return 12 * l * h * h + 13 * l * h + (vocab_size + seq_len) * h


def layer_params_per_tp_rank(m: ModelSpec, tp: int) -> int:
    """One layer's parameters on one tensor-parallel rank: (4h^2 + 2hf + 3h + f)/t + 6h
    (layer norms and the two row-parallel biases are replicated on every tp rank)."""
    h, f = m.hidden_size, m.ffn_hidden_size
    split = 4 * h * h + 2 * h * f + 3 * h + f
    return split // tp + 6 * h


@dataclass(frozen=True)
class StageParams:
    """Parameters held by one rank of the first and of the last pipeline stage (equal when pp=1)."""

    layers_per_stage: int
    layer: int  # one layer on one tp rank
    first: int
    last: int

    @property
    def largest(self) -> int:
        return max(self.first, self.last)

    def stage(self, index: int, pp: int) -> int:
        """Parameters on a rank of stage ``index`` (0-based) of ``pp``."""
        if index == 0:
            return self.first
        if index == pp - 1:
            return self.last
        return self.layers_per_stage * self.layer


def stage_params(m: ModelSpec, tp: int = 1, pp: int = 1) -> StageParams:
    """Per-rank parameter counts for a tp x pp split (see the module docstring)."""
    h, v, s = m.hidden_size, m.vocab_size, m.seq_len
    per_stage = m.num_layers // pp
    layer = layer_params_per_tp_rank(m, tp)
    word = v * h // tp
    body = per_stage * layer
    if pp == 1:
        total = body + word + s * h + 2 * h + (0 if m.tie_embeddings else word)
        return StageParams(per_stage, layer, total, total)
    # untied: the head; tied with pp > 1: the last stage's copy of the word embedding
    return StageParams(per_stage, layer, body + word + s * h, body + 2 * h + word)


def largest_layer_params(m: ModelSpec, tp: int = 1) -> int:
    """Largest number of parameters held directly by one module (DeepSpeed's ``largest_layer_params``
    in deepspeed.runtime.zero.stage3.model_to_params: max over modules of their own parameters).
    For our GPT: the word embedding V*h, the untied head V*h, fc1 (hf + f), fc2 (fh + h), qkv."""
    h, f, v = m.hidden_size, m.ffn_hidden_size, m.vocab_size
    return max(
        v * h // tp,
        m.seq_len * h,
        (3 * h * h + 3 * h) // tp,
        (h * f + f) // tp,
        f * h // tp + h,
        h * h // tp + h,
    )


def stage_tensor_sizes(m: ModelSpec, tp: int, pp: int, stage: int) -> Tuple[List[int], List[int]]:
    """Element counts of every parameter tensor one tp rank of pipeline stage ``stage`` holds, split
    into (matrices, vectors): the AdamW groups with and without weight decay, in that order."""
    h, f, v, s = m.hidden_size, m.ffn_hidden_size, m.vocab_size, m.seq_len
    first, last = stage == 0, stage == pp - 1
    matrices: List[int] = []
    vectors: List[int] = []
    if first:
        matrices += [v * h // tp, s * h]
    for _ in range(m.num_layers // pp):
        matrices += [3 * h * h // tp, h * h // tp, f * h // tp, h * f // tp]  # qkv, proj, fc1, fc2
        vectors += [h, h, 3 * h // tp, h, h, h, f // tp, h]  # ln1, qkv bias, proj bias, ln2, fc1/fc2 bias
    if last:
        vectors += [h, h]  # final norm
        if not m.tie_embeddings or pp > 1:  # the untied head, or the last stage's embedding copy
            matrices.append(v * h // tp)
    return matrices, vectors


def greedy_partition(groups: List[List[int]], parts: int) -> List[int]:
    """Elements each rank gets from torch's ZeroRedundancyOptimizer: per parameter group, tensors
    largest first, each to the rank holding the fewest elements so far (lowest rank on ties)."""
    sizes = [0] * parts
    for group in groups:
        for n in sorted(group, reverse=True):
            r = sizes.index(min(sizes))
            sizes[r] += n
    return sizes
