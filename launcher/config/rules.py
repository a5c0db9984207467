"""The ONE table of rules a config must obey (``RULES``), and the queries over it.

Every rule is a row (key, predicate, problem, fix) over ``launcher.config.layout.Facts``. A row's predicate
says when the rule is broken; its key names the config key at fault, its fix says what to change. The
bound rows (a numeric key below its minimum, above its maximum, nan or inf) are generated from the
bounds ``launcher.config.schema`` declares with each key; rows with ``each`` report one error per offending
key (unknown keys, control characters in strings).

``RULES`` holds the rows every recipe shares; a recipe's contract (launcher.config.recipe_contract) adds
its own, and ``table`` joins them. ``problems`` lists what a config breaks, ``ok`` filters the
planner's candidates, ``resolve`` turns a valid config into its ``Layout``. Pure (no torch): runs on
the login node for every sweep point before anything is submitted.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from functools import lru_cache
from operator import attrgetter
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

from launcher import backends, script_recipe
from launcher.config import recipe_contract, schema
from launcher.config.errors import ConfigError, ConfigErrors
from launcher.config.layout import Facts, Layout
from launcher.config.recipe_target import target_problem
from launcher.config.values import SBATCH_OPTION
from launcher.data import checks as data_checks
from launcher.features.elastic import resize as elastic

Text = Union[str, Callable[[Facts], str]]

# Rule kinds: a broken VALUE or SHAPE rule means no layout can be built from the config (the other
# rules are not evaluated then); LAYOUT rules are what the planner's search filters candidates with;
# RUN rules concern the rest of the run config.
VALUE, SHAPE, LAYOUT, RUN = "value", "shape", "layout", "run"


@dataclass(frozen=True)
class Rule:
    key: str
    broken: Callable[[Facts], bool]
    problem: Text
    fix: Text
    kind: str = LAYOUT
    # a row over many keys (unknown keys, control characters): (key, problem) of each offender; the
    # row's own ``key`` then only describes it
    # (a third item, where given, is that offender's own fix)
    each: Optional[Callable[[Facts], List[Tuple[str, ...]]]] = None

    def error(self, f: Facts) -> ConfigError:
        text = lambda t: t(f) if callable(t) else t  # noqa: E731
        return ConfigError(self.key, text(self.problem), text(self.fix))

    def errors(self, f: Facts) -> List[ConfigError]:
        if self.each is None:
            return [self.error(f)]
        fix = self.fix(f) if callable(self.fix) else self.fix
        return [ConfigError(key, problem, *(own or [fix])) for key, problem, *own in self.each(f)]


def _each(key: str, find: Callable[[Facts], List[Tuple[str, ...]]], fix: Text) -> Rule:
    return Rule(key, lambda f: bool(find(f)), "", fix, RUN, each=find)


# ---- bound rows, generated from the bounds launcher.config.schema declares ---------------------------------

# Keys Facts holds as attributes (the search sets them on candidates without a config): their rows
# read the attribute. Sizes are VALUE rows (nothing divides by them before they hold); the others
# and every key read from ``Facts.values`` are RUN rows.
_FACT_ATTR = {
    "cluster.nodes": "nodes", "cluster.gpus_per_node": "gpus_per_node", "parallelism.tp": "tp",
    "parallelism.pp": "pp", "parallelism.dp": "dp", "train.micro_batch_size": "micro_batch_size",
    "train.global_batch_size": "global_batch_size", "train.steps": "steps", "zero.stage": "zero",
    "optim.lr": "lr", "optim.warmup_steps": "warmup_steps", "train.fail_at_step": "fail_at_step",
    "train.fail_rank": "fail_rank",
}
_SIZES = frozenset(k for k in _FACT_ATTR if k.split(".")[0] != "optim" and k not in (
    "train.fail_at_step", "train.fail_rank"))
_FLOAT_MAX = sys.float_info.max


def _bound_row(leaf: schema.Leaf, sizes: frozenset = frozenset()) -> Rule:
    """The row for one numeric key of the schema: within its declared bounds; a float also finite
    (nan and inf refused), an int also a 64-bit one; null only where the schema allows it. ``sizes``:
    a recipe's size keys (its contract's), read from Facts by their dotted path, VALUE rows."""
    b = leaf.bounds or schema.Bounds()
    is_float = leaf.type is float
    top = _FLOAT_MAX if is_float else schema.INT64_MAX
    lo = b.gt if b.gt is not None else (b.ge if b.ge is not None else -top - (0 if is_float else 1))
    hi = b.lt if b.lt is not None else (b.le if b.le is not None else top)
    lo_open, hi_open, optional, key = b.gt is not None, b.lt is not None, leaf.optional, leaf.key
    attr = _FACT_ATTR.get(key) or (key if key in sizes else None)
    if attr is not None:
        get = attrgetter(attr)  # typed: a number, or None (null)
        if not lo_open and not hi_open:  # the common case, kept cheap for the search's VALUE rows
            def broken(f: Facts) -> bool:
                v = get(f)
                return (not optional) if v is None else not (lo <= v <= hi)
        else:
            def broken(f: Facts) -> bool:
                v = get(f)
                return (not optional) if v is None else not _within(v, lo, lo_open, hi, hi_open)
        kind = VALUE if key in _SIZES or key in sizes else RUN
    else:
        def get(f: Facts) -> Any:
            return f.values.get(key)

        def broken(f: Facts) -> bool:  # absent (no config) or not a number (Hydra's type check): not ours
            v = get(f)
            return isinstance(v, (int, float)) and not isinstance(v, bool) and not _within(v, lo, lo_open, hi, hi_open)
        kind = RUN

    desc = b.describe() if leaf.bounds else ""

    def problem(f: Facts) -> str:
        v = get(f)
        if v is None:
            return "must be set (it may not be null)"
        if is_float and not (-_FLOAT_MAX <= v <= _FLOAT_MAX):
            what = f"a finite number {desc}".rstrip()
        elif not is_float and not (-top - 1 <= v <= top):
            what = f"a 64-bit integer {desc}".rstrip()
        elif not is_float and b.ge == 1 and b.le is None and b.lt is None:
            what = "a positive integer"
        else:
            what = desc
        return f"must be {what}{(' ' + b.why) if b.why else ''}, got {v!r}"

    if b.fix:
        fix = b.fix
    elif b.ge is not None and b.le is None and b.lt is None:
        fix = f"set {key}={schema.show_number(b.ge)} or more"
    else:
        fix = f"set {key} to a value {desc or 'that fits'}"
    return Rule(key, broken, problem, fix, kind)


def _within(v: Any, lo: Any, lo_open: bool, hi: Any, hi_open: bool) -> bool:
    return (lo < v if lo_open else lo <= v) and (v < hi if hi_open else v <= hi)


def _bound_rows(kind: str) -> Tuple[Rule, ...]:
    rows = (_bound_row(leaf) for leaf in schema.leaves() if leaf.type in (int, float))
    return tuple(r for r in rows if r.kind == kind)


def bound_rows(run_schema: type, sizes: Sequence[str] = ()) -> Tuple[Rule, ...]:
    """The bound rows of the numeric keys a recipe's schema (a RunConfig subclass) adds; ``sizes``:
    those read from Facts (VALUE rows). A contract lists them with its rules (``table`` adds those of
    a schema's keys its rules leave out)."""
    shared = {leaf.key for leaf in schema.leaves()}
    return tuple(_bound_row(leaf, frozenset(sizes)) for leaf in schema.leaves_of(run_schema)
                 if leaf.key not in shared and leaf.type in (int, float))


def _own_rows(spec: recipe_contract.RecipeSpec) -> Tuple[Rule, ...]:
    """A contract's rows, and the bound rows of its schema's keys it does not list itself."""
    listed = {r.key for r in spec.rules}
    auto = bound_rows(spec.schema, spec.sizes) if spec.schema is not None else ()
    return tuple(spec.rules) + tuple(r for r in auto if r.key not in listed)


# ---- what the RUN rows ask beyond the config ------------------------------------------------------

# oneDNN has fp16 kernels (so DeepSpeed's CPU accelerator accepts fp16) only on CPUs with these flags
FP16_CPU_FLAGS = frozenset({"avx512_fp16", "amx_fp16"})


def _lacks_cpu_fp16(backend: str) -> bool:
    """Whether the backend's jobs run on a CPU without fp16 kernels (known only where they run on
    this host's CPU: ``Backend.host_cpu_flags``)."""
    flags = backends.get(backend).host_cpu_flags()
    return flags is not None and not (flags & FP16_CPU_FLAGS)


def _settings_problem(f: Facts) -> Optional[str]:
    """What the recipe's own check (its contract's ``check``) finds wrong with its settings, or None."""
    check = recipe_contract.of(f.values.get("recipe._target_"), strict=False).check  # (broken: its own row)
    if check is None:
        return None
    try:
        check(f.values.tree)
    except ValueError as e:
        return str(e)
    return None


def _host_gpus(backend: str) -> Optional[int]:
    return backends.get(backend).host_gpu_count()


def _max_nodes(backend: str) -> Optional[int]:
    return backends.get(backend).max_nodes


def _max_restarts(backend: str) -> Optional[int]:
    return backends.get(backend).max_restarts


def _cluster_mapping(f: Facts, name: str) -> Dict[Any, Any]:
    cl = f.values.tree.get("cluster")
    m = cl.get(name) if isinstance(cl, dict) else None
    return m if isinstance(m, dict) else {}


def _env_names(f: Facts) -> List[Tuple[str, str]]:
    return [(f"cluster.env.{k}", "is not an environment variable name (letters, digits and _, not starting "
             "with a digit)") for k in _cluster_mapping(f, "env") if not str(k).isidentifier()]


def _sbatch_names(f: Facts) -> List[Tuple[str, str]]:
    return [(f"cluster.sbatch_extra.{k}", "is not an sbatch option name (letters, digits, - and _)")
            for k in _cluster_mapping(f, "sbatch_extra") if not SBATCH_OPTION.match(str(k))]


def _largest_divisor(n: int, upto: int) -> int:
    """Largest divisor of n that is <= upto (a suggestion for the fix line)."""
    return max(d for d in range(1, max(1, min(n, upto)) + 1) if n % d == 0)


def _backend_names() -> List[str]:
    return backends.names()


# The rows every recipe is held to; a recipe adds its own (its contract's ``rules``: ``table``).
def _elastic_problems(f: Facts) -> List[Tuple[str, str]]:
    if not f.values.get("cluster.elastic.enabled"):
        return []
    return elastic.problems(f.values, f.resolved_engine, f.zero, script_recipe.is_script(f.values.tree.get("recipe")),
                            f.dtype)


def _capability_problems(f: Facts) -> List[Tuple[str, str, str]]:
    """(key, problem, fix) of each setting that needs what the chosen backend cannot do."""
    return backends.get(f.backend).lacks(f.values.get) if f.backend in _backend_names() else []


def _sweep_problems(f: Facts, key: str) -> List[Tuple[str, str]]:
    """(key, problem) of a scheduler's settings (sweep=asha only; reduction: its bound row)."""
    from launcher.features.asha import schedule as asha  # pure

    sweep = f.values.tree.get("sweep") or {}
    if not sweep.get("scheduler"):
        return []
    steps = int(f.values.get("train.steps") or 0)
    if str(getattr(sweep.get("scheduler"), "value", sweep.get("scheduler"))) == "pbt":
        from launcher.features.pbt import generations as pbt  # pure

        found = pbt.problems(sweep, steps, f.values.tree)
        out = [(k, p) for k, p, _ in found if k == key or (key == "sweep.explore" and not k.startswith("sweep."))]
    else:
        out = [(k, p) for k, p, _ in asha.problems(sweep, steps) if k == key and k != "sweep.reduction"]
    if key == "sweep.scheduler" and script_recipe.is_script(f.values.tree.get("recipe")):
        out.append((key, "recipe=script runs a script the launcher cannot pause at a rung (no StepLoop)"))
    if key == "sweep.objective":
        declared = recipe_contract.of(f.values.get("recipe._target_"), strict=False).metrics
        why = asha.objective_problem(str(sweep.get("objective")), declared)
        if why:
            out.append((key, why))
    return out


RULES: Tuple[Rule, ...] = (
    # sizes: the bounds launcher.config.schema declares for the keys the layout is built from
    *_bound_rows(VALUE),
    Rule("cluster.backend", lambda f: f.backend not in _backend_names(),
         lambda f: f"{f.backend!r} is not a backend", lambda f: f"choose one of {', '.join(_backend_names())}",
         VALUE),
    Rule("parallelism.tp", lambda f: f.derived_dp is None,
         lambda f: (f"parallelism.tp*parallelism.pp = {f.tp}*{f.pp} = {f.tp * f.pp} does not divide the world "
                    f"size cluster.nodes*cluster.gpus_per_node = {f.nodes}*{f.gpus_per_node} = {f.world}"),
         lambda f: (f"choose tp and pp whose product divides {f.world} (e.g. parallelism.tp="
                    f"{_largest_divisor(f.world, f.tp)}), or change cluster.nodes / cluster.gpus_per_node"),
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
    *_bound_rows(RUN),
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
    Rule("train.dist_timeout_s",
         lambda f: 0 < (f.values.get("train.hang_timeout_s") or 0) >= (f.values.get("train.dist_timeout_s") or 0),
         lambda f: (f"collectives give up after {f.values.get('train.dist_timeout_s')} s, before the hang watchdog "
                    f"(train.hang_timeout_s={f.values.get('train.hang_timeout_s')}) can dump the stacks and name the "
                    "stuck rank"),
         lambda f: f"raise train.dist_timeout_s above {f.values.get('train.hang_timeout_s')} (e.g. twice it)", RUN),
    Rule("train.max_restarts",
         lambda f: (_max_restarts(f.backend) is not None
                    and (f.values.get("train.max_restarts") or 0) > _max_restarts(f.backend)),
         lambda f: (f"the {f.backend} backend restarts a job at most {_max_restarts(f.backend)} times, but "
                    f"train.max_restarts={f.values.get('train.max_restarts')}"),
         lambda f: f"set train.max_restarts to {_max_restarts(f.backend)} or less (or use a Slurm cluster)", RUN),
    Rule("cluster.nodes", lambda f: _max_nodes(f.backend) is not None and f.nodes > _max_nodes(f.backend),
         lambda f: (f"the {f.backend} backend runs {_max_nodes(f.backend)} node(s) (its processes on this host), but "
                    f"cluster.nodes={f.nodes}: {f.gpus_per_node * _max_nodes(f.backend)} process(es) would run a "
                    f"layout archived for a world of {f.world}"),
         lambda f: f"set cluster.nodes={_max_nodes(f.backend)} or use a Slurm cluster (e.g. cluster=local_slurm)", RUN),
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
         lambda f: _host_gpus(f.backend) is not None and f.gpus_per_node > _host_gpus(f.backend),
         lambda f: (f"cluster.gpus_per_node={f.gpus_per_node} processes, but this host has {_host_gpus(f.backend)} "
                    "GPU(s) for them: two processes on one GPU (NCCL refuses a duplicate GPU)"),
         lambda f: (f"set cluster.gpus_per_node={_host_gpus(f.backend)}, "
                    "or CUDA_VISIBLE_DEVICES to the GPUs to use"), RUN),
    Rule("precision.dtype",
         lambda f: f.dtype == "fp16" and f.resolved_engine == "deepspeed" and _lacks_cpu_fp16(f.backend),
         lambda f: (f"fp16 on the deepspeed engine runs on this host's CPU (cluster.backend={f.backend}), which has "
                    "no fp16 kernels (its /proc/cpuinfo flags include neither "
                    f"{' nor '.join(sorted(FP16_CPU_FLAGS))}): "
                    "DeepSpeed's CPU accelerator refuses fp16 at start-up"),
         ("use precision=bf16 (or fp32), or run fp16 on the ddp engine (zero=0, parallelism.engine=ddp or auto), "
          "whose fp16 autocast with a loss scaler runs on this CPU"), RUN),
    Rule("recipe.params", lambda f: _settings_problem(f) is not None,
         lambda f: f"{_settings_problem(f)}: the job would fail when it starts",
         lambda f: ("set a valid value (the recipe's settings and their bounds: "
                    f"{recipe_contract.of(f.values.get('recipe._target_')).check_doc})"), RUN),
    Rule("recipe._target_",
         lambda f: (isinstance(f.values.get("recipe._target_"), str)
                    and target_problem(f.values.get("recipe._target_")) is not None),
         lambda f: f"{target_problem(f.values.get('recipe._target_'))}: the job would fail when it starts",
         "name a function fn(cfg, ctx) of an importable module, e.g. recipe._target_=mypkg.train.main", RUN),
    _each("recipe.script", lambda f: script_recipe.problems(f.values.tree), lambda f: script_recipe.fix(f.values.tree)),
    # data=tokens: its datasets, read from their manifests (sizes and counts only: launcher.data.checks)
    _each("data.path", lambda f: data_checks.path_problems(f.values.tree),
          (f"give data.path=DIR, a dataset {data_checks.PREPARE} made, or a blend: "
           "'data.blend=[{path: A, weight: 3}, {path: B, weight: 1}]'")),
    _each("data.path", lambda f: data_checks.unread_problems(f.values.tree),
          "pick data=tokens to train on the dataset, or remove the key"),
    _each("data.blend", lambda f: data_checks.weight_problems(f.values.tree),
          "give every data.blend entry a weight > 0: 'data.blend=[{path: A, weight: 3}, {path: B, weight: 1}]'"),
    _each("model.seq_len", data_checks.sample_problems, data_checks.sample_fix),
    _each("data.eval_every", data_checks.eval_problems,
          "set data.eval_every=0, or prepare the dataset with a validation split (`launcher data prepare "
          "--val-fraction 0.01 ...`)"),
    # sweep=asha (launcher.features.asha.schedule): the rungs against train.steps, the objective against the
    # recipe's metrics
    _each("sweep.rungs", lambda f: _sweep_problems(f, "sweep.rungs"),
          "list the rungs increasing, each a step <= train.steps (e.g. sweep.rungs=[5,15,45] train.steps=45)"),
    _each("sweep.scheduler", lambda f: _sweep_problems(f, "sweep.scheduler"),
          "drop sweep=asha for recipe=script (or port the script to launcher.training.StepLoop: docs/training-api.md)"),
    _each("sweep.objective", lambda f: _sweep_problems(f, "sweep.objective"),
          "set sweep.objective to a key of the recipe's metrics rows (e.g. loss)"),
    # sweep=pbt (launcher.features.pbt.generations): the generation's length, the quantile, and every explored key in
    # the config
    _each("sweep.interval", lambda f: _sweep_problems(f, "sweep.interval"),
          "set 0 < sweep.interval < train.steps (e.g. sweep.interval=2 train.steps=6)"),
    _each("sweep.quantile", lambda f: _sweep_problems(f, "sweep.quantile"),
          "set sweep.quantile in (0, 0.5] (e.g. 0.25)"),
    _each("sweep.explore", lambda f: _sweep_problems(f, "sweep.explore"),
          "name numeric keys of the config in sweep.explore (e.g. sweep.explore=[optim.lr])"),
    _each("sweep.factors", lambda f: _sweep_problems(f, "sweep.factors"), "set sweep.factors=[0.8,1.25]"),
    # cluster.elastic (launcher.features.elastic.resize): a backend with nodes, and checkpoints another layout can load
    # what the chosen backend cannot do (its capabilities, launcher.backends.base.CAPABILITIES): each
    # setting that asks for one names its own key and fix
    _each("cluster.backend", _capability_problems, ""),
    _each("cluster.elastic.enabled", lambda f: _elastic_problems(f),
          lambda f: ("set cluster.elastic.enabled=false, or: "
                     "train.checkpoint.every=N, train.checkpoint.universal=true, an engine that reshards "
                     "(ddp, fsdp, megatron, deepspeed at ZeRO 1-3, or ZeRO-0 in fp32), "
                     "cluster.elastic.min_nodes <= cluster.nodes <= cluster.elastic.target_nodes")),
    _each("cluster.env", _env_names, "rename the variable (e.g. MY_VAR)"),
    _each("cluster.sbatch_extra", _sbatch_names, "use the sbatch long option name without '--', e.g. reservation"),
    _each("(any key)", lambda f: f.values.unknown_keys,
          "remove it or fix its spelling (only cluster.env and cluster.sbatch_extra take new keys)"),
    _each("(any string)", lambda f: f.values.control_chars,
          ("remove the control character: a newline (or any character below 0x20, or 0x7f) would end the #SBATCH "
           "or shell line the value is written into, and the rest would run as a command")),
)


ALL_KINDS = (VALUE, SHAPE, LAYOUT, RUN)
_KIND_ORDER = {k: i for i, k in enumerate(ALL_KINDS)}


def table(target: str) -> Tuple[Rule, ...]:
    """The rows a run of the recipe ``target`` is held to: RULES and its contract's rows, ordered by
    kind (VALUE, SHAPE, LAYOUT, RUN; the table's order within a kind)."""
    return _table(target, os.getcwd())


@lru_cache(maxsize=64)
def _table(target: str, cwd: str) -> Tuple[Rule, ...]:  # cwd: where the contract was found (as its cache)
    try:
        spec = recipe_contract.of(target)
        own = _own_rows(spec)
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


def resolve(cfg: Any, resolved: Optional[Dict[str, Any]] = None) -> Layout:
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
    if nodes > 1 and every is not None and int(every) == 0 and not script_recipe.is_script(resolved.get("recipe")):
        out.append(f"cluster.nodes={nodes} with train.checkpoint.every=0: no periodic checkpoint, so a failure "
                   "that no signal announces (a killed rank, a lost node, an NCCL error) restarts from step 0; "
                   "set train.checkpoint.every (e.g. every 30 minutes' worth of steps)")
    return out
