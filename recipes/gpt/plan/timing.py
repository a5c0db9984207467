"""Predicted step time, TFLOP/s per GPU and MFU from FLOPs, bytes, peak FLOP/s and link bandwidths.

A step runs m micro-batches through a 1F1B pipeline of p stages. One micro-batch on the slowest
stage takes

    t_mb = F_stage / (peak * eta)  +  TP bytes / intra-node bandwidth  +  PP bytes / link bandwidth

where F_stage is the stage's hardware FLOPs for the micro-batch on one tp rank (l/p layers, with
recomputation; the last stage adds the head), and the pipeline takes (m + p - 1) t_mb: the bubble
fraction is (p-1)/(m+p-1). eta, the achieved fraction of peak, is a saturating GEMM-size model,
eta = 0.70 x / (x + 2^18) with x = b s h / t the size of a layer's activation on one tp rank (small
micro-batches and narrow tp shards run further from peak; 0.70 is what well-shaped bf16 GEMMs
reach on A100/H100).

Data-parallel traffic is overlapped where the engines overlap it: DDP / ZeRO-1 gradient reduction
with the backward of the last micro-batch (2/3 of its compute), ZeRO-2 reduce-scatters with every
backward, ZeRO-3 gathers with every forward + backward; only the excess counts, and the ZeRO 1-2
parameter all-gather after the optimizer step does not overlap. Optimizer offload adds the PCIe
round trip of the shard (grads down, params up, 25 GB/s) and a CPU Adam at 1e9 parameters/s per
process; parameter offload fetches the 16-bit shard over PCIe twice per micro-batch.

Placement (the order of ranks): tp innermost, then pp, then dp outermost. A group whose span
(its size times the product of the inner sizes) exceeds the GPUs of a node crosses nodes and runs
at the inter-node bandwidth. TP never crosses nodes (launcher.config.rules rejects it).

    step_time = (m + p - 1) t_mb + exposed DP time + offload time

Calibration (``cluster.calibration``, fitted from measured runs by recipes/gpt/plan/calibrate.py)
scales the parts: compute time by compute_scale, TP, PP and exposed DP time by comm_scale, and adds
step_overhead_s per step; the overlap of DP traffic with the backward is decided on the uncalibrated
figures, so the step time is linear in the constants (``StepParts``), which is what the fit solves:

    step_time = compute_scale (m + p - 1) t_compute + comm_scale ((m + p - 1)(t_tp + t_pp) + exposed DP)
                + offload time + step_overhead_s

    TFLOP/s per GPU = hardware FLOPs per step (with recomputation) / step_time / world
    MFU = model FLOPs per step (without recomputation) / (step_time * world * peak)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from recipes.gpt.plan.comm import CommVolume
from recipes.gpt.plan.flops import forward_flops_per_token, layer_training_flops_per_token, step_flops
from recipes.gpt.plan.memory import bytes_per_param, shard
from recipes.gpt.plan.params import StageParams
from recipes.gpt.plan.spec import Calibration, ClusterSpec, LayoutSpec
from recipes.gpt.schema import ModelSpec

GEMM_EFFICIENCY_MAX = 0.70
GEMM_HALF_SIZE = float(1 << 18)
PCIE_BANDWIDTH = 25e9  # bytes/s host <-> device
CPU_ADAM_PARAMS_PER_S = 1e9  # per process


def gemm_efficiency(micro_batch: int, seq_len: int, hidden: int, tp: int) -> float:
    x = micro_batch * seq_len * hidden / tp
    return GEMM_EFFICIENCY_MAX * x / (x + GEMM_HALF_SIZE)


def bubble_fraction(pp: int, micro_batches: int) -> float:
    """(p - 1) / (m + p - 1): the idle share of a 1F1B (or GPipe) pipeline step."""
    return (pp - 1) / (micro_batches + pp - 1)


def spans_nodes(inner: int, size: int, gpus_per_node: int) -> bool:
    """Whether a group of ``size`` ranks spaced ``inner`` apart crosses a node boundary."""
    return size > 1 and inner * size > gpus_per_node


@dataclass(frozen=True)
class StepParts:
    """A step's uncalibrated predicted time split as the calibration scales it."""

    compute_s: float  # (m + p - 1) x compute per micro-batch
    comm_s: float  # (m + p - 1) x (TP + PP per micro-batch) + exposed DP
    other_s: float  # offload (PCIe, CPU Adam): not scaled

    def step_time(self, cal: Calibration) -> float:
        """The step time ``predict`` gives with calibration ``cal``."""
        return (cal.compute_scale * self.compute_s + cal.comm_scale * self.comm_s + self.other_s
                + cal.step_overhead_s)


