"""The ONE table of rules a config must obey (``RULES``), and the queries over it.

Every rule is a row (key, predicate, problem, fix) over ``launcher.config.layout.Facts``. A row's predicate
says when the rule is broken; its key names the config key at fault, its fix says what to change. The
bound rows (a numeric key below its minimum, above its maximum, nan or inf) are generated from the
bounds ``launcher.config.schema`` declares with each key; rows with ``each`` report one error per offending
key (unknown keys, control characters in strings). The row type, its kinds and the bound rows are
launcher.config.rule_rows'; the predicates that ask beyond the config, launcher.config.rule_checks'.

``RULES`` holds the rows every recipe shares; a recipe's contract (launcher.config.recipe_contract) adds
its own, and ``table`` joins them. ``problems`` lists what a config breaks, ``ok`` filters the
planner's candidates, ``resolve`` turns a valid config into its ``Layout``. Pure (no torch): runs on
the login node for every sweep point before anything is submitted.
"""
from __future__ import annotations

import os
from functools import lru_cache
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from launcher import script_recipe
from launcher.config import faults, recipe_contract, schema
from launcher.config.errors import ConfigError, ConfigErrors
from launcher.config.layout import Facts, Layout
from launcher.config.recipe_target import is_script, target_problem
from launcher.config.rule_checks import (
    FP16_CPU_FLAGS,
    backend_names,
    capability_problems,
    elastic_problems,
    env_names,
    host_gpus,
    lacks_cpu_fp16,
    largest_divisor,
    max_nodes,
    max_restarts,
    sbatch_names,
    settings_problem,
    sweep_problems,
)
from launcher.config.rule_rows import (
    ALL_KINDS,
    LAYOUT,
    RUN,
    SHAPE,
    VALUE,
    Rule,
    Text,
    bound_rows,
    each_row,
    own_rows,
    shared_bound_rows,
)
from launcher.data import checks as data_checks

# what the launcher's other modules and the recipes' contracts import from here (the row type, its kinds and
# the bound rows are launcher.config.rule_rows')
__all__ = ["ALL_KINDS", "FP16_CPU_FLAGS", "LAYOUT", "RULES", "RUN", "SHAPE", "VALUE", "Rule", "Text", "advice",
           "bound_rows", "buildable", "layout_of", "ok", "problems", "resolve", "table", "violations"]


