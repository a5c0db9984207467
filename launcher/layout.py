"""Layout: how a run's processes divide the work, derived from the config, and the rules it must obey.

Pure functions only (no torch): they run on the login node for every sweep point before anything
is submitted. Every rule names the config key at fault and says how to fix it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List

from launcher.schema import enum_value


class ConfigError(ValueError):
    """A config value that cannot work. Carries the key so the message can name it."""

    def __init__(self, key: str, problem: str, fix: str):
        self.key, self.problem, self.fix = key, problem, fix
        super().__init__(f"{key}: {problem}\n  fix: {fix}")


class ConfigErrors(ValueError):
    """Several ConfigErrors found at once (every rule is checked before reporting)."""

    def __init__(self, errors: List[ConfigError], where: str = ""):
        self.errors = errors
        head = f"invalid config{(' ' + where) if where else ''}"
        super().__init__(head + ":\n" + "\n".join(f"- {e}" for e in errors))


def engine_for(cfg: Any) -> str:
    """The engine a config runs on: `parallelism.engine`, or for `auto` the one its layout needs."""
    engine = enum_value(cfg.parallelism.engine)
    if engine != "auto":
        return engine
    if cfg.parallelism.tp > 1 or cfg.parallelism.pp > 1:
        return "megatron"
    return "deepspeed" if cfg.zero.stage > 0 else "ddp"


@dataclass(frozen=True)
class Layout:
    engine: str
    world_size: int
    nodes: int
    procs_per_node: int
    dp: int
    tp: int
    pp: int
    micro_batch_size: int
    global_batch_size: int
    grad_accum: int

    @property
    def num_micro_batches(self) -> int:
        """Micro-batches each pipeline sees per step (= gradient accumulation steps)."""
        return self.grad_accum


def check(cfg: Any) -> List[ConfigError]:
    """Every rule the run config must satisfy; returns the violations (empty = valid)."""
    errs: List[ConfigError] = []
    m, par, tr, cl, z = cfg.model, cfg.parallelism, cfg.train, cfg.cluster, cfg.zero

    def positive(key: str, value: int) -> bool:
        if value is None or value < 1:
            errs.append(ConfigError(key, f"must be a positive integer, got {value}", f"set {key}=1 or more"))
            return False
        return True

    ok = all(
        [
            positive("cluster.nodes", cl.nodes),
            positive("cluster.gpus_per_node", cl.gpus_per_node),
            positive("parallelism.tp", par.tp),
            positive("parallelism.pp", par.pp),
            positive("train.micro_batch_size", tr.micro_batch_size),
            positive("train.global_batch_size", tr.global_batch_size),
            positive("train.steps", tr.steps),
            positive("model.num_layers", m.num_layers),
            positive("model.hidden_size", m.hidden_size),
            positive("model.num_heads", m.num_heads),
            positive("model.ffn_hidden_size", m.ffn_hidden_size),
            positive("model.vocab_size", m.vocab_size),
            positive("model.seq_len", m.seq_len),
        ]
    )
    if not ok:
        return errs

    world = cl.nodes * cl.gpus_per_node
    tp, pp = par.tp, par.pp
    if world % (tp * pp):
        errs.append(
            ConfigError(
                "parallelism.tp",
                f"parallelism.tp*parallelism.pp = {tp}*{pp} = {tp * pp} does not divide the world size "
                f"cluster.nodes*cluster.gpus_per_node = {cl.nodes}*{cl.gpus_per_node} = {world}",
                f"choose tp and pp whose product divides {world} (e.g. parallelism.tp={_largest_divisor(world, tp)}), "
                f"or change cluster.nodes / cluster.gpus_per_node",
            )
        )
        dp = None
    else:
        dp = world // (tp * pp)
        if par.dp is not None and par.dp != dp:
            errs.append(
                ConfigError(
                    "parallelism.dp",
                    f"is {par.dp} but world size {world} / (tp {tp} * pp {pp}) gives {dp}",
                    f"set parallelism.dp={dp} or parallelism.dp=null to derive it",
                )
            )
    if tp > cl.gpus_per_node and world > 1:
        errs.append(
            ConfigError(
                "parallelism.tp",
                f"tp={tp} spans more than one node ({cl.gpus_per_node} per node): tensor-parallel "
                "collectives run every layer and need the intra-node link",
                f"use parallelism.tp<={cl.gpus_per_node} and put the rest into parallelism.pp",
            )
        )
    if dp is not None:
        per_step = dp * tr.micro_batch_size
        if tr.global_batch_size % per_step:
            errs.append(
                ConfigError(
                    "train.global_batch_size",
                    f"{tr.global_batch_size} is not a multiple of dp*micro_batch_size = {dp}*{tr.micro_batch_size} = {per_step}",
                    f"set train.global_batch_size to a multiple of {per_step} "
                    f"(e.g. {max(per_step, tr.global_batch_size // per_step * per_step)}) or change train.micro_batch_size",
                )
            )
    if m.hidden_size % m.num_heads:
        errs.append(
            ConfigError(
                "model.num_heads",
                f"hidden_size {m.hidden_size} is not divisible by num_heads {m.num_heads}",
                "pick num_heads dividing model.hidden_size",
            )
        )
    if m.num_heads % tp:
        errs.append(
            ConfigError("model.num_heads", f"{m.num_heads} heads cannot be split over tp={tp}", "make parallelism.tp divide model.num_heads")
        )
    if m.ffn_hidden_size % tp:
        errs.append(
            ConfigError(
                "model.ffn_hidden_size", f"{m.ffn_hidden_size} is not divisible by tp={tp}", "make parallelism.tp divide model.ffn_hidden_size"
            )
        )
    if m.vocab_size % tp:
        errs.append(
            ConfigError("model.vocab_size", f"{m.vocab_size} is not divisible by tp={tp}", "pad model.vocab_size to a multiple of parallelism.tp")
        )
    if m.num_layers % pp:
        errs.append(
            ConfigError("model.num_layers", f"{m.num_layers} layers cannot be split evenly into pp={pp} stages", "make parallelism.pp divide model.num_layers")
        )
    if z.stage not in (0, 1, 2, 3):
        errs.append(ConfigError("zero.stage", f"must be 0, 1, 2 or 3, got {z.stage}", "choose zero=0..3"))
    if (z.offload_optimizer or z.offload_params) and z.stage == 0:
        errs.append(
            ConfigError("zero.offload_optimizer", "offload needs ZeRO stage 1 or more", "set zero=1/2/3 or turn offload off")
        )
    if z.offload_params and z.stage != 3:
        errs.append(ConfigError("zero.offload_params", "parameter offload needs ZeRO stage 3", "set zero=3 or zero.offload_params=false"))
    if par.sequence_parallel and tp == 1:
        errs.append(
            ConfigError("parallelism.sequence_parallel", "sequence parallelism needs tp > 1", "set parallelism.tp>=2 or parallelism.sequence_parallel=false")
        )
    errs.extend(_engine_rules(cfg))
    if not 0.0 <= m.dropout < 1.0:
        errs.append(ConfigError("model.dropout", f"must be in [0, 1), got {m.dropout}", "set model.dropout=0.0"))
    if cfg.optim.lr <= 0:
        errs.append(ConfigError("optim.lr", f"must be > 0, got {cfg.optim.lr}", "set optim.lr to e.g. 3e-4"))
    if cfg.optim.warmup_steps < 0 or cfg.optim.warmup_steps > tr.steps:
        errs.append(
            ConfigError("optim.warmup_steps", f"{cfg.optim.warmup_steps} is outside [0, train.steps={tr.steps}]", "lower optim.warmup_steps")
        )
    if tr.fail_at_step is not None and not 0 <= tr.fail_rank < world:
        errs.append(ConfigError("train.fail_rank", f"{tr.fail_rank} is not a rank of a {world}-process job", f"choose 0..{world - 1}"))
    return errs


def _engine_rules(cfg: Any) -> List[ConfigError]:
    """Which parallelism/precision/ZeRO combinations each engine can run."""
    par, z = cfg.parallelism, cfg.zero
    engine = engine_for(cfg)
    errs: List[ConfigError] = []
    if engine == "ddp":
        if par.tp > 1 or par.pp > 1:
            errs.append(
                ConfigError(
                    "parallelism.engine",
                    f"engine ddp is data parallel only, but tp={par.tp} pp={par.pp}",
                    "use parallelism.engine=megatron (or auto) for tensor/pipeline parallelism",
                )
            )
        if z.stage > 0:
            errs.append(
                ConfigError(
                    "zero.stage", f"ZeRO stage {z.stage} needs the deepspeed engine",
                    "use parallelism.engine=deepspeed (or auto), or zero=0",
                )
            )
    elif engine == "deepspeed":
        if z.stage == 0 and enum_value(cfg.precision.dtype) == "fp16":
            errs.append(
                ConfigError(
                    "precision.dtype",
                    "fp16 on the deepspeed engine at ZeRO stage 0 trains ~65536x too slowly: DeepSpeed 0.19 "
                    "divides the gradients by the loss scale without ever scaling the loss",
                    "use zero=1/2/3, precision=bf16, or parallelism.engine=ddp",
                )
            )
        if par.tp > 1 or par.pp > 1:
            errs.append(
                ConfigError(
                    "parallelism.engine",
                    f"the deepspeed engine runs data parallel + ZeRO only, but tp={par.tp} pp={par.pp}",
                    "use parallelism.engine=megatron (or auto) for tensor/pipeline parallelism",
                )
            )
    elif engine == "megatron":
        world = cfg.cluster.nodes * cfg.cluster.gpus_per_node
        if par.pp > 1 and world % (par.tp * par.pp) == 0:
            dp = world // (par.tp * par.pp)
            per_step = dp * cfg.train.micro_batch_size
            if per_step and cfg.train.global_batch_size % per_step == 0:
                m = cfg.train.global_batch_size // per_step
                if m < par.pp:
                    errs.append(
                        ConfigError(
                            "train.global_batch_size",
                            f"gives {m} micro-batch(es) per step but the 1F1B pipeline has pp={par.pp} stages "
                            "and needs at least one micro-batch per stage",
                            f"raise train.global_batch_size to >= {par.pp * per_step} or lower "
                            "train.micro_batch_size",
                        )
                    )
        if par.sequence_parallel and cfg.model.seq_len % par.tp:
            errs.append(
                ConfigError(
                    "parallelism.sequence_parallel",
                    f"model.seq_len={cfg.model.seq_len} cannot be split over tp={par.tp}",
                    "make parallelism.tp divide model.seq_len, or set parallelism.sequence_parallel=false",
                )
            )
        if cfg.model.dropout > 0 and par.tp > 1:
            errs.append(
                ConfigError(
                    "model.dropout",
                    "dropout with tp > 1 would draw the same masks on every tensor-parallel rank "
                    "(there is no per-rank RNG stream yet)",
                    "set model.dropout=0.0 for tensor-parallel runs",
                )
            )
        if z.stage > 1:
            errs.append(
                ConfigError(
                    "zero.stage",
                    f"ZeRO stage {z.stage} cannot be combined with tensor/pipeline parallelism here "
                    "(gradients and parameters are already split by tp/pp; stages 2-3 would re-shard "
                    "them every micro-batch of the pipeline)",
                    "use zero=1 (optimizer states sharded across data-parallel ranks) or zero=0",
                )
            )
        if z.offload_optimizer or z.offload_params:
            errs.append(
                ConfigError("zero.offload_optimizer", "offload needs the deepspeed engine",
                            "turn offload off, or use tp=pp=1 with parallelism.engine=deepspeed")
            )
    return errs


def resolve(cfg: Any) -> Layout:
    """The layout a valid config describes. Raises ConfigErrors if any rule fails."""
    errs = check(cfg)
    if errs:
        raise ConfigErrors(errs)
    cl, tr, par = cfg.cluster, cfg.train, cfg.parallelism
    world = cl.nodes * cl.gpus_per_node
    dp = world // (par.tp * par.pp)
    return Layout(
        engine=engine_for(cfg),
        world_size=world,
        nodes=cl.nodes,
        procs_per_node=cl.gpus_per_node,
        dp=dp,
        tp=par.tp,
        pp=par.pp,
        micro_batch_size=tr.micro_batch_size,
        global_batch_size=tr.global_batch_size,
        grad_accum=tr.global_batch_size // (dp * tr.micro_batch_size),
    )


def _largest_divisor(n: int, upto: int) -> int:
    """Largest divisor of n that is <= upto (a suggestion for the fix line)."""
    return max(d for d in range(1, max(1, min(n, upto)) + 1) if n % d == 0)
