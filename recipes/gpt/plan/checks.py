"""Pre-submit checks: will this run fit, and is it laid out sensibly? Run by `launch` on every point.

Errors (stop the launch, ``submit.force`` does not help):
  - the estimated per-GPU memory exceeds the usable memory: cluster.gpu.memory_gb (GiB) less 10%
    headroom; with memory_gb = 0 on the local backend, this host's MemAvailable shared by its
    processes; on Slurm with memory_gb = 0 the check is skipped (unknown). The error names the key of
    the smallest layout change that fits (fewest keys changed, same world size and global batch,
    fastest predicted among those; it must also pass launcher.config.rules.problems), or
    cluster.gpu.memory_gb when none does.
  - offloaded states exceed the node's host memory (cluster.mem_gb, when set).
Warnings (stop the launch unless submit.force=true):
  - pipeline bubble (p-1)/(m+p-1) above 25%;
  - ZeRO-3 whose data-parallel group crosses nodes over a link too slow for its per-micro-batch
    all-gathers and reduce-scatter to hide behind the compute (predicted collective time > compute).
The recipe whose contract names this planner (launcher.config.recipe_contract) is checked; a recipe without
one gets no plan.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Optional, Tuple

from launcher.config.errors import ConfigError
from launcher.config.layout import Facts, Layout
from launcher.config.recipe_contract import CheckResult
from launcher.config.rules import ok
from launcher.config.schema import enum_value
from recipes.gpt.plan.estimate import Estimate, cluster_json, estimate, gib, model_json
from recipes.gpt.plan.search import enumerate_layouts, evaluate_all
from recipes.gpt.plan.spec import HEADROOM, ClusterSpec, LayoutSpec
from recipes.gpt.schema import ModelSpec

if TYPE_CHECKING:
    from recipes.gpt.schema import GPTRunConfig

BUBBLE_WARN = 0.25
MAX_FIX_CHANGES = 3

# Layout knobs a memory fix may change, in the order their keys are preferred when naming the error.
KNOB_KEYS = (
    ("recompute", "train.recompute"),
    ("micro_batch_size", "train.micro_batch_size"),
    ("zero", "zero.stage"),
    ("sequence_parallel", "parallelism.sequence_parallel"),
    ("tp", "parallelism.tp"),
    ("pp", "parallelism.pp"),
    ("offload_optimizer", "zero.offload_optimizer"),
    ("offload_params", "zero.offload_params"),
)


@dataclass
class Fix:
    overrides: Dict[str, Any]  # key -> new value (what to put on the command line)
    estimate: Estimate

    @property
    def key(self) -> str:
        return next(iter(self.overrides))

    def text(self) -> str:
        return " ".join(f"{k}={_fmt(v)}" for k, v in self.overrides.items())


def check(cfg: GPTRunConfig) -> Tuple[List[ConfigError], List[str]]:
    """(errors, warnings) of a config that passed launcher.config.rules.problems."""
    res = evaluate(cfg)
    return res.errors, res.warnings


def evaluate(cfg: GPTRunConfig, layout: Optional[Layout] = None) -> CheckResult:
    """The checks plus the estimate they were made from (JSON, as `launcher plan --json` prints it), of
    ``layout`` (the Layout the rules built: `launch`) or the one the config names."""
    m = ModelSpec.from_cfg(cfg.model)
    cluster = ClusterSpec.from_cfg(cfg.cluster)
    lay = (LayoutSpec.of(layout, enum_value(cfg.train.recompute), enum_value(cfg.precision.dtype)) if layout is not None
           else LayoutSpec.from_cfg(cfg))
    est = estimate(m, cluster, lay)
    res = CheckResult()
    layout = est.as_json()
    res.plan = {"model": model_json(m, int(cfg.train.global_batch_size)), "cluster": cluster_json(cluster),
                "layouts": [layout]}
    if cluster.memory_bytes and est.memory.total > cluster.usable_bytes:
        res.errors.append(memory_error(cfg, m, cluster, est))
    if est.memory.cpu and cluster.node_memory_bytes:
        per_node = est.memory.cpu * cluster.gpus_per_node
        if per_node > cluster.node_memory_bytes * (1.0 - HEADROOM):
            res.errors.append(ConfigError(
                "cluster.mem_gb",
                f"the offloaded states need {gib(per_node)} GiB of host memory per node "
                f"({cluster.gpus_per_node} processes x {gib(est.memory.cpu)} GiB), more than cluster.mem_gb="
                f"{cluster.node_memory_bytes / (1 << 30):g} less {HEADROOM:.0%} headroom",
                "raise cluster.mem_gb, use more nodes (cluster.nodes), or offload less (zero.offload_params=false)",
            ))
    res.warnings = layout_warnings(cluster, est)
    layout["warnings"] = list(res.warnings)
    return res


def layout_warnings(cluster: ClusterSpec, est: Estimate) -> List[str]:
    """Layouts that run, but badly: a large pipeline bubble, ZeRO-3 over a slow inter-node link."""
    lay, t = est.layout, est.timing
    out = []
    if lay.pp > 1 and t.bubble > BUBBLE_WARN:
        out.append(
            f"parallelism.pp: pipeline bubble {t.bubble:.0%} = (pp-1)/(m+pp-1) with pp={lay.pp} and m={lay.grad_accum} "
            f"micro-batches per step, above {BUBBLE_WARN:.0%}: raise train.global_batch_size or lower "
            f"train.micro_batch_size (m = global_batch_size / (dp * micro_batch_size)), or lower parallelism.pp"
        )
    inter_known = "cluster.inter_node_bandwidth" not in cluster.assumed
    if lay.zero == 3 and t.dp_link == "inter" and inter_known and t.zero3_comm_s > t.compute_s:
        per_mb = est.comm.dp_micro
        out.append(
            f"zero.stage: ZeRO-3 over the inter-node link "
            f"(cluster.inter_node_bandwidth={cluster.inter_bw / 1e9:g} GB/s): "
            f"its all-gathers and reduce-scatter move {per_mb / 1e9:.2f} GB per GPU and micro-batch, "
            f"{t.zero3_comm_s * 1e3:.0f} ms, longer than the {t.compute_s * 1e3:.0f} ms of compute they overlap with; "
            f"use zero=1 or zero=2, fewer nodes, or tensor/pipeline parallelism"
        )
    return out


def memory_error(cfg: GPTRunConfig, m: ModelSpec, cluster: ClusterSpec, est: Estimate) -> ConfigError:
    mem = est.memory
    if cluster.memory_source == "cluster.gpu.memory_gb":
        cap = f"cluster.gpu.memory_gb={cluster.memory_bytes / (1 << 30):g}"
    else:
        cap = cluster.memory_source
    problem = (
        f"the run needs {gib(mem.total)} GiB per GPU (params {gib(mem.params)}, grads {gib(mem.grads)}, "
        f"optimizer {gib(mem.optimizer)}, activations {gib(mem.activations)}, buffers {gib(mem.buffers)}; "
        f"{mem.stage} pipeline stage), more than the {gib(cluster.usable_bytes)} GiB usable of {cap} "
        f"({HEADROOM:.0%} headroom for the CUDA context, NCCL and fragmentation)"
    )
    fix = suggest_fix(cfg, m, cluster, est.layout)
    if fix is None:
        return ConfigError(
            "cluster.gpu.memory_gb", problem,
            "no layout of the same world size and global batch fits: add GPUs (cluster.nodes), lower "
            "train.global_batch_size or model.seq_len, or use GPUs with more memory",
        )
    f_mem = fix.estimate.memory.total
    return ConfigError(
        fix.key, problem,
        f"{fix.text()} (then {gib(f_mem)} GiB per GPU, predicted {fix.estimate.step_time_s:.3g} s/step); "
        f"`launcher plan --search` lists every layout that fits",
    )


def suggest_fix(cfg: GPTRunConfig, m: ModelSpec, cluster: ClusterSpec, cur: LayoutSpec) -> Optional[Fix]:
    """The smallest layout change that fits: fewest knobs changed, then the fastest prediction.

    Candidates are the search's valid layouts of the same world size, global batch and precision, each
    also with its states offloaded where the rules allow it; an explicit ``parallelism.engine`` is kept
    where the rules let it run the candidate (else the implied engine is named in the fix). The fix is
    the config with the candidate's knobs, checked against every rule of launcher.config.rules."""
    base = Facts.from_cfg(cfg)
    explicit_engine = base.engine != "auto"
    by_distance: Dict[int, List[Tuple[LayoutSpec, List[str]]]] = {}
    for lay in _candidates(m, cluster, cur.global_batch_size, cur.dtype):
        if explicit_engine and lay.engine != cur.engine and ok(_facts(base, lay.with_(engine=cur.engine))):
            lay = lay.with_(engine=cur.engine)
        changed = [k for k, _ in KNOB_KEYS if getattr(lay, k) != getattr(cur, k)]
        if changed and len(changed) <= MAX_FIX_CHANGES:
            by_distance.setdefault(len(changed), []).append((lay, changed))
    keys = dict(KNOB_KEYS)
    for dist in sorted(by_distance):
        group = by_distance[dist]
        ests = evaluate_all(m, cluster, [lay for lay, _ in group])
        order = sorted((e.step_time_s, i) for i, e in enumerate(ests) if e.feasible)
        for _, i in order:
            lay, changed = group[i]
            if not ok(_facts(base, lay)):
                continue
            overrides: Dict[str, Any] = {keys[k]: getattr(lay, k) for k in changed}
            if explicit_engine and lay.engine != cur.engine:
                overrides["parallelism.engine"] = lay.engine
            if base.dp is not None and lay.dp != cur.dp:
                overrides["parallelism.dp"] = lay.dp
            return Fix(overrides, ests[i])
    return None