# The rows every recipe is held to; a recipe adds its own (its contract's ``rules``: ``table``).
RULES: Tuple[Rule, ...] = (
    # sizes: the bounds launcher.config.schema declares for the keys the layout is built from
    *shared_bound_rows(VALUE),
    Rule("cluster.backend", lambda f: f.backend not in backend_names(),
         lambda f: f"{f.backend!r} is not a backend", lambda f: f"choose one of {', '.join(backend_names())}",
         VALUE),
    Rule("parallelism.tp", lambda f: f.derived_dp is None,
         lambda f: (f"parallelism.tp*parallelism.pp = {f.tp}*{f.pp} = {f.tp * f.pp} does not divide the world "
                    f"size cluster.nodes*cluster.gpus_per_node = {f.nodes}*{f.gpus_per_node} = {f.world}"),
         lambda f: (f"choose tp and pp whose product divides {f.world} (e.g. parallelism.tp="
                    f"{largest_divisor(f.world, f.tp)}), or change cluster.nodes / cluster.gpus_per_node"),
         SHAPE),
    Rule("parallelism.dp", lambda f: f.derived_dp is not None and f.dp is not None and f.dp != f.derived_dp,
         lambda f: f"is {f.dp} but world size {f.world} / (tp {f.tp} * pp {f.pp}) gives {f.derived_dp}",
         lambda f: f"set parallelism.dp={f.derived_dp} or parallelism.dp=null to derive it", SHAPE),
    Rule("parallelism.tp", lambda f: f.tp > f.gpus_per_node and f.world > 1,
         lambda f: (f"tp={f.tp} spans more than one node ({f.gpus_per_node} per node): tensor-parallel "
                    "collectives run every layer and need the intra-node link"),
         lambda f: f"use parallelism.tp<={f.gpus_per_node} and put the rest into parallelism.pp"),
    Rule("zero.offload_optimizer",
         lambda f: (f.offload_optimizer or f.offload_params) and f.zero == 0 and f.resolved_engine != "fsdp",
         "offload needs ZeRO stage 1 or more", "set zero=1/2/3 or turn offload off"),
    Rule("zero.offload_params", lambda f: f.offload_params and f.zero != 3,
         "parameter offload needs ZeRO stage 3", "set zero=3 or zero.offload_params=false"),
    Rule("parallelism.sequence_parallel", lambda f: f.sequence_parallel and f.tp == 1,
         "sequence parallelism needs tp > 1", "set parallelism.tp>=2 or parallelism.sequence_parallel=false"),
    # which parallelism / precision / ZeRO combinations each engine runs
    Rule("parallelism.engine", lambda f: f.resolved_engine == "ddp" and (f.tp > 1 or f.pp > 1),
         lambda f: f"engine ddp is data parallel only, but tp={f.tp} pp={f.pp}",
         "use parallelism.engine=megatron (or auto) for tensor/pipeline parallelism"),
    Rule("zero.stage", lambda f: f.resolved_engine == "ddp" and f.zero > 0,
         lambda f: f"ZeRO stage {f.zero} needs the deepspeed engine",
         "use parallelism.engine=deepspeed (or auto), or zero=0"),
    Rule("precision.dtype", lambda f: f.resolved_engine == "deepspeed" and f.zero == 0 and f.dtype == "fp16",
         ("fp16 on the deepspeed engine at ZeRO stage 0 trains ~65536x too slowly: DeepSpeed 0.19 divides the "
          "gradients by the loss scale without ever scaling the loss"),
         "use zero=1/2/3, precision=bf16, or parallelism.engine=ddp"),
    Rule("parallelism.engine", lambda f: f.resolved_engine == "deepspeed" and (f.tp > 1 or f.pp > 1),
         lambda f: f"the deepspeed engine runs data parallel + ZeRO only, but tp={f.tp} pp={f.pp}",
         "use parallelism.engine=megatron (or auto) for tensor/pipeline parallelism"),
    Rule("zero.stage", lambda f: f.resolved_engine == "megatron" and f.zero > 1,
         lambda f: (f"ZeRO stage {f.zero} cannot be combined with tensor/pipeline parallelism here "
                    "(gradients and parameters are already split by tp/pp; stages 2-3 would re-shard "
                    "them every micro-batch of the pipeline)"),
         "use zero=1 (optimizer states sharded across data-parallel ranks) or zero=0"),
    Rule("zero.offload_optimizer",
         lambda f: f.resolved_engine == "megatron" and (f.offload_optimizer or f.offload_params),
         "offload needs the deepspeed engine",
         "turn offload off, or use tp=pp=1 with parallelism.engine=deepspeed"),
    # fsdp (torch FSDP2, launcher.training.engines): data parallel, sharding of its own
    Rule("zero.stage", lambda f: f.resolved_engine == "fsdp" and f.zero > 0,
         lambda f: (f"the fsdp engine shards parameters, gradients and optimizer state itself; zero.stage={f.zero} is "
                    "DeepSpeed's"),
         lambda f: f"use zero=0 with parallelism=fsdp, or DeepSpeed: parallelism=zero zero={f.zero}"),
    Rule("parallelism.pp", lambda f: f.resolved_engine == "fsdp" and f.pp > 1,
         lambda f: f"the fsdp engine runs no pipeline, but pp={f.pp}",
         "set parallelism.pp=1, or use the megatron engine (parallelism=pp) for pipeline parallelism"),
    Rule("zero.offload_optimizer",
         lambda f: f.resolved_engine == "fsdp" and (f.offload_optimizer or f.offload_params),
         "zero.offload_* is DeepSpeed's offload; the fsdp engine offloads by its own key",
         "set zero.offload_optimizer=false zero.offload_params=false and parallelism.cpu_offload=true"),
    Rule("parallelism.engine", lambda f: f.resolved_engine not in ("ddp", "fsdp", "deepspeed", "megatron"),
         lambda f: f"{f.engine!r} is not an engine", "choose auto, ddp, fsdp, deepspeed or megatron"),
    # the rest of the run: every other numeric key within the bounds launcher.config.schema declares
    *shared_bound_rows(RUN),
    Rule("parallelism.cpu_offload",
         lambda f: bool(f.values.get("parallelism.cpu_offload")) and f.resolved_engine != "fsdp",
         lambda f: f"is the fsdp engine's, but the engine is {f.resolved_engine}: nothing would be offloaded",
         "use parallelism=fsdp, or DeepSpeed's zero.offload_optimizer / zero.offload_params with zero=1/2/3", RUN),
    Rule("train.fail_at_step", lambda f: f.fail_at_step is not None and f.fail_at_step > f.steps,
         lambda f: f"step {f.fail_at_step} comes after the last step (train.steps={f.steps}): the fault never fires",
         lambda f: f"choose train.fail_at_step in 1..{f.steps}, or null", RUN),
    Rule("train.fail_rank", lambda f: f.fail_at_step is not None and not 0 <= f.fail_rank < f.world,
         lambda f: f"{f.fail_rank} is not a rank of a {f.world}-process job", lambda f: f"choose 0..{f.world - 1}",
         RUN),
    each_row("train.faults", lambda f: faults.listed_problems(f.values.tree.get("train") or {}, f.steps, f.world),
             lambda f: f"give each train.faults entry an at_step in 1..{f.steps}, a rank in 0..{f.world - 1} "
                       "and an attempt >= 1 (or null), or remove it"),
    Rule("train.dist_timeout_s",
         lambda f: 0 < (f.values.get("train.hang_timeout_s") or 0) >= (f.values.get("train.dist_timeout_s") or 0),
         lambda f: (f"collectives give up after {f.values.get('train.dist_timeout_s')} s, before the hang watchdog "
                    f"(train.hang_timeout_s={f.values.get('train.hang_timeout_s')}) can dump the stacks and name the "
                    "stuck rank"),
         lambda f: f"raise train.dist_timeout_s above {f.values.get('train.hang_timeout_s')} (e.g. twice it)", RUN),
    Rule("train.max_restarts",
         lambda f: (max_restarts(f.backend) is not None
                    and (f.values.get("train.max_restarts") or 0) > max_restarts(f.backend)),
         lambda f: (f"the {f.backend} backend restarts a job at most {max_restarts(f.backend)} times, but "
                    f"train.max_restarts={f.values.get('train.max_restarts')}"),
         lambda f: f"set train.max_restarts to {max_restarts(f.backend)} or less (or use a Slurm cluster)", RUN),
    Rule("cluster.nodes", lambda f: max_nodes(f.backend) is not None and f.nodes > max_nodes(f.backend),
         lambda f: (f"the {f.backend} backend runs {max_nodes(f.backend)} node(s) (its processes on this host), but "
                    f"cluster.nodes={f.nodes}: {f.gpus_per_node * max_nodes(f.backend)} process(es) would run a "
                    f"layout archived for a world of {f.world}"),
         lambda f: f"set cluster.nodes={max_nodes(f.backend)} or use a Slurm cluster (e.g. cluster=local_slurm)", RUN),
    Rule("cluster.signal_delay_s",
         lambda f: (int(f.values.get("cluster.signal_delay_s") or 0) * 2
                    > int(f.values.get("cluster.time_min") or 0) * 60),
         lambda f: (f"cluster.signal_delay_s={f.values.get('cluster.signal_delay_s')} s before the time limit of "
                    f"cluster.time_min={f.values.get('cluster.time_min')} min: the time-limit signal would come in "
                    "the first half of the job (at its start, or before it), checkpointing and requeueing it "
                    "before it could train"),
         lambda f: (f"set cluster.signal_delay_s={int(f.values.get('cluster.time_min') or 0) * 30} or less, or raise "
                    "cluster.time_min"), RUN),
    Rule("cluster.cpus_per_task",
         lambda f: bool(f.values.get("cluster.cpus_per_node")) and
         f.gpus_per_node * int(f.values.get("cluster.cpus_per_task") or 1) > int(f.values.get("cluster.cpus_per_node")),
         lambda f: (f"cluster.gpus_per_node={f.gpus_per_node} tasks x cluster.cpus_per_task="
                    f"{f.values.get('cluster.cpus_per_task')} = "
                    f"{f.gpus_per_node * int(f.values.get('cluster.cpus_per_task'))} "
                    f"CPUs, more than a node's cluster.cpus_per_node={f.values.get('cluster.cpus_per_node')}: "
                    "Slurm would never start the job"),
         lambda f: ("set cluster.cpus_per_task="
                    f"{max(1, int(f.values.get('cluster.cpus_per_node')) // f.gpus_per_node)} or fewer"), RUN),
    Rule("cluster.gpus_per_node",
         lambda f: host_gpus(f.backend) is not None and f.gpus_per_node > host_gpus(f.backend),
         lambda f: (f"cluster.gpus_per_node={f.gpus_per_node} processes, but this host has {host_gpus(f.backend)} "
                    "GPU(s) for them: two processes on one GPU (NCCL refuses a duplicate GPU)"),
         lambda f: (f"set cluster.gpus_per_node={host_gpus(f.backend)}, "
                    "or CUDA_VISIBLE_DEVICES to the GPUs to use"), RUN),
    Rule("precision.dtype",
         lambda f: f.dtype == "fp16" and f.resolved_engine == "deepspeed" and lacks_cpu_fp16(f.backend),
         lambda f: (f"fp16 on the deepspeed engine runs on this host's CPU (cluster.backend={f.backend}), which has "
                    "no fp16 kernels (its /proc/cpuinfo flags include neither "
                    f"{' nor '.join(sorted(FP16_CPU_FLAGS))}): "
                    "DeepSpeed's CPU accelerator refuses fp16 at start-up"),
         ("use precision=bf16 (or fp32), or run fp16 on the ddp engine (zero=0, parallelism.engine=ddp or auto), "
          "whose fp16 autocast with a loss scaler runs on this CPU"), RUN),
    Rule("recipe.params", lambda f: settings_problem(f) is not None,
         lambda f: f"{settings_problem(f)}: the job would fail when it starts",
         lambda f: ("set a valid value (the recipe's settings and their bounds: "
                    f"{recipe_contract.of(f.values.get('recipe._target_')).check_doc})"), RUN),
    Rule("recipe._target_",
         lambda f: (isinstance(f.values.get("recipe._target_"), str)
                    and target_problem(f.values.get("recipe._target_")) is not None),
         lambda f: f"{target_problem(f.values.get('recipe._target_'))}: the job would fail when it starts",
         "name a function fn(cfg, ctx) of an importable module, e.g. recipe._target_=mypkg.train.main", RUN),
    each_row("recipe.script", lambda f: script_recipe.problems(f.values.tree),
             lambda f: script_recipe.fix(f.values.tree)),
    # data=tokens: its datasets, read from their manifests (sizes and counts only: launcher.data.checks)
    each_row("data.path", lambda f: data_checks.path_problems(f.values.tree),
             (f"give data.path=DIR, a dataset {data_checks.PREPARE} made, or a blend: "
              "'data.blend=[{path: A, weight: 3}, {path: B, weight: 1}]'")),
    each_row("data.path", lambda f: data_checks.unread_problems(f.values.tree),
             "pick data=tokens to train on the dataset, or remove the key"),
    each_row("data.blend", lambda f: data_checks.weight_problems(f.values.tree),
             ("give every data.blend entry a weight > 0: "
              "'data.blend=[{path: A, weight: 3}, {path: B, weight: 1}]'")),
    each_row("model.seq_len", data_checks.sample_problems, data_checks.sample_fix),
    each_row("data.eval_every", data_checks.eval_problems,
             "set data.eval_every=0, or prepare the dataset with a validation split (`launcher data prepare "
             "--val-fraction 0.01 ...`)"),
    # sweep=asha (launcher.features.asha.schedule): the rungs against train.steps, the objective against the
    # recipe's metrics
    each_row("sweep.rungs", lambda f: sweep_problems(f, "sweep.rungs"),
             "list the rungs increasing, each a step <= train.steps (e.g. sweep.rungs=[5,15,45] train.steps=45)"),
    each_row("sweep.scheduler", lambda f: sweep_problems(f, "sweep.scheduler"),
             ("drop sweep=asha for recipe=script (or port the script to launcher.training.StepLoop: "
              "docs/training-api.md)")),
    each_row("sweep.objective", lambda f: sweep_problems(f, "sweep.objective"),
             "set sweep.objective to a key of the recipe's metrics rows (e.g. loss)"),
    # sweep=pbt (launcher.features.pbt.generations): the generation's length, the quantile, and every explored key in
    # the config
    each_row("sweep.interval", lambda f: sweep_problems(f, "sweep.interval"),
             "set 0 < sweep.interval < train.steps (e.g. sweep.interval=2 train.steps=6)"),
    each_row("sweep.quantile", lambda f: sweep_problems(f, "sweep.quantile"),
             "set sweep.quantile in (0, 0.5] (e.g. 0.25)"),
    each_row("sweep.explore", lambda f: sweep_problems(f, "sweep.explore"),
             "name numeric keys of the config in sweep.explore (e.g. sweep.explore=[optim.lr])"),
    each_row("sweep.factors", lambda f: sweep_problems(f, "sweep.factors"), "set sweep.factors=[0.8,1.25]"),
    # cluster.elastic (launcher.features.elastic.resize): a backend with nodes, and checkpoints another layout can load
    # what the chosen backend cannot do (its capabilities, launcher.backends.base.CAPABILITIES): each
    # setting that asks for one names its own key and fix
    each_row("cluster.backend", capability_problems, ""),
    each_row("cluster.elastic.enabled", lambda f: elastic_problems(f),
             lambda f: ("set cluster.elastic.enabled=false, or: "
                        "train.checkpoint.every=N, train.checkpoint.universal=true, an engine that reshards "
                        "(ddp, fsdp, megatron, deepspeed at ZeRO 1-3, or ZeRO-0 in fp32), "
                        "cluster.elastic.min_nodes <= cluster.nodes <= cluster.elastic.target_nodes")),
    each_row("cluster.env", env_names, "rename the variable (e.g. MY_VAR)"),
    each_row("cluster.sbatch_extra", sbatch_names,
             "use the sbatch long option name without '--', e.g. reservation"),
    each_row("(any key)", lambda f: f.values.unknown_keys,
             "remove it or fix its spelling (only cluster.env and cluster.sbatch_extra take new keys)"),
    each_row("(any string)", lambda f: f.values.control_chars,
             ("remove the control character: a newline (or any character below 0x20, or 0x7f) would end the "
              "#SBATCH or shell line the value is written into, and the rest would run as a command")),
)


