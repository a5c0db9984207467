"""Per-GPU memory: model states (parameters, gradients, optimizer), activations and buffers.

Model states, bytes per parameter (AdamW: exp_avg + exp_avg_sq):

    fp32, or 16-bit with engine ddp (torch autocast keeps fp32 weights):  params 4, grads 4, optimizer 8
    fp16/bf16 on deepspeed / megatron (16-bit weights, fp32 master):     params 2, grads 2, optimizer 12

ZeRO (Rajbhandari et al. 2020) shards across the dp ranks of a stage: stage >= 1 the optimizer
states, >= 2 the gradients, 3 the parameters; a shard is ceil(P / dp) (the engines pad the flat
buffer to a multiple of dp). For P parameters per rank, K = 12, 16-bit (the paper's Table 1):

    baseline 16 P,   P_os 4P + 12P/Nd,   P_os+g 2P + 14P/Nd,   P_os+g+p 16P/Nd

Offloaded states (zero.offload_optimizer: optimizer states and the fp32 gradient partition;
zero.offload_params: parameters) leave the GPU and are counted in ``cpu`` instead.

Activations per layer and micro-batch, in bytes (Korthikanti et al. 2022, "Reducing activation
recomputation in large transformer models", generalised to element size e, layer-norm input size
e_ln, dropout masks d = 1 byte when model.dropout > 0, ffn f, t = tp, a heads):

    replicated across tp  R = s b h (2 e_ln + 2 e + 2 d)     LN1/LN2 inputs, qkv/fc1 inputs, 2 masks
    split across tp       T = s b h * 4e + s b f * 2e         q, k, v, proj input; GELU and fc2 inputs
    attention core        C = a s^2 b (e + (1 + e) d)        softmax output (+ dropout mask, output)
                              or 4 a s b with a fused kernel (our GPT's SDPA: flash / mem-efficient
                              attention keeps only the fp32 log-sum-exp)

    no recompute:       R + (T + C)/t        (sequence parallel: (R + T + C)/t)
    selective:          R + T/t              (the attention core is recomputed)
    full:               s b h e_ln  per layer (/t with sequence parallel): the layer input only,
                        plus ONE layer's full activations, re-materialised during its backward

With e = e_ln = 2, d = 1, f = 4h and no fused attention this is the paper's s b h (34 + 5 a s / h)
(10 + 24/t + 5as/(ht) with tp; /t with sequence parallelism; 2 s b h under full recompute).

Pipeline (1F1B, Narayanan et al. 2021): stage i holds the activations of min(p - i, m) micro-batches,
so the first stage holds p (l/p layers each: as much as the whole model for one micro-batch) and the
last one. The first stage adds the embedding dropout mask, the last stage the final norm and head
inputs and the logits for one micro-batch: s b V/t (e + 4) (16-bit logits + fp32 log-softmax).
e is 2 for fp16/bf16, 4 for fp32; e_ln is 4 with engine ddp in 16-bit (autocast keeps the residual
stream in fp32), else e.

Buffers: ddp none (its gradients are views into the all-reduce buckets: gradient_as_bucket_view);
deepspeed ZeRO 0-2 a reduce bucket of min(5e8, P) gradient elements, ZeRO-3 the gathered largest layer,
4 x largest layer params (DeepSpeed's own estimate), and in 16-bit without optimizer offload the fp32 gradient
partition the optimizer step works on (4 P / dp; DeepSpeed's estimators count it too); megatron with
pp > 1 the send and receive buffers of a stage boundary, 2 s b h e (/t with sequence parallelism).

Every figure is per GPU, for the pipeline stage that needs the most (first or last).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

from recipes.gpt.plan.params import (
    StageParams,
    greedy_partition,
    largest_layer_params,
    stage_params,
    stage_tensor_sizes,
)
from recipes.gpt.plan.spec import LayoutSpec
from recipes.gpt.schema import ModelSpec

DEEPSPEED_REDUCE_BUCKET = 500_000_000  # reduce_bucket_size default, elements
FP32_GRAD = 4  # bytes per parameter of DeepSpeed's fp32 gradient partition (16-bit training)


def bytes_per_param(dtype: str, engine: str, zero: int = 0) -> Tuple[int, int, int]:
    """(params, grads, optimizer) bytes per parameter for AdamW. DDP (autocast keeps fp32 weights)
    and fp32 without ZeRO: 4 + 4 + 8 (m, v). 16-bit on deepspeed/megatron: 2 + 2 + 12 (fp32 master,
    m, v). DeepSpeed keeps an fp32 master copy at ZeRO >= 1 even in fp32: 4 + 4 + 12."""
    if engine == "ddp" or (dtype == "fp32" and not (engine == "deepspeed" and zero >= 1)):
        return 4, 4, 8
    if dtype == "fp32":
        return 4, 4, 12
    return 2, 2, 12


def shard(n: int, parts: int) -> int:
    """ceil(n / parts): one rank's share of a flat buffer padded to a multiple of ``parts``."""
    return -(-n // parts)


def model_state_bytes(
    n_params: int,
    dp: int = 1,
    zero: int = 0,
    per_param: Tuple[int, int, int] = (2, 2, 12),
    offload_optimizer: bool = False,
    offload_params: bool = False,
) -> Dict[str, int]:
    """GPU-resident model-state bytes of one rank holding ``n_params`` parameters (before ZeRO),
    data parallel over ``dp`` ranks with ZeRO ``zero``."""
    p, g, o = per_param
    part = shard(n_params, dp)
    return {
        "params": 0 if offload_params else p * (part if zero >= 3 else n_params),
        # ZeRO-2/3 with optimizer offload move the gradient partitions to host memory as well
        "grads": 0 if (offload_optimizer and zero >= 2) else g * (part if zero >= 2 else n_params),
        "optimizer": 0 if offload_optimizer else o * (part if zero >= 1 else n_params),
    }


def zero_paper_bytes(psi: float, nd: int, k: int = 12) -> Dict[str, float]:
    """Table 1 of the ZeRO paper: per-device model-state bytes for psi parameters, K bytes of optimizer
    state per parameter, data-parallel degree Nd: baseline (2+2+K)psi, P_os 2psi+2psi+K psi/Nd,
    P_os+g 2psi+(2+K)psi/Nd, P_os+g+p (2+2+K)psi/Nd (same as model_state_bytes with (2, 2, K))."""
    return {
        "baseline": (2 + 2 + k) * psi,
        "os": 2 * psi + 2 * psi + k * psi / nd,
        "os+g": 2 * psi + (2 + k) * psi / nd,
        "os+g+p": (2 + 2 + k) * psi / nd,
    }


# ---- DeepSpeed's estimators, written with the same per-parameter constants ----------------------


def deepspeed_zero2_estimate(
    total_params: int, num_gpus_per_node: int = 1, num_nodes: int = 1, cpu_offload: bool = True,
    additional_buffer_factor: float = 1.5,
) -> Tuple[int, int]:
    """(cpu_bytes, gpu_bytes) exactly as deepspeed.runtime.zero.stage_1_and_2.
    estimate_zero2_model_states_mem_needs. GPU: the 16-bit params (2 P) plus the ZeRO-2 shard of
    16-bit grads (2), fp32 grads (4) and fp32 master + Adam (12): 2P + 18P/N; with the optimizer
    offloaded only the 16-bit params stay. CPU (per node, DeepSpeed's heuristic): offloaded
    P * max(4 N, 16) * factor (16 = fp32 grads + master + Adam), else P * 4 * gpus_per_node * factor
    (an fp32 copy of the model per process while loading)."""
    p, g, o = bytes_per_param("bf16", "deepspeed")
    total_gpus = num_nodes * num_gpus_per_node
    if cpu_offload:
        gpu = p * total_params
        cpu = total_params * max(4 * total_gpus, FP32_GRAD + o) * additional_buffer_factor
    else:
        gpu = p * total_params + int((g + FP32_GRAD + o) * total_params / total_gpus)
        cpu = total_params * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu), int(gpu)


