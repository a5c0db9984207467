"""One layout's full estimate (memory, communication, time) and its JSON form."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

from recipes.gpt.plan.comm import CommVolume, comm_volume
from recipes.gpt.plan.flops import step_flops
from recipes.gpt.plan.memory import MemoryBreakdown, layout_memory
from recipes.gpt.plan.params import StageParams, param_count, param_count_formula, stage_params
from recipes.gpt.plan.spec import GIB, HEADROOM, ClusterSpec, LayoutSpec
from recipes.gpt.plan.timing import Timing, predict
from recipes.gpt.schema import ModelSpec


def gib(n: float) -> str:
    return f"{n / GIB:.1f}"


@dataclass(frozen=True)
class Estimate:
    layout: LayoutSpec
    memory: MemoryBreakdown
    comm: CommVolume
    timing: Timing
    feasible: bool
    reasons: Tuple[str, ...]

    @property
    def step_time_s(self) -> float:
        return self.timing.step_time_s

    def as_json(self) -> Dict[str, Any]:
        lay, t = self.layout, self.timing
        return {
            "dp": lay.dp,
            "tp": lay.tp,
            "pp": lay.pp,
            "zero": lay.zero,
            "micro_batch_size": lay.micro_batch_size,
            "grad_accum": lay.grad_accum,
            "recompute": lay.recompute,
            "sequence_parallel": lay.sequence_parallel,
            "engine": lay.engine,
            "dtype": lay.dtype,
            "offload_optimizer": lay.offload_optimizer,
            "offload_params": lay.offload_params,
            "feasible": self.feasible,
            "memory_bytes": self.memory.as_dict(),
            "memory_stage": self.memory.stage,
            "cpu_offload_bytes": self.memory.cpu,
            "bubble": round(t.bubble, 6),
            "comm_bytes": self.comm.as_dict(),
            "step_time_s": t.step_time_s,
            "tflops_per_gpu": t.tflops_per_gpu,
            "mfu": t.mfu,
            "reasons": list(self.reasons),
        }


def estimate(m: ModelSpec, cluster: ClusterSpec, lay: LayoutSpec, sp: Optional[StageParams] = None) -> Estimate:
    """Memory, communication and time of ``lay``; infeasible when it does not fit the GPU memory (or the
    host memory its offloaded states need). The estimate is complete either way. The cluster's
    calibration (``cluster.calibration``) scales activation memory and step time."""
    sp = sp or stage_params(m, lay.tp, lay.pp)
    mem = layout_memory(m, lay, sp, cluster.calibration.activation_scale)
    comm = comm_volume(m, lay, sp)
    timing = predict(m, cluster, lay, comm, sp)
    reasons = []
    if cluster.memory_bytes and mem.total > cluster.usable_bytes:
        reasons.append(
            f"needs {gib(mem.total)} GiB per GPU ({mem.stage} pipeline stage), more than the "
            f"{gib(cluster.usable_bytes)} GiB usable of {gib(cluster.memory_bytes)} GiB "
            f"({cluster.memory_source}; {HEADROOM:.0%} headroom)"
        )
    if mem.cpu and cluster.node_memory_bytes:
        per_node = mem.cpu * cluster.gpus_per_node
        if per_node > cluster.node_memory_bytes * (1.0 - HEADROOM):
            reasons.append(
                f"offloaded states need {gib(per_node)} GiB of host memory per node, more than "
                f"{HEADROOM:.0%}-headroom share of cluster.mem_gb={cluster.node_memory_bytes / GIB:g}"
            )
    return Estimate(lay, mem, comm, timing, not reasons, tuple(reasons))


def model_json(m: ModelSpec, global_batch_size: int) -> Dict[str, Any]:
    return {
        "name": m.name,
        "params": param_count(m),
        "params_formula": param_count_formula(m.num_layers, m.hidden_size, m.vocab_size, m.seq_len),
        "num_layers": m.num_layers,
        "hidden_size": m.hidden_size,
        "num_heads": m.num_heads,
        "ffn_hidden_size": m.ffn_hidden_size,
        "vocab_size": m.vocab_size,
        "seq_len": m.seq_len,
        "tie_embeddings": m.tie_embeddings,
        "global_batch_size": global_batch_size,
        "tokens_per_step": global_batch_size * m.seq_len,
        "model_flops_per_step": step_flops(m, global_batch_size, "none"),
    }


def cluster_json(c: ClusterSpec) -> Dict[str, Any]:
    return {
        "name": c.name,
        "nodes": c.nodes,
        "gpus_per_node": c.gpus_per_node,
        "world_size": c.world_size,
        "memory_bytes": c.memory_bytes,
        "usable_bytes": c.usable_bytes,
        "memory_source": c.memory_source if c.memory_bytes else "unknown (no memory check)",
        "headroom": HEADROOM,
        "peak_tflops": c.peak_flops / 1e12,
        "intra_node_gbps": c.intra_bw / 1e9,
        "inter_node_gbps": c.inter_bw / 1e9,
        "assumed": list(c.assumed),
        **({} if c.calibration.is_default else {"calibration": c.calibration.as_dict()}),
    }
