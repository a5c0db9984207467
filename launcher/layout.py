"""Layout: how a run's processes divide the work, and the ONE table of rules a config must obey.

- ``Facts``: the config values the rules look at, flat (from a composed config, or from the planner
  for a candidate layout). Built once per config.
- ``RULES``: every rule as a row (key, predicate, problem, fix). A row's predicate says when the rule
  is broken; its key names the config key at fault, its fix says what to change.
- ``Layout`` (as torchtitan's ParallelDims): engine, dp/tp/pp, ZeRO, micro batch and gradient
  accumulation, and where every rank sits (dp x pp x tp mesh, block placement on nodes). The login
  side archives it in run.json; the node, the engines and the planner read that same object.

Pure (no torch): runs on the login node for every sweep point before anything is submitted.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from functools import cached_property
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

from launcher.schema import enum_value

AXES = ("dp", "pp", "tp")
Coords = Tuple[int, int, int]


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


def implied_engine(tp: int, pp: int, zero: int) -> str:
    """The engine ``parallelism.engine=auto`` picks: megatron for tp or pp > 1, deepspeed for ZeRO > 0,
    else ddp."""
    if tp > 1 or pp > 1:
        return "megatron"
    return "deepspeed" if zero > 0 else "ddp"


# ---- facts ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelSpec:
    """The shape of a decoder-only GPT (the fields of launcher.schema.ModelConfig): what the rules
    read and what the planner's estimators take."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    ffn_hidden_size: int
    vocab_size: int
    seq_len: int
    tie_embeddings: bool = True
    dropout: float = 0.0

    @classmethod
    def from_cfg(cls, m: Any) -> "ModelSpec":
        """From a ModelConfig-like object (DictConfig, dataclass or namespace)."""
        return cls(
            name=str(getattr(m, "name", "model")),
            num_layers=int(m.num_layers),
            hidden_size=int(m.hidden_size),
            num_heads=int(m.num_heads),
            ffn_hidden_size=int(m.ffn_hidden_size),
            vocab_size=int(m.vocab_size),
            seq_len=int(m.seq_len),
            tie_embeddings=bool(getattr(m, "tie_embeddings", True)),
            dropout=float(getattr(m, "dropout", 0.0) or 0.0),
        )


@dataclass(frozen=True)
class Facts:
    """The values the rules read. Run-only fields (lr, steps, ...) default to valid values so the
    planner can check a candidate layout without a whole run config."""

    nodes: int
    gpus_per_node: int
    tp: int
    pp: int
    micro_batch_size: int
    global_batch_size: int
    model: ModelSpec
    dp: Optional[int] = None  # requested (parallelism.dp); None = derived
    engine: str = "auto"  # requested (parallelism.engine)
    zero: int = 0
    offload_optimizer: bool = False
    offload_params: bool = False
    sequence_parallel: bool = False
    dtype: str = "fp32"
    steps: int = 1
    lr: float = 1e-3
    warmup_steps: int = 0
    fail_at_step: Optional[int] = None
    fail_rank: int = 0
    backend: str = "local"

    @cached_property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    @cached_property
    def derived_dp(self) -> Optional[int]:
        """world / (tp * pp), or None when tp * pp does not divide the world."""
        mp = self.tp * self.pp
        return self.world // mp if mp > 0 and self.world % mp == 0 else None

    @cached_property
    def per_step(self) -> Optional[int]:
        dp = self.derived_dp
        return None if dp is None else dp * self.micro_batch_size

    @cached_property
    def grad_accum(self) -> Optional[int]:
        """Micro-batches per step on each replica, or None when the batch does not split evenly."""
        ps = self.per_step
        return self.global_batch_size // ps if ps and self.global_batch_size % ps == 0 else None

    @cached_property
    def resolved_engine(self) -> str:
        return implied_engine(self.tp, self.pp, self.zero) if self.engine == "auto" else self.engine

    def with_(self, **changes: Any) -> "Facts":
        """A copy with some values changed (derived values are computed afresh)."""
        return Facts(**{**{k: v for k, v in vars(self).items() if k in _FACT_FIELDS}, **changes})

    @classmethod
    def from_cfg(cls, cfg: Any) -> "Facts":
        m, par, tr, cl, z = cfg.model, cfg.parallelism, cfg.train, cfg.cluster, cfg.zero
        optim = cfg.get("optim") if hasattr(cfg, "get") else getattr(cfg, "optim", None)
        opt = lambda name, default: default if optim is None else getattr(optim, name)  # noqa: E731
        return cls(
            nodes=cl.nodes, gpus_per_node=cl.gpus_per_node, tp=par.tp, pp=par.pp,
            micro_batch_size=tr.micro_batch_size, global_batch_size=tr.global_batch_size,
            model=ModelSpec.from_cfg(m), dp=par.dp, engine=enum_value(par.engine), zero=z.stage,
            offload_optimizer=bool(z.offload_optimizer), offload_params=bool(z.offload_params),
            sequence_parallel=bool(par.sequence_parallel), dtype=enum_value(cfg.precision.dtype),
            steps=tr.steps, lr=float(opt("lr", 1e-3)),
            warmup_steps=int(opt("warmup_steps", 0)), fail_at_step=tr.fail_at_step, fail_rank=tr.fail_rank,
            backend=enum_value(cl.backend),
        )