def deepspeed_zero3_estimate(
    total_params: int, largest_layer_params: int, num_gpus_per_node: int = 1, num_nodes: int = 1,
    cpu_offload: bool = True, cpu_offload_params: bool = True, zero_init: bool = True,
    additional_buffer_factor: float = 1.5,
) -> Tuple[int, int, int]:
    """(cpu_bytes, gpu_bytes, largest_layer_bytes) exactly as deepspeed.runtime.zero.stage3.
    estimate_zero3_model_states_mem_needs. The gathered largest layer costs 4 x its params (16-bit
    params + grads); the ZeRO-3 shard per parameter is 2 (16-bit params) + 4 (fp32 grads) + 12
    (fp32 master + Adam) = 18: GPU 4L + 18P/N; optimizer offloaded 4L + 2P/N (CPU 16 per parameter
    and node); params offloaded too 4L (CPU 18). CPU figures are per node (P/nodes each), x factor;
    without zero_init every process first builds an fp32 model (4 x gpus_per_node)."""
    p, g, o = bytes_per_param("bf16", "deepspeed")
    total_gpus = num_nodes * num_gpus_per_node
    gpus_factor = 1 / num_nodes
    largest = (p + g) * largest_layer_params
    if cpu_offload:
        if cpu_offload_params:
            gpu = largest
            per = p + FP32_GRAD + o
        else:
            gpu = largest + int(p * total_params / total_gpus)
            per = FP32_GRAD + o
        if zero_init:  # (same operation order as DeepSpeed, so the float rounding matches)
            cpu = total_params * per * gpus_factor * additional_buffer_factor
        else:
            cpu = total_params * max(4 * num_gpus_per_node, per * gpus_factor) * additional_buffer_factor
    else:
        gpu = largest + int((p + FP32_GRAD + o) * total_params / total_gpus)
        cpu = (largest_layer_params if zero_init else total_params) * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu), int(gpu), largest


