"""Training FLOPs of our GPT per token and per step (a multiply-add counts 2 FLOPs).

Forward, per token and layer (s keys per query; causal masking NOT discounted, the PaLM /
Megatron-LM convention):

    matmuls    2 * (3h^2 + h^2 + 2hf) = 2 * (4h^2 + 2hf)       qkv, proj, fc1, fc2
    attention  4 * s * h                                       q k^T (2sh) and softmax(..) v (2sh)

plus the output head 2 * h * V per token (the tied or untied head is always a matmul; token and
position lookups, biases, norms, GELU and softmax are not counted). Backward costs twice the forward.

    model FLOPs / token = 6 * (l(4h^2 + 2hf) + hV) + 12 * l * h * s
                        = 6 * N_matmul + 12 * l * h * s
                        = 72 * l * h^2 * (1 + s/(6h) + V/(12 l h))             when f = 4h

which is the count MFU uses (``model_flops_per_token``; the recipes compute MFU from it). Recomputation
re-runs forward work, counted in the hardware FLOPs (what the GPUs execute, what step time is
predicted from, and what Megatron-LM reports as TFLOP/s per GPU):

    selective (attention core):  + 4 * l * h * s              (attention term 16 l h s instead of 12)
    full (every layer):          + l * (2(4h^2 + 2hf) + 4hs)  (8 * N_layers + 6 * hV + 16 l h s)
                        = 96 * l * h^2 * (1 + s/(6h) + V/(16 l h))             when f = 4h

(Narayanan et al. 2021, "Efficient large-scale language model training on GPU clusters", eq. 3.)
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from recipes.gpt.schema import ModelSpec

RECOMPUTE_MODES = ("none", "selective", "full")


@dataclass(frozen=True)
class ForwardFlops:
    """Forward FLOPs per token, split by where they run."""

    layer_matmul: float  # one layer's weight matmuls
    layer_attention: float  # one layer's q k^T and attention-weighted sum
    head: float  # the output projection to the vocabulary

    def layer(self) -> float:
        return self.layer_matmul + self.layer_attention


@lru_cache(maxsize=256)  # pure in a frozen ModelSpec; the search asks for the same model thousands of times
def forward_flops_per_token(m: ModelSpec) -> ForwardFlops:
    h, f = m.hidden_size, m.ffn_hidden_size
    return ForwardFlops(
        layer_matmul=2.0 * (4 * h * h + 2 * h * f),
        layer_attention=4.0 * m.seq_len * h,
        head=2.0 * h * m.vocab_size,
    )


@lru_cache(maxsize=1024)
def layer_training_flops_per_token(m: ModelSpec, recompute: str = "none") -> float:
    """One layer, forward + backward (+ recomputation), per token."""
    fw = forward_flops_per_token(m)
    flops = 3.0 * fw.layer()
    if recompute == "selective":
        flops += fw.layer_attention
    elif recompute == "full":
        flops += fw.layer()
    return flops


@lru_cache(maxsize=1024)
def training_flops_per_token(m: ModelSpec, recompute: str = "none") -> float:
    """Forward + backward FLOPs per token; ``recompute="none"`` gives the model FLOPs (for MFU)."""
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"train.recompute must be one of {RECOMPUTE_MODES}, got {recompute!r}")
    return m.num_layers * layer_training_flops_per_token(m, recompute) + 3.0 * forward_flops_per_token(m).head


def model_flops_per_token(m: ModelSpec) -> float:
    """The model FLOPs per token, 6 * N_matmul + 12 * l * h * s (forward + backward, no recomputation):
    what MFU divides by the peak."""
    return training_flops_per_token(m, "none")


def step_flops(m: ModelSpec, global_batch_size: int, recompute: str = "none") -> float:
    """FLOPs of one optimizer step over ``global_batch_size`` sequences of ``seq_len`` tokens."""
    return training_flops_per_token(m, recompute) * global_batch_size * m.seq_len


def narayanan_flops_per_step(m: ModelSpec, global_batch_size: int, recompute_full: bool) -> float:
    """The closed form of Narayanan et al. (f = 4h assumed):
    72 B s l h^2 (1 + s/(6h) + V/(12 l h)) without recomputation, 96 B s l h^2 (1 + s/(6h) + V/(16 l h))
    with full recomputation."""
    b, s, l, h, v = global_batch_size, m.seq_len, m.num_layers, m.hidden_size, m.vocab_size
    if recompute_full:
        return 96.0 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))
    return 72.0 * b * s * l * h * h * (1 + s / (6 * h) + v / (12 * l * h))
