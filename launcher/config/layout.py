"""Layout: how a run's processes divide the work, and the facts a config's rules are checked on.

- ``Facts``: the config values the rules (launcher.config.rules) look at, flat (from a composed config, or
  from the planner for a candidate layout). Built once per config; ``Facts.values`` is every value of
  the config by its dotted key, read lazily (only the RUN rules ask; the planner's search never does).
- ``Layout`` (as torchtitan's ParallelDims): engine, dp/tp/pp, ZeRO, micro batch and gradient
  accumulation, and where every rank sits (dp x pp x tp mesh, block placement on nodes). The login
  side archives it in run.json; the node, the engines and the planner read that same object.
  ``launcher.config.rules.resolve`` builds it from a valid config.

Pure (no torch), and imports no backend: the node reads it from the archive.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

from launcher.config import recipe_contract, schema
from launcher.config.schema import enum_value
from launcher.config.values import NO_VALUES, Values

if TYPE_CHECKING:
    from launcher.config.schema import RunConfig

AXES = ("dp", "pp", "tp")
Coords = Tuple[int, int, int]


def implied_engine(tp: int, pp: int, zero: int) -> str:
    """The engine ``parallelism.engine=auto`` picks: megatron for tp or pp > 1, deepspeed for ZeRO > 0,
    else ddp."""
    if tp > 1 or pp > 1:
        return "megatron"
    return "deepspeed" if zero > 0 else "ddp"


# ---- facts ----------------------------------------------------------------------------------------


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
    # what the recipe's rules and planner read of its model (its contract's ``facts``); None without one
    model: Any = None
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
    # every value of the run config (RUN rules); empty for a candidate layout of the planner
    values: Values = field(default=NO_VALUES, compare=False, hash=False, repr=False)

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

    def with_(self, **changes: Any) -> Facts:
        """A copy with some values changed (derived values are computed afresh)."""
        return Facts(**{**{k: v for k, v in vars(self).items() if k in _FACT_FIELDS}, **changes})

    @classmethod
    def from_cfg(cls, cfg: RunConfig, resolved: Optional[Dict[str, Any]] = None) -> Facts:
        """``resolved``: the config already resolved to plain dicts (enums as strings), when the caller
        has it, so the RUN rules do not resolve it again."""
        par, tr, cl, z = cfg.parallelism, cfg.train, cfg.cluster, cfg.zero
        own = recipe_contract.of(_target(cfg), strict=False).facts  # (a broken contract: the rules say so)
        optim = cfg.get("optim") if hasattr(cfg, "get") else getattr(cfg, "optim", None)
        opt = lambda name, default: default if optim is None else getattr(optim, name)  # noqa: E731
        return cls(
            nodes=cl.nodes, gpus_per_node=cl.gpus_per_node, tp=par.tp, pp=par.pp,
            micro_batch_size=tr.micro_batch_size, global_batch_size=tr.global_batch_size,
            model=own(cfg) if own else None, dp=par.dp, engine=enum_value(par.engine), zero=z.stage,
            offload_optimizer=bool(z.offload_optimizer), offload_params=bool(z.offload_params),
            sequence_parallel=bool(par.sequence_parallel), dtype=enum_value(cfg.precision.dtype),
            steps=tr.steps, lr=float(opt("lr", 1e-3)),
            warmup_steps=int(opt("warmup_steps", 0) or 0), fail_at_step=tr.fail_at_step, fail_rank=tr.fail_rank,
            backend=enum_value(cl.backend), values=Values(cfg if resolved is None else resolved),
        )


def _target(cfg: RunConfig) -> Any:
    """The config's recipe._target_; unset (or a typed config's MISSING): the default recipe's."""
    try:
        recipe = cfg.get("recipe") if hasattr(cfg, "get") else getattr(cfg, "recipe", None)
        t = None if recipe is None else (recipe.get("_target_") if hasattr(recipe, "get")
                                         else getattr(recipe, "_target_", None))
    except Exception:  # omegaconf's MissingMandatoryValue (a schema default no option set)
        t = None
    return t if isinstance(t, str) and t not in ("", "???") else schema.default_target()


_FACT_FIELDS = frozenset(f.name for f in fields(Facts))

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

    def with_(self, **changes: Any) -> Layout:
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
            raise ValueError(f"coordinates ({dp_idx}, {pp_idx}, {tp_idx}) "
                             f"outside mesh ({self.dp}, {self.pp}, {self.tp})")
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
        # (its fields are plain values: read, not deep-copied as asdict does, ~25 us a point of a launch)
        return {**{name: getattr(self, name) for name in _LAYOUT_FIELDS}, "world_size": self.world_size,
                "nodes": self.nodes, "global_batch_size": self.global_batch_size}

    @classmethod
    def from_json(cls, d: Dict[str, Any]) -> Layout:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


_LAYOUT_FIELDS = tuple(f.name for f in fields(Layout))

# the layout keys whose change moves training state between ranks: a new attempt that changes one loads
# the checkpoint's layout-independent state (launcher.submit.reshard, launcher.training.universal)
RESHARD_KEYS = ("engine", "dp", "tp", "pp", "zero")
# the DeepSpeed ZeRO stages whose checkpoints hold the layout-independent state (offloaded or not; ZeRO-0
# too in fp32: launcher.submit.reshard.engine_problem)
RESHARD_DEEPSPEED_STAGES = (1, 2, 3)
# where a checkpoint keeps it: a dir of torch.distributed.checkpoint files and their global index
UNIVERSAL_DIR, UNIVERSAL_INDEX = "universal", ".metadata"
# or, where the engine's own files hold every tensor of it whole, what names them there (one per rank
# that writes such files: launcher.training.universal_links); universal/ is written from them when needed
UNIVERSAL_LINKS = "universal.links.{rank}.json"


def universal_links_of(ckpt: Path) -> List[Path]:
    """The links files of the checkpoint dir ``ckpt`` (none: its universal form is written, or absent)."""
    return sorted(ckpt.glob(UNIVERSAL_LINKS.format(rank="*")))


def has_universal(ckpt: Path) -> bool:
    """Whether the checkpoint dir ``ckpt`` holds the layout-independent state, written or linked."""
    return (ckpt / UNIVERSAL_DIR / UNIVERSAL_INDEX).is_file() or bool(universal_links_of(ckpt))


def moved(saved: Optional[Dict[str, Any]], now: Dict[str, Any]) -> Dict[str, List[Any]]:
    """key -> [saved, now] of the RESHARD_KEYS that differ between two layouts' to_json (pure); {}
    for the same layout, or for a saved layout not recorded (a checkpoint written before layouts were)."""
    if not saved:
        return {}
    return {k: [saved.get(k), now.get(k)] for k in RESHARD_KEYS if k in saved and saved.get(k) != now.get(k)}