# ---- activations ---------------------------------------------------------------------------------


def activation_bytes_per_element(dtype: str) -> int:
    return 4 if dtype == "fp32" else 2


def layer_activation_bytes(
    m: ModelSpec, micro_batch: int, tp: int = 1, sequence_parallel: bool = False, recompute: str = "none",
    e: int = 2, e_ln: Optional[int] = None, fused_attention: bool = True,
) -> Tuple[int, int]:
    """(stored, full): bytes one layer keeps per micro-batch under ``recompute``, and what it holds
    without recomputation (the working set while a fully-recomputed layer runs its backward)."""
    e_ln = e if e_ln is None else e_ln
    s, b, h, f, a = m.seq_len, micro_batch, m.hidden_size, m.ffn_hidden_size, m.num_heads
    d = 1 if m.dropout > 0 else 0
    sbh = s * b * h
    rep = sbh * (2 * e_ln + 2 * e + 2 * d)
    split = sbh * 4 * e + s * b * f * 2 * e
    core = 4 * a * s * b if fused_attention else a * s * s * b * (e + (1 + e) * d)
    if sequence_parallel:
        full = (rep + split + core) // tp
        sel = (rep + split) // tp
    else:
        full = rep + (split + core) // tp
        sel = rep + split // tp
    if recompute == "full":
        return sbh * e_ln // (tp if sequence_parallel else 1), full
    if recompute == "selective":
        return sel, full
    return full, full


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes per GPU on the pipeline stage that needs the most."""

    params: int
    grads: int
    optimizer: int
    activations: int
    buffers: int
    cpu: int  # offloaded states per process, in host memory
    stage: str  # "first", "last" or "only" (pp = 1)

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations + self.buffers

    def as_dict(self) -> Dict[str, int]:
        return {
            "params": self.params, "grads": self.grads, "optimizer": self.optimizer,
            "activations": self.activations, "buffers": self.buffers, "total": self.total,
        }


def layout_memory(m: ModelSpec, lay: LayoutSpec, sp: Optional[StageParams] = None,
                  activation_scale: float = 1.0) -> MemoryBreakdown:
    """Per-GPU memory of ``lay``: the larger of its first and last pipeline stage. Each stage's
    activation bytes are multiplied by ``activation_scale`` (the cluster's calibration,
    ``cluster.calibration.activation_scale``; 1 = the model above)."""
    sp = sp or stage_params(m, lay.tp, lay.pp)
    e = activation_bytes_per_element(lay.dtype)
    t_sp = lay.tp if lay.sequence_parallel else 1
    sbh = m.seq_len * lay.micro_batch_size * m.hidden_size
    best: Optional[MemoryBreakdown] = None
    for name, n_params, act in stage_activation_bytes(m, lay, sp, activation_scale):
        mem = _stage_memory(m, lay, n_params, act, sbh, e, t_sp, name)
        if best is None or mem.total > best.total:
            best = mem
    assert best is not None
    return best


def stage_activation_bytes(m: ModelSpec, lay: LayoutSpec, sp: Optional[StageParams] = None,
                           activation_scale: float = 1.0) -> Tuple[Tuple[str, int, int], ...]:
    """(stage, its parameters, its activation bytes x ``activation_scale``) of the first and the last
    pipeline stage, or of the only one ("only") with pp = 1."""
    sp = sp or stage_params(m, lay.tp, lay.pp)
    e = activation_bytes_per_element(lay.dtype)
    e_ln = 4 if (lay.engine == "ddp" and e == 2) else e
    tp, pp, b = lay.tp, lay.pp, lay.micro_batch_size
    t_sp = tp if lay.sequence_parallel else 1
    stored, full = layer_activation_bytes(m, b, tp, lay.sequence_parallel, lay.recompute, e, e_ln)
    work = full - stored if lay.recompute == "full" else 0
    sbh = m.seq_len * b * m.hidden_size
    emb_extra = sbh * (1 if m.dropout > 0 else 0) // t_sp
    head_extra = sbh * (e_ln + e) // t_sp + m.seq_len * b * (m.vocab_size // tp) * (e + 4)
    in_flight_first = min(pp, lay.grad_accum) if pp > 1 else 1
    layers = sp.layers_per_stage
    act_first = in_flight_first * (layers * stored + emb_extra) + work
    act_last = layers * stored + work + head_extra
    if pp == 1:
        out = (("only", sp.first, act_first + head_extra),)
    else:
        out = (("first", sp.first, act_first), ("last", sp.last, act_last))
    if activation_scale != 1.0:
        out = tuple((name, n, int(round(act * activation_scale))) for name, n, act in out)
    return out


def _stage_memory(m: ModelSpec, lay: LayoutSpec, n_params: int, act: int, sbh: int, e: int, t_sp: int,
                  name: str) -> MemoryBreakdown:
    per = bytes_per_param(lay.dtype, lay.engine, lay.zero)
    st = model_state_bytes(n_params, lay.dp, lay.zero, per, lay.offload_optimizer, lay.offload_params)
    part = shard(n_params, lay.dp)
    g_bytes = per[1]
    buffers = 0
    cpu = 0
    if lay.engine == "ddp":
        pass  # the gradients are views into DDP's buckets (gradient_as_bucket_view): no extra copy
    elif lay.engine == "deepspeed":
        if lay.zero >= 3:
            buffers = 4 * largest_layer_params(m, lay.tp)
        else:
            buffers = min(DEEPSPEED_REDUCE_BUCKET, n_params) * g_bytes
        if e == 2 and not lay.offload_optimizer and lay.zero >= 1:
            buffers += FP32_GRAD * part
    elif lay.pp > 1:  # megatron pipeline send/recv buffers
        buffers = 2 * sbh * e // t_sp
    if lay.offload_optimizer:
        cpu += (per[2] + (FP32_GRAD if e == 2 else 0)) * (part if lay.zero >= 1 else n_params)
    if lay.offload_params:
        cpu += per[0] * part
    return MemoryBreakdown(st["params"], st["grads"], st["optimizer"], act, buffers, cpu, name)


# ---- the exactness hook ----------------------------------------------------------------------------


def model_state_bytes_per_rank(cfg_like: Any, stage: Optional[int] = None,
                               dp_rank: Optional[int] = None) -> Dict[str, int]:
    """Bytes of parameters, gradients and optimizer state one rank holds on its device, exact for our
    GPT with AdamW (fp32 + DDP: 4 + 4 + 8 bytes per parameter).

    ``cfg_like`` is a run config (model, parallelism, zero, precision, cluster, train) naming a whole
    layout: dp, engine (``auto`` resolved) and offload are its ``launcher.config.layout.Layout``'s
    (``LayoutSpec.from_cfg``; raises ``ConfigErrors`` when it names none). The rank's parameters
    are its tensor-parallel share of pipeline stage ``stage`` (0-based; None = the stage holding
    the most: first or last), see recipes.gpt.plan.params; ZeRO then divides the optimizer states
    (stage >= 1), gradients (>= 2) and parameters (3) by dp (ceil); offloaded states count 0 here.
    Comparable to ``launcher.training.engines.engine.Engine.state_bytes()``."""
    lay = LayoutSpec.from_cfg(cfg_like)  # layout_of(Facts.from_cfg(cfg_like)) + dtype
    m = ModelSpec.from_cfg(cfg_like.model)
    tp, pp, dp, zero, engine = lay.tp, lay.pp, lay.dp, lay.zero, lay.engine
    sp = stage_params(m, tp, pp)
    n = sp.largest if stage is None else sp.stage(stage, pp)
    per = bytes_per_param(lay.dtype, engine, zero)
    out = model_state_bytes(n, dp, zero, per, lay.offload_optimizer, lay.offload_params)
    if engine == "megatron" and zero == 1 and dp > 1:
        # torch's ZeroRedundancyOptimizer shards whole tensors, greedily: model that exactly
        stages = range(pp) if stage is None else [stage]
        shares = [greedy_partition(list(stage_tensor_sizes(m, tp, pp, st)), dp) for st in stages]
        held = [sh[dp_rank] if dp_rank is not None else max(sh) for sh in shares]
        out["optimizer"] = per[2] * max(held)
    return out