_KIND_ORDER = {k: i for i, k in enumerate(ALL_KINDS)}


def table(target: str) -> Tuple[Rule, ...]:
    """The rows a run of the recipe ``target`` is held to: RULES and its contract's rows, ordered by
    kind (VALUE, SHAPE, LAYOUT, RUN; the table's order within a kind)."""
    return _table(target, os.getcwd())


@lru_cache(maxsize=64)
def _table(target: str, cwd: str) -> Tuple[Rule, ...]:  # cwd: where the contract was found (as its cache)
    try:
        spec = recipe_contract.of(target)
        own = own_rows(spec)
    except recipe_contract.ContractError as e:  # reported as the config's error, as a missing target is
        own = (Rule("recipe._target_", lambda f: True, str(e),
                    "fix the recipe's contract module (docs/architecture.md, \"The recipe contract\")", RUN),)
    return tuple(sorted(RULES + own, key=lambda r: _KIND_ORDER[r.kind]))


def _target(f: Facts) -> str:
    t = recipe_contract.tree_get(f.values.tree, "recipe._target_")  # (the tree: nothing flattened)
    return t if isinstance(t, str) and t != "???" else schema.default_target()


def violations(f: Facts, kinds: Sequence[str] = ALL_KINDS) -> List[ConfigError]:
    """The broken rules of ``kinds``, in table order. When a VALUE rule is broken nothing else is
    evaluated (sizes must be positive before anything divides by them)."""
    rows = table(_target(f))
    bad_values = [r for r in rows if r.kind == VALUE and r.broken(f)]
    if bad_values:
        return [r.error(f) for r in bad_values if VALUE in kinds]
    return [e for r in rows if r.kind in kinds and r.kind != VALUE and r.broken(f) for e in r.errors(f)]