_FACT_FIELDS = frozenset(f.name for f in fields(Facts))

# ---- the rule table -------------------------------------------------------------------------------

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

    def error(self, f: Facts) -> ConfigError:
        text = lambda t: t(f) if callable(t) else t  # noqa: E731
        return ConfigError(self.key, text(self.problem), text(self.fix))


def _positive(key: str) -> Rule:
    """``key`` (e.g. model.num_layers) must be >= 1; Facts holds it under its last name."""
    group, name = key.split(".")
    get = (lambda f: getattr(f.model, name)) if group == "model" else (lambda f: getattr(f, name))
    return Rule(key, lambda f: get(f) is None or get(f) < 1,
                lambda f: f"must be a positive integer, got {get(f)}", f"set {key}=1 or more", VALUE)


def _largest_divisor(n: int, upto: int) -> int:
    """Largest divisor of n that is <= upto (a suggestion for the fix line)."""
    return max(d for d in range(1, max(1, min(n, upto)) + 1) if n % d == 0)


def _backend_names() -> List[str]:
    from launcher.backends import names

    return names()


RULES: Tuple[Rule, ...] = (
    _positive("cluster.nodes"),
    _positive("cluster.gpus_per_node"),
    _positive("parallelism.tp"),
    _positive("parallelism.pp"),
    _positive("train.micro_batch_size"),
    _positive("train.global_batch_size"),
    _positive("train.steps"),
    _positive("model.num_layers"),
    _positive("model.hidden_size"),
    _positive("model.num_heads"),
    _positive("model.ffn_hidden_size"),
    _positive("model.vocab_size"),
    _positive("model.seq_len"),
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
    Rule("train.global_batch_size", lambda f: f.per_step is not None and f.grad_accum is None,
         lambda f: (f"{f.global_batch_size} is not a multiple of dp*micro_batch_size = {f.derived_dp}*"
                    f"{f.micro_batch_size} = {f.per_step}"),
         lambda f: (f"set train.global_batch_size to a multiple of {f.per_step} (e.g. "
                    f"{max(f.per_step, f.global_batch_size // f.per_step * f.per_step)}) or change "
                    "train.micro_batch_size"),
         SHAPE),
    Rule("parallelism.tp", lambda f: f.tp > f.gpus_per_node and f.world > 1,
         lambda f: (f"tp={f.tp} spans more than one node ({f.gpus_per_node} per node): tensor-parallel "
                    "collectives run every layer and need the intra-node link"),
         lambda f: f"use parallelism.tp<={f.gpus_per_node} and put the rest into parallelism.pp"),
    Rule("model.num_heads", lambda f: f.model.hidden_size % f.model.num_heads != 0,
         lambda f: f"hidden_size {f.model.hidden_size} is not divisible by num_heads {f.model.num_heads}",
         "pick num_heads dividing model.hidden_size"),
    Rule("model.num_heads", lambda f: f.model.num_heads % f.tp != 0,
         lambda f: f"{f.model.num_heads} heads cannot be split over tp={f.tp}", "make parallelism.tp divide model.num_heads"),
    Rule("model.ffn_hidden_size", lambda f: f.model.ffn_hidden_size % f.tp != 0,
         lambda f: f"{f.model.ffn_hidden_size} is not divisible by tp={f.tp}",
         "make parallelism.tp divide model.ffn_hidden_size"),
    Rule("model.vocab_size", lambda f: f.model.vocab_size % f.tp != 0,
         lambda f: f"{f.model.vocab_size} is not divisible by tp={f.tp}", "pad model.vocab_size to a multiple of parallelism.tp"),
    Rule("model.num_layers", lambda f: f.model.num_layers % f.pp != 0,
         lambda f: f"{f.model.num_layers} layers cannot be split evenly into pp={f.pp} stages",
         "make parallelism.pp divide model.num_layers"),
    Rule("zero.stage", lambda f: f.zero not in (0, 1, 2, 3),
         lambda f: f"must be 0, 1, 2 or 3, got {f.zero}", "choose zero=0..3"),
    Rule("zero.offload_optimizer", lambda f: (f.offload_optimizer or f.offload_params) and f.zero == 0,
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
    Rule("train.global_batch_size",
         lambda f: f.resolved_engine == "megatron" and f.pp > 1 and f.grad_accum is not None and f.grad_accum < f.pp,
         lambda f: (f"gives {f.grad_accum} micro-batch(es) per step but the 1F1B pipeline has pp={f.pp} stages "
                    "and needs at least one micro-batch per stage"),
         lambda f: (f"raise train.global_batch_size to >= {f.pp * (f.per_step or 1)} or lower "
                    "train.micro_batch_size")),
    Rule("parallelism.sequence_parallel",
         lambda f: f.resolved_engine == "megatron" and f.sequence_parallel and f.model.seq_len % f.tp != 0,
         lambda f: f"model.seq_len={f.model.seq_len} cannot be split over tp={f.tp}",
         "make parallelism.tp divide model.seq_len, or set parallelism.sequence_parallel=false"),
    Rule("model.dropout", lambda f: f.resolved_engine == "megatron" and f.model.dropout > 0 and f.tp > 1,
         ("dropout with tp > 1 would draw the same masks on every tensor-parallel rank "
          "(there is no per-rank RNG stream yet)"),
         "set model.dropout=0.0 for tensor-parallel runs"),
    Rule("zero.stage", lambda f: f.resolved_engine == "megatron" and f.zero > 1,
         lambda f: (f"ZeRO stage {f.zero} cannot be combined with tensor/pipeline parallelism here "
                    "(gradients and parameters are already split by tp/pp; stages 2-3 would re-shard "
                    "them every micro-batch of the pipeline)"),
         "use zero=1 (optimizer states sharded across data-parallel ranks) or zero=0"),
    Rule("zero.offload_optimizer",
         lambda f: f.resolved_engine == "megatron" and (f.offload_optimizer or f.offload_params),
         "offload needs the deepspeed engine",
         "turn offload off, or use tp=pp=1 with parallelism.engine=deepspeed"),
    Rule("parallelism.engine", lambda f: f.resolved_engine not in ("ddp", "deepspeed", "megatron"),
         lambda f: f"{f.engine!r} is not an engine", "choose auto, ddp, deepspeed or megatron"),
    # the rest of the run
    Rule("model.dropout", lambda f: not 0.0 <= f.model.dropout < 1.0,
         lambda f: f"must be in [0, 1), got {f.model.dropout}", "set model.dropout=0.0", RUN),
    Rule("optim.lr", lambda f: f.lr <= 0, lambda f: f"must be > 0, got {f.lr}", "set optim.lr to e.g. 3e-4", RUN),
    Rule("optim.warmup_steps", lambda f: f.warmup_steps < 0 or f.warmup_steps > f.steps,
         lambda f: f"{f.warmup_steps} is outside [0, train.steps={f.steps}]", "lower optim.warmup_steps", RUN),
    Rule("train.fail_rank", lambda f: f.fail_at_step is not None and not 0 <= f.fail_rank < f.world,
         lambda f: f"{f.fail_rank} is not a rank of a {f.world}-process job", lambda f: f"choose 0..{f.world - 1}",
         RUN),
)


def violations(f: Facts, kinds: Sequence[str] = (VALUE, SHAPE, LAYOUT, RUN)) -> List[ConfigError]:
    """The broken rules of ``kinds``, in table order. When a VALUE rule is broken nothing else is
    evaluated (sizes must be positive before anything divides by them)."""
    bad_values = [r for r in RULES if r.kind == VALUE and r.broken(f)]
    if bad_values:
        return [r.error(f) for r in bad_values if VALUE in kinds]
    return [r.error(f) for r in RULES if r.kind in kinds and r.kind != VALUE and r.broken(f)]


def ok(f: Facts, kinds: Sequence[str] = (VALUE, SHAPE, LAYOUT, RUN)) -> bool:
    """Whether ``f`` breaks none of the rules of ``kinds`` (and no VALUE rule): ``not violations(f,
    kinds)`` without formatting a message, for the planner's search over thousands of candidates."""
    for r in RULES:
        if (r.kind == VALUE or r.kind in kinds) and r.broken(f):
            return False
    return True


def check(cfg_or_facts: Any) -> List[ConfigError]:
    """Every rule a run config (or its Facts) must satisfy; returns the violations (empty = valid)."""
    f = cfg_or_facts if isinstance(cfg_or_facts, Facts) else Facts.from_cfg(cfg_or_facts)
    return violations(f)


def buildable(f: Facts) -> bool:
    """Whether the config names a whole layout (positive sizes, tp*pp dividing the world, the batch
    splitting evenly), even if other rules are broken."""
    return not violations(f, (VALUE, SHAPE))


def engine_for(cfg: Any) -> str:
    """The engine a config runs on: `parallelism.engine`, or for `auto` the one its layout needs."""
    return Facts.from_cfg(cfg).resolved_engine


# ---- the layout -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    """One way to run: degrees, ZeRO, batch split, engine, and the node shape ranks are placed on.

    rank = dp_idx * (pp * tp) + pp_idx * tp + tp_idx: tensor-parallel ranks adjacent (inside a node,
    where the per-layer collectives use the fast link), pipeline stages next, data parallelism
    outermost; the row-major order of ``init_device_mesh(device, (dp, pp, tp))``."""

    dp: int
    tp: int = 1
    pp: int = 1
    zero: int = 0
    micro_batch_size: int = 1
    grad_accum: int = 1
    sequence_parallel: bool = False
    engine: str = ""  # "" = implied by tp, pp and zero
    offload_optimizer: bool = False
    offload_params: bool = False
    procs_per_node: int = 0  # processes per node; 0 = the whole world on one node

    def __post_init__(self) -> None:
        if not self.engine:
            object.__setattr__(self, "engine", implied_engine(self.tp, self.pp, self.zero))
        if not self.procs_per_node:
            object.__setattr__(self, "procs_per_node", self.world_size)

    # sizes
    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def nodes(self) -> int:
        return max(1, self.world_size // self.procs_per_node)

    @property
    def global_batch_size(self) -> int:
        return self.dp * self.micro_batch_size * self.grad_accum

    @property
    def num_micro_batches(self) -> int:
        """Micro-batches each pipeline sees per step (= gradient accumulation steps)."""
        return self.grad_accum

    def with_(self, **changes: Any) -> "Layout":
        return replace(self, **changes)

    # placement
    def coords(self, rank: int) -> Coords:
        """(dp_idx, pp_idx, tp_idx) of ``rank``."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a world of dp*pp*tp = {self.dp}*{self.pp}*{self.tp}")
        return rank // (self.pp * self.tp), (rank // self.tp) % self.pp, rank % self.tp

    def rank_of(self, dp_idx: int, pp_idx: int, tp_idx: int) -> int:
        """Inverse of ``coords``."""
        if not (0 <= dp_idx < self.dp and 0 <= pp_idx < self.pp and 0 <= tp_idx < self.tp):
            raise ValueError(f"coordinates ({dp_idx}, {pp_idx}, {tp_idx}) outside mesh ({self.dp}, {self.pp}, {self.tp})")
        return dp_idx * self.pp * self.tp + pp_idx * self.tp + tp_idx

    def node_of(self, rank: int) -> int:
        """Node index of ``rank`` under block placement (Slurm's default: consecutive ranks per node)."""
        return rank // self.procs_per_node

    def groups(self) -> Dict[str, List[List[int]]]:
        """Every process group of the mesh, as lists of global ranks (each ordered by its axis index):
        ``tp``/``pp``/``dp`` (ranks differing only in that index), ``mp`` (all pp x tp ranks of one
        replica) and ``embedding`` (first and last stage of each pipeline; empty when pp == 1)."""
        dp, pp, tp, r = self.dp, self.pp, self.tp, self.rank_of
        out: Dict[str, List[List[int]]] = {
            "tp": [[r(d, p, t) for t in range(tp)] for d in range(dp) for p in range(pp)],
            "pp": [[r(d, p, t) for p in range(pp)] for d in range(dp) for t in range(tp)],
            "dp": [[r(d, p, t) for d in range(dp)] for p in range(pp) for t in range(tp)],
            "mp": [[r(d, p, t) for p in range(pp) for t in range(tp)] for d in range(dp)],
            "embedding": [],
        }
        if pp > 1:
            out["embedding"] = [[r(d, 0, t), r(d, pp - 1, t)] for d in range(dp) for t in range(tp)]
        return out

    def group_of(self, rank: int, axis: str) -> List[int]:
        """The ranks of ``rank``'s group along ``axis`` ([] if it has none)."""
        return next((g for g in self.groups()[axis] if rank in g), [])

    # archive
    def to_json(self) -> Dict[str, Any]:
        return {**asdict(self), "world_size": self.world_size, "nodes": self.nodes,
                "global_batch_size": self.global_batch_size}

    @classmethod
    def from_json(cls, d: Dict[str, Any]) -> "Layout":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    @classmethod
    def from_facts(cls, f: Facts) -> "Layout":
        """The layout of a buildable config (see ``buildable``), whether or not the other rules hold."""
        dp = f.derived_dp
        if dp is None or f.grad_accum is None:
            raise ConfigErrors(violations(f, (VALUE, SHAPE)))
        return cls(dp=dp, tp=f.tp, pp=f.pp, zero=f.zero, micro_batch_size=f.micro_batch_size,
                   grad_accum=f.grad_accum, sequence_parallel=f.sequence_parallel, engine=f.resolved_engine,
                   offload_optimizer=f.offload_optimizer, offload_params=f.offload_params,
                   procs_per_node=f.gpus_per_node)


def resolve(cfg: Any) -> Layout:
    """The layout a valid config describes. Raises ConfigErrors listing every broken rule."""
    f = Facts.from_cfg(cfg)
    errs = violations(f)
    if errs:
        raise ConfigErrors(errs)
    return Layout.from_facts(f)