@dataclass(frozen=True)
class Timing:
    step_time_s: float
    micro_batch_s: float  # t_mb on the slowest stage
    compute_s: float  # compute part of t_mb
    tp_s: float  # TP part of t_mb
    pp_s: float  # PP part of t_mb
    dp_exposed_s: float
    offload_s: float
    bubble: float
    hardware_flops: float  # per step, all GPUs, with recomputation
    model_flops: float  # per step, all GPUs, without recomputation
    tflops_per_gpu: float
    mfu: Optional[float]  # None when the cluster's peak is unknown
    dp_link: str  # "intra" or "inter"
    zero3_comm_s: float  # ZeRO-3 collectives per micro-batch (for the slow-link warning)
    parts: StepParts  # uncalibrated: parts.step_time(cluster.calibration) == step_time_s


def predict(m: ModelSpec, cluster: ClusterSpec, lay: LayoutSpec, comm: CommVolume, sp: StageParams) -> Timing:
    t, pp, d, b, mb = lay.tp, lay.pp, lay.dp, lay.micro_batch_size, lay.grad_accum
    tokens = b * m.seq_len
    fw = forward_flops_per_token(m)
    layers = sp.layers_per_stage * layer_training_flops_per_token(m, lay.recompute) * tokens / t
    head = 3.0 * fw.head * tokens / t
    stage_flops = layers + head  # the last (or only) stage is the slowest: it also runs the head
    eta = gemm_efficiency(b, m.seq_len, m.hidden_size, t)
    compute = stage_flops / (cluster.peak_flops * eta)
    gpn = cluster.gpus_per_node
    tp_s = comm.tp_micro / cluster.intra_bw if t > 1 else 0.0
    pp_bw = cluster.inter_bw if spans_nodes(t, pp, gpn) else cluster.intra_bw
    pp_s = comm.pp_micro / pp_bw if pp > 1 else 0.0
    bubble = bubble_fraction(pp, mb)

    inter = spans_nodes(t * pp, d, gpn)
    dp_bw = cluster.inter_bw if inter else cluster.intra_bw
    backward = compute * 2.0 / 3.0
    exposed = max(0.0, comm.dp_step / dp_bw - backward) + comm.dp_after / dp_bw
    zero3_s = 0.0
    if comm.dp_micro:
        per_micro = comm.dp_micro / dp_bw
        window = compute if lay.zero >= 3 else backward
        exposed += mb * max(0.0, per_micro - window)
        if lay.zero >= 3:
            zero3_s = per_micro
    offload = 0.0
    p_bytes, g_bytes, _ = bytes_per_param(lay.dtype, lay.engine, lay.zero)
    part = shard(sp.largest, d)
    if lay.offload_optimizer:
        offload += part * (g_bytes + p_bytes) / PCIE_BANDWIDTH + part / CPU_ADAM_PARAMS_PER_S
    if lay.offload_params:
        offload += mb * 2 * part * p_bytes / PCIE_BANDWIDTH
    slots = mb + pp - 1
    parts = StepParts(slots * compute, slots * (tp_s + pp_s) + exposed, offload)
    cal = cluster.calibration
    compute, tp_s, pp_s = compute * cal.compute_scale, tp_s * cal.comm_scale, pp_s * cal.comm_scale
    exposed, zero3_s = exposed * cal.comm_scale, zero3_s * cal.comm_scale
    t_mb = compute + tp_s + pp_s
    step = slots * t_mb + exposed + offload + cal.step_overhead_s

    gbs = d * b * mb
    hw = step_flops(m, gbs, lay.recompute)
    model = step_flops(m, gbs, "none")
    world = d * t * pp
    return Timing(
        step_time_s=step,
        micro_batch_s=t_mb,
        compute_s=compute,
        tp_s=tp_s,
        pp_s=pp_s,
        dp_exposed_s=exposed,
        offload_s=offload,
        bubble=bubble,
        hardware_flops=hw,
        model_flops=model,
        tflops_per_gpu=hw / step / world / 1e12,
        mfu=model / (step * world * cluster.peak_flops) if cluster.peak_known else None,
        dp_link="inter" if inter else "intra",
        zero3_comm_s=zero3_s,
        parts=parts,
    )

