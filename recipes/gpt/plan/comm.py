"""Communication volume per step: bytes one GPU sends, per parallelism dimension.

Ring collectives over n ranks on a buffer of N bytes send, per rank: all-reduce 2 (n-1)/n N,
reduce-scatter and all-gather (n-1)/n N each. P is the parameter count of the rank (its tp share of
the largest pipeline stage), p / g its bytes per parameter and gradient (recipes.gpt.plan.memory), m the
micro-batches per step, A = s b h e the activation of one micro-batch (e = 2 in 16-bit, 4 in fp32).

Data parallel (d ranks; Rajbhandari et al. 2020 sec. 7):
    ZeRO 0 (DDP / Megatron)  all-reduce of the gradients once per step        2 (d-1)/d P g
    ZeRO 1                   reduce-scatter of the gradients once per step    (d-1)/d P g
                             + all-gather of the updated parameters            (d-1)/d P p
    ZeRO 2                   reduce-scatter after EVERY micro-batch (a rank keeps only its gradient
                             shard, so accumulation happens after reducing)    m (d-1)/d P g
                             + all-gather of the parameters                    (d-1)/d P p
    ZeRO 3                   per micro-batch: all-gather parameters for the forward and again for
                             the backward, reduce-scatter the gradients        m (d-1)/d P (2p + g)
    (with m = 1 and g = p: 2, 2, 2 and 3 times P p, the paper's 2Psi / 2Psi / 3Psi)

Tensor parallel (t ranks, Megatron-LM; Korthikanti et al. 2022): per layer and micro-batch two
all-reduces of A in the forward (after attention and MLP) and two in the backward, 4 x 2 (t-1)/t A;
with sequence parallelism each all-reduce becomes an all-gather + reduce-scatter pair, the same
volume; full recomputation re-runs the forward's two. Plus the vocab-parallel embedding's forward
all-reduce, the head input's backward all-reduce (2 (t-1)/t A each) and the cross-entropy's three
all-reduces of s b fp32 values.

Pipeline parallel: each micro-batch's activation goes forward and its gradient back across a stage
boundary, A each (A / t with sequence parallelism, the tensor already split); with tied embeddings
the first and last stage all-reduce the word-embedding gradient once per step (V h / t x g).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict

from recipes.gpt.plan.memory import activation_bytes_per_element, bytes_per_param
from recipes.gpt.plan.params import StageParams
from recipes.gpt.plan.spec import LayoutSpec
from recipes.gpt.schema import ModelSpec


@dataclass(frozen=True)
class CommVolume:
    """Bytes sent by one GPU, split by when they happen (the timing model needs the split)."""

    dp_step: float  # once per step, overlappable with the last backward (DDP all-reduce, ZeRO-1 reduce-scatter)
    dp_after: float  # once per step after the optimizer (ZeRO 1-2 parameter all-gather), not overlapped
    dp_micro: float  # per micro-batch (ZeRO-2 reduce-scatter; ZeRO-3 all-gathers + reduce-scatter)
    tp_micro: float  # per micro-batch, on the critical path
    pp_micro: float  # per micro-batch, on the critical path
    pp_step: float  # once per step (tied-embedding gradient all-reduce)
    micro_batches: int

    @property
    def dp(self) -> float:
        return self.dp_step + self.dp_after + self.micro_batches * self.dp_micro

    @property
    def tp(self) -> float:
        return self.micro_batches * self.tp_micro

    @property
    def pp(self) -> float:
        return self.micro_batches * self.pp_micro + self.pp_step

    def as_dict(self) -> Dict[str, int]:
        return {"dp": int(self.dp), "tp": int(self.tp), "pp": int(self.pp)}


def comm_volume(m: ModelSpec, lay: LayoutSpec, sp: StageParams) -> CommVolume:
    p_bytes, g_bytes, _ = bytes_per_param(lay.dtype, lay.engine, lay.zero)
    e = activation_bytes_per_element(lay.dtype)
    n_params = sp.largest
    d, t, pp, mb = lay.dp, lay.tp, lay.pp, lay.grad_accum
    dp_step = dp_after = dp_micro = 0.0
    if d > 1:
        frac = (d - 1) / d
        if lay.zero == 0:
            dp_step = 2 * frac * n_params * g_bytes
        elif lay.zero == 1:
            dp_step = frac * n_params * g_bytes
            dp_after = frac * n_params * p_bytes
        elif lay.zero == 2:
            dp_micro = frac * n_params * g_bytes
            dp_after = frac * n_params * p_bytes
        else:
            dp_micro = frac * n_params * (2 * p_bytes + g_bytes)
    act = m.seq_len * lay.micro_batch_size * m.hidden_size * e
    tp_micro = 0.0
    if t > 1:
        ar = 2 * (t - 1) / t * act
        per_layer = (6 if lay.recompute == "full" else 4) * ar
        ends = 2 if pp == 1 else 1  # embedding forward + head backward all-reduce
        loss = 3 * 2 * (t - 1) / t * m.seq_len * lay.micro_batch_size * 4
        tp_micro = sp.layers_per_stage * per_layer + ends * ar + loss
    pp_micro = pp_step = 0.0
    if pp > 1:
        pp_micro = 2 * act / (t if lay.sequence_parallel else 1)
        if m.tie_embeddings:
            pp_step = m.vocab_size * m.hidden_size / t * g_bytes
    return CommVolume(dp_step, dp_after, dp_micro, tp_micro, pp_micro, pp_step, mb)
