"""Enumerate every valid layout for a model, cluster and global batch, and rank them.

A layout is (dp, tp, pp, zero, micro batch, recompute, sequence parallel) on the config's world size
(cluster.nodes * cluster.gpus_per_node) and global batch. Valid means what launcher.layout.check
demands, with the engines each layout implies (``parallelism.engine=auto``):

    tp divides the world, the heads, the ffn and the vocabulary, and fits in a node
    pp divides world / tp and the layers;  dp = world / (tp pp) divides the global batch
    micro batch divides global / dp (grad_accum = global / (dp * micro))
    zero 0..3 with tp = pp = 1 (ddp, or deepspeed for zero > 0); 0..1 with tp or pp > 1 (megatron)
    sequence parallelism only with tp > 1; recompute none, selective or full

Offload is not searched: the config's zero.offload_* flags are kept where the layout allows them.
Ranking: feasible first, then predicted step time, then memory.
"""
from __future__ import annotations

from typing import Dict, Iterator, List, Optional, Sequence, Tuple

from launcher.plan.estimate import Estimate, estimate
from launcher.plan.params import ModelSpec, StageParams, stage_params
from launcher.plan.spec import ClusterSpec, LayoutSpec, implied_engine

RECOMPUTE = ("none", "selective", "full")


def divisors(n: int) -> List[int]:
    small, large = [], []
    i = 1
    while i * i <= n:
        if n % i == 0:
            small.append(i)
            if i * i != n:
                large.append(n // i)
        i += 1
    return small + large[::-1]


def model_parallel_degrees(m: ModelSpec, world: int, gpus_per_node: int) -> List[Tuple[int, int]]:
    """Every valid (tp, pp) for the model on ``world`` GPUs."""
    out = []
    for tp in divisors(world):
        if world > 1 and tp > gpus_per_node:
            continue
        if m.num_heads % tp or m.ffn_hidden_size % tp or m.vocab_size % tp or m.hidden_size % tp:
            continue
        for pp in divisors(world // tp):
            if m.num_layers % pp == 0:
                out.append((tp, pp))
    return out


def zero_stages(tp: int, pp: int) -> Sequence[int]:
    return (0, 1, 2, 3) if tp == 1 and pp == 1 else (0, 1)


def enumerate_layouts(
    m: ModelSpec, cluster: ClusterSpec, global_batch_size: int, dtype: str = "bf16",
    offload_optimizer: bool = False, offload_params: bool = False,
) -> Iterator[LayoutSpec]:
    world = cluster.world_size
    for tp, pp in model_parallel_degrees(m, world, cluster.gpus_per_node):
        dp = world // (tp * pp)
        if global_batch_size % dp:
            continue
        per_replica = global_batch_size // dp
        for zero in zero_stages(tp, pp):
            engine = implied_engine(tp, pp, zero)
            off_o = offload_optimizer and zero >= 1 and engine == "deepspeed"
            off_p = offload_params and zero == 3
            for mb in divisors(per_replica):
                if per_replica // mb < pp:  # 1F1B needs a micro-batch per pipeline stage
                    continue
                for rc in RECOMPUTE:
                    # sequence parallelism splits the sequence over tp
                    for seq in ((False, True) if tp > 1 and m.seq_len % tp == 0 else (False,)):
                        yield LayoutSpec(
                            dp=dp, tp=tp, pp=pp, zero=zero, micro_batch_size=mb, grad_accum=per_replica // mb,
                            recompute=rc, sequence_parallel=seq, dtype=dtype, engine=engine,
                            offload_optimizer=off_o, offload_params=off_p,
                        )


def rank_key(est: Estimate) -> Tuple[bool, float, int]:
    return (not est.feasible, est.timing.step_time_s, est.memory.total)


def evaluate_all(m: ModelSpec, cluster: ClusterSpec, layouts: Sequence[LayoutSpec]) -> List[Estimate]:
    cache: Dict[Tuple[int, int], StageParams] = {}
    out = []
    for lay in layouts:
        key = (lay.tp, lay.pp)
        sp = cache.get(key)
        if sp is None:
            sp = cache[key] = stage_params(m, lay.tp, lay.pp)
        out.append(estimate(m, cluster, lay, sp))
    return out


def search(
    m: ModelSpec, cluster: ClusterSpec, global_batch_size: int, dtype: str = "bf16",
    offload_optimizer: bool = False, offload_params: bool = False, top: Optional[int] = None,
) -> List[Estimate]:
    """Every valid layout, estimated and ranked (feasible first, then by predicted step time)."""
    layouts = list(enumerate_layouts(m, cluster, global_batch_size, dtype, offload_optimizer, offload_params))
    ranked = sorted(evaluate_all(m, cluster, layouts), key=rank_key)
    return ranked[:top] if top else ranked
