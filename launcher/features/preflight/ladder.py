"""The preflight ladder (docs/preflight.md): the checks engineers climb by hand before a large run,
as pure functions. ``ladder`` turns a composed run config into rungs (each a set of overrides on top
of the user's); ``judge`` turns what a rung's run left (status, metrics, plan, benchmark rows) into a
verdict. Submitting, waiting and printing are launcher.features.preflight.climb's; nothing here imports torch.

    smoke  one process, the model (as many of its layers as fit one GPU), micro batch 1, a few steps, fp32
    node   one node with the tensor-parallel group (tp ranks, data parallel over the rest of the node)
    comm   the communication benchmark between two nodes (the recipe option whose contract has a
           ``link_check``: the shipped communication benchmark, docs/preflight.md)
    full   the full layout for a few dozen steps, fp32 and no recomputation where that fits
    tuned  the same with recomputation and mixed precision on (the config's own, else selective + bf16)
    resume the full rung again, stopped halfway by the product's stop path and resumed (launcher
           verify-resume's stop): compared step by step with the full rung's run, bitwise or no-go

A rung that cannot tell anything new for this config is skipped (one node: no comm rung).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple

from launcher.config import faults, recipe_contract, schema
from launcher.config.layout import Layout
from launcher.config.schema import enum_value
from launcher.run.status import FINAL, RunStatus, Status

if TYPE_CHECKING:
    from launcher.config.schema import RunConfig

RUNGS = ("smoke", "node", "comm", "full", "tuned", "resume")
SHORT_STEPS = 3  # smoke and node rungs: the model builds, steps, and the loss is finite
DEFAULT_STEPS = 30  # full and tuned rungs: "a few dozen"

# verdict thresholds
OVERFLOW_SHARE = 0.5  # more than this share of steps with a non-finite gradient norm: no-go
MEMORY_OVER_PLAN = 1.15  # measured peak memory above the plan by more than this: a warning
THROUGHPUT_UNDER_PLAN = 0.5  # measured tokens/s below this share of a calibrated plan: a warning
LINK_UNDER_CONFIG = 0.5  # inter-node bus bandwidth below this share of the cluster config's: no-go

GO, WARN, NO_GO, SKIPPED, NOT_RUN, RUNNING = "go", "go (warn)", "no-go", "skipped", "not run", "running"


@dataclass(frozen=True)
class Rung:
    name: str
    title: str
    overrides: Tuple[str, ...] = ()  # after the user's
    notes: Tuple[str, ...] = ()  # what differs from the config, and why
    skip: Optional[str] = None  # why this rung tells nothing new for this config


@dataclass
class Verdict:
    verdict: str  # GO, WARN, NO_GO, SKIPPED, NOT_RUN, RUNNING
    reasons: List[str] = field(default_factory=list)
    fix: str = ""
    measured: Dict[str, Optional[float]] = field(default_factory=dict)  # tokens_per_s, memory_bytes, busbw_gbs
    planned: Dict[str, Optional[float]] = field(default_factory=dict)
    calibrated: bool = False  # the plan's throughput came from calibrated constants (then it is judged)

    @property
    def passed(self) -> bool:
        return self.verdict in (GO, WARN, SKIPPED)


# ---- the ladder ----------------------------------------------------------------------------------


def _fits(cfg: RunConfig, layers: int, tp: int, pp: int, dp: int, zero: int, dtype: str, recompute: str,
          procs_per_node: int, accum: int = 1, mbs: Optional[int] = None) -> bool:
    """Whether the recipe's planner says this shape fits the cluster's GPU memory (its contract's ``fits``;
    True where it is unknown, or the recipe has no planner)."""
    fits = recipe_contract.of(str(cfg.recipe._target_), strict=False).fits
    if fits is None:
        return True
    z = cfg.zero
    lay = Layout(dp=dp, tp=tp, pp=pp, zero=zero, micro_batch_size=mbs or int(cfg.train.micro_batch_size),
                 grad_accum=accum,
                 sequence_parallel=bool(cfg.parallelism.sequence_parallel) and tp > 1,
                 offload_optimizer=bool(z.offload_optimizer) and zero > 0,
                 offload_params=bool(z.offload_params) and zero >= 3, procs_per_node=procs_per_node)
    return fits(cfg, layers, lay, recompute, dtype)


def _layers_that_fit(cfg: RunConfig, most: int, **shape: Any) -> int:
    """The most layers (<= ``most``, >= 1) of the model the shape holds (``most`` < 1: a model without layers)."""
    if most < 1:
        return most
    for layers in range(most, 0, -1):
        if _fits(cfg, layers, **shape):
            return layers
    return 1


def _plain_or_own(cfg: RunConfig, fits_plain: bool) -> Tuple[Tuple[str, ...], Tuple[str, ...]]:
    """fp32 without recomputation where the planner says it fits, else the config's own precision and
    recomputation: (overrides, notes)."""
    dtype, recompute = enum_value(cfg.precision.dtype), enum_value(cfg.train.recompute)
    if fits_plain:
        return ("precision.dtype=fp32", "train.recompute=none"), ()
    return (), (f"kept precision.dtype={dtype} train.recompute={recompute}: in fp32 without recomputation "
                "it does not fit (launcher plan)",)


def _fault_kept(cfg: RunConfig, steps: int, world: int) -> Tuple[str, ...]:
    """An injected fault after a rung's last step, or on a rank the rung does not have, never fires
    there: drop it (launcher.config.faults.kept)."""
    return faults.kept(cfg.train, steps, world)


def ladder(cfg: RunConfig, steps: int = DEFAULT_STEPS, short_steps: int = SHORT_STEPS) -> List[Rung]:
    """The rungs for a composed run config (``cfg`` as ``launch`` would run it)."""
    par, cl, tr = cfg.parallelism, cfg.cluster, cfg.train
    tp, pp, nodes, gpn = int(par.tp), int(par.pp), int(cl.nodes), int(cl.gpus_per_node)
    # a recipe with layers (model.num_layers) is cut to the layers that fit a rung (its contract's fits)
    layers = int(getattr(getattr(cfg, "model", None), "num_layers", 0) or 0)
    mbs, zero = int(tr.micro_batch_size), int(cfg.zero.stage)
    dtype, recompute = enum_value(cfg.precision.dtype), enum_value(tr.recompute)
    world = nodes * gpn
    dp = world // max(1, tp * pp)
    short = (f"train.steps={short_steps}", "optim.warmup_steps=null", "train.max_restarts=0")
    rungs: List[Rung] = []

    # smoke: one process, one sample per step
    one = dict(tp=1, pp=1, dp=1, zero=0, procs_per_node=1, mbs=1)
    fit = _layers_that_fit(cfg, layers, dtype="fp32", recompute="none", **one)
    notes = [] if fit == layers else [f"model.num_layers={fit} of {layers}: the whole model does not fit one GPU"]
    ov = ["cluster.nodes=1", "cluster.gpus_per_node=1", "parallelism.tp=1", "parallelism.pp=1", "parallelism.dp=null",
          "parallelism.sequence_parallel=false", "parallelism.engine=auto", "zero.stage=0",
          "zero.offload_optimizer=false", "zero.offload_params=false", "train.micro_batch_size=1",
          "train.global_batch_size=1", "precision.dtype=fp32", "train.recompute=none", *short,
          *_fault_kept(cfg, short_steps, 1)]
    if fit != layers:
        ov.append(f"model.num_layers={fit}")
    rungs.append(Rung("smoke", "one process: the model builds and steps", tuple(ov), tuple(notes)))

    # node: one node, the tensor-parallel group, data parallel over the rest of the node
    node_dp = max(1, gpn // tp)
    stage_layers = math.ceil(layers / pp)
    shape = dict(tp=tp, pp=1, dp=node_dp, zero=zero, procs_per_node=gpn)
    plain = _fits(cfg, stage_layers, dtype="fp32", recompute="none", **shape)
    prec, notes = _plain_or_own(cfg, plain)
    fit = _layers_that_fit(cfg, stage_layers, dtype="fp32" if plain else dtype,
                           recompute="none" if plain else recompute, **shape)
    notes = list(notes)
    ov = ["cluster.nodes=1", "parallelism.pp=1", "parallelism.dp=null", f"train.global_batch_size={mbs * node_dp}",
          *prec, *short, *_fault_kept(cfg, short_steps, gpn)]
    if fit != layers:
        ov.append(f"model.num_layers={fit}")
        notes.append(f"model.num_layers={fit} of {layers}" + (" (one pipeline stage's share)" if fit == stage_layers
                                                             else ": more does not fit one node's GPUs"))
    skip = "one process per node and no tensor parallelism: the smoke rung covered it" if gpn == 1 and tp == 1 else None
    rungs.append(Rung("node", f"one node: tp={tp} x dp={node_dp}", tuple(ov), tuple(notes), skip))

    # comm: the communication benchmark between two nodes
    option, check = link_benchmark()
    ov = [f"recipe={option}", "cluster.nodes=2", "parallelism.tp=1", "parallelism.pp=1", "parallelism.dp=null",
          "parallelism.sequence_parallel=false", "parallelism.engine=auto", "zero.stage=0",
          "zero.offload_optimizer=false", "zero.offload_params=false", f"train.global_batch_size={mbs * 2 * gpn}",
          "train.max_restarts=0", *faults.none(), *(check.overrides(bool(cl.use_gpus)) if check else ())]
    skip = (f"cluster.nodes={nodes}: no link between nodes to measure" if nodes < 2
            else None if check else "no recipe option measures the link between nodes (a contract's link_check)")
    rungs.append(Rung("comm", f"{option or 'link benchmark'}: 2 nodes x {gpn}", tuple(ov), (), skip))

    # full: the whole layout, plain
    accum = max(1, int(tr.global_batch_size) // max(1, dp * mbs))
    full = dict(tp=tp, pp=pp, dp=dp, zero=zero, procs_per_node=gpn, accum=accum)
    prec, notes = _plain_or_own(cfg, _fits(cfg, layers, dtype="fp32", recompute="none", **full))
    long = (f"train.steps={steps}", "optim.warmup_steps=null", "train.max_restarts=0", *_fault_kept(cfg, steps, world))
    rungs.append(Rung("full", f"full layout: {_shape(nodes, gpn, tp, pp, dp, zero)}", (*prec, *long), notes))

    # tuned: recomputation and mixed precision on
    t_dtype = dtype if dtype in ("bf16", "fp16") else "bf16"
    t_rec = recompute if recompute != "none" else "selective"
    notes = []
    if (t_dtype, t_rec) != (dtype, recompute):
        notes.append(f"precision.dtype={t_dtype} train.recompute={t_rec} (the config: {dtype}, {recompute})")
    rungs.append(Rung("tuned", f"+ recompute={t_rec}, {t_dtype}",
                      (f"precision.dtype={t_dtype}", f"train.recompute={t_rec}", *long), tuple(notes)))

    # resume: the full rung stopped after half its steps, requeued and resumed; judged against the full
    # rung's run (launcher.features.verify_resume), so a program that resumes wrongly is found before a
    # large run spends its restarts on it
    stop = steps // 2
    again = (*prec, f"train.steps={steps}", "optim.warmup_steps=null", "train.max_restarts=1",
             "train.fail_at_step=null", faults.requeue_faults(stop))
    rungs.append(Rung("resume", f"full layout stopped after step {stop} and resumed", again,
                      ("compared step by step with the full rung's run",),
                      None if stop >= 1 else f"--steps {steps}: no step to stop after and resume"))
    return rungs


def _shape(nodes: int, gpn: int, tp: int, pp: int, dp: int, zero: int) -> str:
    return f"{nodes} node(s) x {gpn}, tp={tp} pp={pp} dp={dp} zero={zero}"


# ---- verdicts ------------------------------------------------------------------------------------


def _unless_completed(status: RunStatus) -> Optional[str]:
    """A rung's run that did not complete: NO_GO once it ended, RUNNING before; None if it completed
    (a mapping of status.json reads as one)."""
    st = RunStatus.of(status).state
    if st is Status.completed:
        return None
    return NO_GO if st.value in FINAL else RUNNING


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def _median(xs: Sequence[float]) -> Optional[float]:
    xs = sorted(xs)
    if not xs:
        return None
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2


def planned(plan: Optional[Dict[str, Any]]) -> Dict[str, Optional[float]]:
    """What the planner expected of a run (its plan.json): tokens/s and memory per GPU."""
    if not plan or not plan.get("layouts"):
        return {"tokens_per_s": None, "memory_bytes": None, "usable_bytes": None}
    lay, model = plan["layouts"][0], plan.get("model") or {}
    step = lay.get("step_time_s")
    tokens = model.get("tokens_per_step")
    return {"tokens_per_s": tokens / step if step and tokens else None,
            "memory_bytes": (lay.get("memory_bytes") or {}).get("total"),
            "usable_bytes": (plan.get("cluster") or {}).get("usable_bytes") or None}


def judge_training(status: RunStatus, rows: List[Dict[str, Any]], plan: Optional[Dict[str, Any]],
                   calibrated: bool) -> Verdict:
    """A training rung: it completed, its loss stayed finite, its steps did not overflow; measured
    throughput and memory beside the plan (warnings only: the planner may be uncalibrated)."""
    exp = planned(plan)
    timed = [r["tokens_per_s"] for r in rows[2:] or rows if _finite(r.get("tokens_per_s"))]
    mem = [r["peak_memory_bytes"] for r in rows if _finite(r.get("peak_memory_bytes"))]
    v = Verdict(GO, measured={"tokens_per_s": _median(timed), "memory_bytes": max(mem) if mem else None},
                planned={"tokens_per_s": exp["tokens_per_s"], "memory_bytes": exp["memory_bytes"]},
                calibrated=calibrated)
    if not_done := _unless_completed(status):
        v.verdict = not_done
        return v
    bad_loss = [r["step"] for r in rows if not _finite(r.get("loss"))]
    if bad_loss or not rows:
        v.verdict = NO_GO
        v.reasons.append(f"the loss is not finite from step {bad_loss[0]}" if bad_loss else "no step was recorded")
        v.fix = ("lower optim.lr, keep optim.grad_clip > 0, and try precision=bf16 (fp16's range is small); "
                 "`launcher report RUN` draws the loss and grad norm")
        return v
    overflow = [r["step"] for r in rows if not _finite(r.get("grad_norm"))]
    if len(overflow) > OVERFLOW_SHARE * len(rows):
        v.verdict = NO_GO
        v.reasons.append(f"{len(overflow)} of {len(rows)} steps had a non-finite gradient norm (fp16 overflow: "
                         "those steps were skipped, the model did not train)")
        v.fix = ("use dynamic loss scaling (precision.loss_scale=0) with a lower precision.initial_scale_power, or "
                 "precision=bf16")
        return v
    m, p = v.measured, v.planned
    if m["memory_bytes"] and exp["usable_bytes"] and m["memory_bytes"] > exp["usable_bytes"]:
        v.verdict = NO_GO
        v.reasons.append(f"peak memory {m['memory_bytes'] / 2**30:.1f} GiB is above the usable "
                         f"{exp['usable_bytes'] / 2**30:.1f} GiB per GPU: the full run will run out of memory")
        v.fix = "`launcher plan --search <overrides>` ranks the layouts that fit"
        return v
    if m["memory_bytes"] and p["memory_bytes"] and m["memory_bytes"] > MEMORY_OVER_PLAN * p["memory_bytes"]:
        v.verdict = WARN
        v.reasons.append(f"peak memory {m['memory_bytes'] / p['memory_bytes']:.2f}x the plan's")
    if (calibrated and m["tokens_per_s"] and p["tokens_per_s"]
            and m["tokens_per_s"] < THROUGHPUT_UNDER_PLAN * p["tokens_per_s"]):
        v.verdict = WARN
        v.reasons.append(f"throughput {m['tokens_per_s'] / p['tokens_per_s']:.0%} of the calibrated plan's")
    return v


def judge_resume(status: RunStatus, reference: RunStatus, verdict: Optional[Any]) -> Verdict:
    """The resume rung: its run and the full rung's completed, and the comparison of the two
    (launcher.features.verify_resume's Verdict) is bitwise (go) or within its tolerance (a warning)."""
    v = Verdict(GO)
    if not_done := _unless_completed(status):
        v.verdict = not_done
        return v
    if RunStatus.of(reference).state is not Status.completed or verdict is None:
        v.verdict = NOT_RUN
        v.reasons.append("the full rung's run did not complete: nothing to compare with")
        return v
    v.reasons.append(verdict.line())
    if verdict.kind == "tolerance":
        v.verdict = WARN
    elif verdict.kind == "diverges":
        v.verdict = NO_GO
        v.fix = f"{verdict.cause} (docs/training-api.md, \"Verifying a resume\"; launcher verify-resume RUN)"
    return v


def link_benchmark() -> Tuple[str, Optional[recipe_contract.LinkCheck]]:
    """The recipe option (conf/recipe/) whose contract measures the link between nodes, and its check;
    ("", None) when none does."""
    for option, target in schema.recipe_options().items():
        check = recipe_contract.of(target, strict=False).link_check
        if check is not None:
            return option, check
    return "", None


def judge_comm(status: RunStatus, bench: Optional[Dict[str, Any]], inter_gbps: float) -> Verdict:
    """The comm rung: it completed, and all-reduce between the nodes reached at least
    LINK_UNDER_CONFIG of the cluster config's inter-node bandwidth (where the config states one)."""
    _, check = link_benchmark()
    peak = check.inter_busbw(bench) if check is not None else None
    v = Verdict(GO, measured={"busbw_gbs": peak}, planned={"busbw_gbs": inter_gbps or None})
    if not_done := _unless_completed(status):
        v.verdict = not_done
        return v
    if peak is None:
        v.verdict = NO_GO
        v.reasons.append("no all-reduce between nodes was measured (the benchmark's results have no inter-node row)")
        v.fix = "check that the job really spans two nodes (cluster.nodes=2) and read `launcher logs RUN`"
        return v
    if inter_gbps and peak < LINK_UNDER_CONFIG * inter_gbps:
        v.verdict = NO_GO
        v.reasons.append(f"all-reduce bus bandwidth between nodes {peak:.3g} GB/s is {peak / inter_gbps:.2g}x "
                         f"cluster.inter_node_bandwidth={inter_gbps:g} GB/s")
        v.fix = ("the interconnect is not what the cluster config says, or is not used: check NCCL_IB_HCA / "
                 "NCCL_SOCKET_IFNAME (cluster.env), NCCL_DEBUG=INFO shows the transport; if the link really is "
                 f"this fast, set cluster.inter_node_bandwidth={peak:.3g} so the planner's estimates hold")
    return v
