"""Enumerate every valid layout for a model, cluster and global batch, and rank them.

A layout is (dp, tp, pp, zero, micro batch, recompute, sequence parallel) on the config's world size
(cluster.nodes * cluster.gpus_per_node) and global batch, with the engine each implies
(``parallelism.engine=auto``, ``launcher.config.layout.implied_engine``).

The enumeration generates candidates: tp a divisor of the world, pp a divisor of world / tp, ZeRO
0..3, micro batches dividing the sequences one replica takes per step (dp = world / (tp pp) from
``launcher.config.layout.Facts``; none when dp does not divide the global batch), sequence parallelism off
and on. Whether a candidate is valid is decided by launcher.config.rules' table alone:
``ok(Facts, (VALUE, SHAPE, LAYOUT))`` (the rule table, no messages formatted) on the Facts of the
model, the cluster and the candidate (the same rules ``launcher.config.rules.problems`` applies to a run
config: tp dividing the heads, ffn and vocabulary and fitting in a node, pp dividing the layers,
dp * micro batch dividing the global batch, the ZeRO stages and offload each engine runs, a
micro-batch per pipeline stage, sequence parallelism needing tp > 1 dividing seq_len, ...). Recompute
(none, selective, full) is no rule's concern: every valid candidate is yielded once per mode.

No rule is restated here.

Offload is not searched: the config's zero.offload_* flags are kept where the rules allow them.
Layouts are ``LayoutSpec`` (a ``launcher.config.layout.Layout`` placed on the cluster's gpus_per_node, plus
recompute and dtype). Ranking: feasible first, then predicted step time, then memory.
"""
from __future__ import annotations

from typing import Dict, Iterator, List, Optional, Sequence, Tuple

from launcher.config.layout import Facts
from launcher.config.rules import LAYOUT, SHAPE, VALUE, layout_of, ok
from recipes.gpt.plan.estimate import Estimate, estimate
from recipes.gpt.plan.params import StageParams, stage_params
from recipes.gpt.plan.spec import ClusterSpec, LayoutSpec
from recipes.gpt.schema import ModelSpec

RECOMPUTE = ("none", "selective", "full")
ZERO_STAGES = (0, 1, 2, 3)  # candidates; the rules say which each engine runs
# What a candidate must satisfy (value rules always apply: sizes must be positive).
RULE_KINDS = (VALUE, SHAPE, LAYOUT)


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


def search_facts(m: ModelSpec, cluster: ClusterSpec, global_batch_size: int, dtype: str = "bf16") -> Facts:
    """The rule table's view of a search: the model, the cluster, the global batch and the precision,
    with the engine left to ``auto``. Each candidate sets its knobs on a copy."""
    return Facts(nodes=cluster.nodes, gpus_per_node=cluster.gpus_per_node, tp=1, pp=1, micro_batch_size=1,
                 global_batch_size=global_batch_size, model=m, dtype=dtype)


def valid(f: Facts) -> bool:
    """Whether the candidate ``f`` breaks none of the rules (launcher.config.rules decides)."""
    return ok(f, RULE_KINDS)


def enumerate_layouts(
    m: ModelSpec, cluster: ClusterSpec, global_batch_size: int, dtype: str = "bf16",
    offload_optimizer: bool = False, offload_params: bool = False,
) -> Iterator[LayoutSpec]:
    """Every valid layout, in a fixed order: tp, pp, ZeRO, micro batch ascending, then recompute
    (none, selective, full), then sequence parallelism (off, on)."""
    world = cluster.world_size
    base = search_facts(m, cluster, global_batch_size, dtype)
    for tp in divisors(world):
        for pp in divisors(world // tp):
            degrees = base.with_(tp=tp, pp=pp)
            # sequences per replica and step (grad_accum at micro batch 1); None: dp does not divide
            # the global batch, so no micro batch size can split it
            per_replica = degrees.grad_accum
            if per_replica is None:
                continue
            micro_batches = divisors(per_replica)  # ascending, from 1
            for zero in ZERO_STAGES:
                stage = degrees.with_(zero=zero)
                for mb in micro_batches:
                    f = stage.with_(micro_batch_size=mb)
                    if not valid(f):
                        continue
                    # the requested offload, where the rules allow it
                    if offload_optimizer and valid(f.with_(offload_optimizer=True)):
                        f = f.with_(offload_optimizer=True)
                    if offload_params and valid(f.with_(offload_params=True)):
                        f = f.with_(offload_params=True)
                    lays = [layout_of(f)]
                    split = f.with_(sequence_parallel=True)
                    if valid(split):
                        lays.append(layout_of(split))
                    for rc in RECOMPUTE:  # not a rule's concern
                        for lay in lays:
                            yield LayoutSpec.of(lay, rc, dtype)


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