@lru_cache(maxsize=64)
def _rows(target: str, cwd: str, kinds: Tuple[str, ...]) -> Tuple[Callable[[Facts], bool], ...]:
    """The predicates of the VALUE rows and the rows of ``kinds``, in table order."""
    return tuple(r.broken for r in _table(target, cwd) if r.kind == VALUE or r.kind in kinds)


def ok(f: Facts, kinds: Sequence[str] = ALL_KINDS) -> bool:
    """Whether ``f`` breaks none of the rules of ``kinds`` (and no VALUE rule): ``not violations(f,
    kinds)`` without formatting a message, for the planner's search over thousands of candidates."""
    for broken in _rows(_target(f), os.getcwd(), tuple(kinds)):
        if broken(f):
            return False
    return True


def problems(cfg_or_facts: Any) -> List[ConfigError]:
    """Every rule a run config (or its Facts) must satisfy; returns the violations (empty = valid)."""
    f = cfg_or_facts if isinstance(cfg_or_facts, Facts) else Facts.from_cfg(cfg_or_facts)
    return violations(f)


def buildable(f: Facts) -> bool:
    """Whether the config names a whole layout (positive sizes, tp*pp dividing the world; for a recipe
    whose rows ask it, the batch splitting evenly), even if other rules are broken."""
    return not violations(f, (VALUE, SHAPE))