def _facts(base: Facts, lay: LayoutSpec) -> Facts:
    """The config's Facts with a candidate layout's knobs (what its overrides would make of the config):
    an explicit engine becomes the candidate's, an explicit parallelism.dp its dp."""
    return base.with_(
        tp=lay.tp, pp=lay.pp, zero=lay.zero, micro_batch_size=lay.micro_batch_size,
        sequence_parallel=lay.sequence_parallel, offload_optimizer=lay.offload_optimizer,
        offload_params=lay.offload_params, engine=base.engine if base.engine == "auto" else lay.engine,
        dp=None if base.dp is None else lay.dp,
    )


def _candidates(m: ModelSpec, cluster: ClusterSpec, global_batch_size: int, dtype: str) -> Iterator[LayoutSpec]:
    """Every valid layout, followed by its variants with the optimizer states offloaded, and with the
    parameters too, where the rules allow (the search keeps a requested offload where they do)."""
    plain = enumerate_layouts(m, cluster, global_batch_size, dtype)
    opt = enumerate_layouts(m, cluster, global_batch_size, dtype, offload_optimizer=True)
    both = enumerate_layouts(m, cluster, global_batch_size, dtype, offload_optimizer=True, offload_params=True)
    for lay, lay_opt, lay_both in zip(plain, opt, both, strict=True):  # same layouts, same order
        yield lay
        if lay_opt != lay:
            yield lay_opt
        if lay_both != lay_opt:
            yield lay_both


def _fmt(v: Any) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)


def fits(cfg: GPTRunConfig, num_layers: int, layout: Any, recompute: str, dtype: str) -> bool:
    """Whether ``layout`` (a launcher.config.layout.Layout) of the config's model cut to ``num_layers`` fits the
    cluster's GPU memory (True where it is unknown): preflight's rungs (the contract's ``fits``)."""
    cluster = ClusterSpec.from_cfg(cfg.cluster)
    if not cluster.memory_bytes:
        return True
    m = dataclasses.replace(ModelSpec.from_cfg(cfg.model), num_layers=num_layers)
    return estimate(m, cluster, LayoutSpec.of(layout, recompute, dtype)).feasible