def layout_of(f: Facts) -> Layout:
    """The layout of a buildable config (see ``buildable``), whether or not the other rules hold."""
    dp = f.derived_dp
    grad_accum = f.grad_accum
    if dp is None or grad_accum is None:
        errs = violations(f, (VALUE, SHAPE))
        if errs or dp is None:
            raise ConfigErrors(errs)
        grad_accum = 1  # a recipe that does not split train.global_batch_size: one micro batch a step
    return Layout(dp=dp, tp=f.tp, pp=f.pp, zero=f.zero, micro_batch_size=f.micro_batch_size,
                  grad_accum=grad_accum, sequence_parallel=f.sequence_parallel, engine=f.resolved_engine,
                  offload_optimizer=f.offload_optimizer, offload_params=f.offload_params,
                  procs_per_node=f.gpus_per_node)


def resolve(cfg: schema.RunConfig, resolved: Optional[Dict[str, Any]] = None) -> Layout:
    """The layout a valid config describes (``resolved``: see Facts.from_cfg). Raises ConfigErrors
    listing every broken rule."""
    f = Facts.from_cfg(cfg, resolved)
    errs = violations(f)
    if errs:
        raise ConfigErrors(errs)
    return layout_of(f)


def advice(resolved: Dict[str, Any]) -> List[str]:
    """What a valid run config should still hear at launch (printed; never stops a launch)."""
    out: List[str] = []
    cluster, train = resolved.get("cluster") or {}, resolved.get("train") or {}
    nodes, every = int(cluster.get("nodes") or 1), (train.get("checkpoint") or {}).get("every")
    # (recipe=script saves its own checkpoints: train.checkpoint.every is not its setting)
    if nodes > 1 and every is not None and int(every) == 0 and not is_script(resolved.get("recipe")):
        out.append(f"cluster.nodes={nodes} with train.checkpoint.every=0: no periodic checkpoint, so a failure "
                   "that no signal announces (a killed rank, a lost node, an NCCL error) restarts from step 0; "
                   "set train.checkpoint.every (e.g. every 30 minutes' worth of steps)")
    return out
