"""Structured config schema: every key, its type and its default, defined once, and the queries over it.

The keys are declared as dataclasses in launcher.config.sections (their bounds with launcher.config.bounds'
``num``); every name of both is re-exported here, where the rest of the launcher imports them.
Hydra validates the composed config against these dataclasses, so a wrong type (or an unknown
key given without '+') fails at composition time with Hydra's own message naming the key. Keys added
with '+' pass Hydra (it opens the struct flag for them); launcher.config.rules refuses every key not
declared here.

Bounds are declared once per numeric key: ``num(default, ge=.., gt=.., le=.., lt=..)``
puts them in the field's metadata; ``leaves()`` lists every key with its type and bounds, and
launcher.config.rules generates one rule row per bounded key from it (floats must also be finite). A new
numeric key is checked by declaring its bounds.
Here: the keys as leaves (``leaves``, ``groups``), a recipe's run schema (``run_schema``, ``own_config``,
``schema_for``), registering with Hydra (``register_configs``), typing a plain config (``typed``), the
values derived from keys (``warmup_steps``, ``pack_nodes``, ``hang_timeout_s``) and the resolvers the
config's interpolations name.
Nothing here imports torch: the login-node path loads this module.
"""
from __future__ import annotations

import dataclasses
import os
import typing
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Tuple

from omegaconf import OmegaConf

from launcher.config.bounds import INT64_MAX, Bounds, num, show_number
from launcher.config.sections import (
    BlendSource,
    CalibrationConfig,
    CheckpointConfig,
    ClusterConfig,
    DataConfig,
    Dtype,
    ElasticConfig,
    Engine,
    FailMode,
    FailPeers,
    FaultConfig,
    GPUConfig,
    HealthConfig,
    OptimConfig,
    ParallelConfig,
    PrecisionConfig,
    RecipeConfig,
    Recompute,
    ReduceDtype,
    RunConfig,
    SubmitConfig,
    SweepConfig,
    SweepMode,
    SweepScheduler,
    TrainConfig,
    WandbConfig,
    WandbMode,
    ZeroConfig,
)

# the config groups (conf/): the composed defaults, every option of every group
CONF_DIR = Path(os.environ.get("LAUNCHER_CONF_DIR") or Path(__file__).resolve().parents[2] / "conf")
CONFIG_NAME = "config"  # the primary config, <CONF_DIR>/config.yaml: the defaults list

# what the launcher's other modules import from here (the sections and bounds re-exported with this module's own)
__all__ = [
    # launcher.config.bounds
    "INT64_MAX", "Bounds", "num", "show_number",
    # launcher.config.sections
    "BlendSource", "CalibrationConfig", "CheckpointConfig", "ClusterConfig", "DataConfig", "Dtype", "ElasticConfig",
    "Engine", "FailMode", "FailPeers", "FaultConfig", "GPUConfig", "HealthConfig", "OptimConfig", "ParallelConfig",
    "PrecisionConfig", "RecipeConfig", "Recompute", "ReduceDtype", "RunConfig", "SubmitConfig", "SweepConfig",
    "SweepMode", "SweepScheduler", "TrainConfig", "WandbConfig", "WandbMode", "ZeroConfig",
    # this module
    "CONF_DIR", "CONFIG_NAME", "DEFAULT_WARMUP_STEPS", "Leaf", "MULTI_NODE_HANG_TIMEOUT_S", "PACK_NODES_DEFAULT",
    "default_target", "enum_value", "foreign_groups", "groups", "groups_of", "hang_timeout_s", "leaves", "leaves_of",
    "override_groups", "own_config", "pack_nodes", "recipe_options", "register_configs", "run_schema", "schema_for",
    "typed", "warmup_steps",
]


_RUN_FIELDS = frozenset(f.name for f in dataclasses.fields(RunConfig))


@dataclass(frozen=True)
class Leaf:
    """One key of the schema: its dotted name, its type (int, float, bool, str, an Enum class, list or
    dict), whether it may be null, and its declared bounds (numbers)."""

    key: str
    type: Any
    optional: bool = False
    bounds: Optional[Bounds] = None
    item: Any = None  # the element / value type of a list or dict key


def _leaf_type(t: Any) -> Tuple[Any, bool, Any]:
    """(base type, optional, item type) of a field annotation."""
    optional = False
    if typing.get_origin(t) is typing.Union:
        args = [a for a in typing.get_args(t) if a is not type(None)]
        optional, t = len(args) < len(typing.get_args(t)), args[0]
    origin = typing.get_origin(t)
    if origin in (list, List):
        return list, optional, typing.get_args(t)[0]
    if origin in (dict, Dict):
        return dict, optional, typing.get_args(t)[1]
    return t, optional, None


def _walk(cls: Any, prefix: str) -> typing.Iterator[Leaf]:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = prefix + f.name
        t, optional, item = _leaf_type(hints[f.name])
        if dataclasses.is_dataclass(t):
            yield from _walk(t, key + ".")
        else:
            yield Leaf(key, t, optional, f.metadata.get("bounds"), item)


def run_schema(target: Any = None) -> type:
    """The schema of a run of the recipe ``target``: its contract's (``RecipeSpec.schema``, RunConfig
    with the recipe's own groups), else RunConfig. None: RunConfig (the keys every recipe shares);
    "" or a typed config's MISSING: the default recipe's."""
    from launcher.config import recipe_contract  # found by the recipe's module path; imports no recipe code

    if not isinstance(target, str):
        return RunConfig
    if target in ("", "???"):  # unset (a typed config's MISSING): the default recipe's
        target = default_target()
    own = recipe_contract.of(target, strict=False).schema if target else None
    return own or RunConfig


def leaves(target: Any = None) -> Tuple[Leaf, ...]:
    """Every key of the run schema of the recipe ``target`` (None: the shared RunConfig; groups walked
    into), in declaration order."""
    return leaves_of(run_schema(target))


@lru_cache(maxsize=16)
def leaves_of(cls: type) -> Tuple[Leaf, ...]:
    """Every key of the schema dataclass ``cls``."""
    return tuple(_walk(cls, ""))


def groups(target: Any = None) -> frozenset:
    """The keys that are config groups (cluster, cluster.gpu, ...): nodes with fixed keys."""
    return _groups(run_schema(target))


def groups_of(cls: type) -> frozenset:
    """The keys of the schema dataclass ``cls`` that are config groups."""
    return _groups(cls)


@lru_cache(maxsize=16)
def _groups(cls: type) -> frozenset:
    return frozenset(".".join(leaf.key.split(".")[:i]) for leaf in leaves_of(cls)
                     for i in range(1, leaf.key.count(".") + 1))


def recipe_options() -> Dict[str, str]:
    """The options of the recipe group (CONF_DIR/recipe/*.yaml) -> the recipe each runs (its _target_)."""
    from launcher.archive import yamlio  # the options as written (Hydra is not needed to read one key)

    out: Dict[str, str] = {}
    for path in sorted((CONF_DIR / "recipe").glob("*.yaml")):
        option = yamlio.safe_load(path.read_text()) or {}
        target = option.get("_target_") or (option.get("recipe") or {}).get("_target_")
        if isinstance(target, str):
            out[path.stem] = target
    return out


@lru_cache(maxsize=1)
def default_target() -> str:
    """The recipe a config runs when it names none (the recipe option conf/config.yaml composes): the
    one whose rows judge Facts without a config (the planner's candidates)."""
    from launcher.archive import yamlio

    defaults = yamlio.safe_load((CONF_DIR / f"{CONFIG_NAME}.yaml").read_text()).get("defaults") or []
    choice = next((d["recipe"] for d in defaults if isinstance(d, dict) and "recipe" in d), None)
    return recipe_options().get(str(choice), "") if choice is not None else ""


def _own_groups(cls: type) -> frozenset:
    return frozenset(f.name for f in dataclasses.fields(cls)) - _RUN_FIELDS


@lru_cache(maxsize=4)
def _recipe_groups(conf_dir: Path) -> frozenset:
    """Every group some recipe option's schema adds to RunConfig."""
    return frozenset().union(*(_own_groups(run_schema(t)) for t in recipe_options().values()))


def foreign_groups(target: Any) -> frozenset:
    """The groups other recipes' schemas add that a run of the recipe ``target`` does not have."""
    return _recipe_groups(CONF_DIR) - _own_groups(run_schema(target))


def own_config(tree: Dict[str, Any], overrides: Iterable[str] = ()) -> Dict[str, Any]:
    """A composed config (plain dicts) without the groups of another recipe's schema: a run whose
    ``recipe._target_`` is overridden away from the recipe option that composed them has no use for
    them (a user's recipe picked on top of the default option gets no ``model`` section). A group the
    run's ``overrides`` name (``model=...``, ``model.dropout=0.1``: a recipe of the user's built on
    another recipe's model) is kept, never silently dropped, and typed by the schema that declares it
    (``schema_for``)."""
    recipe = tree.get("recipe") if isinstance(tree, dict) else None
    drop = foreign_groups(recipe.get("_target_") if isinstance(recipe, dict) else None) - override_groups(overrides)
    return {k: v for k, v in tree.items() if k not in drop} if drop & set(tree) else tree


def override_groups(overrides: Iterable[str]) -> frozenset:
    """The top-level keys Hydra overrides name (``model=x``, ``+model.a=1``, ``~model``, ``model@p=x``)."""
    out = set()
    for o in overrides:
        key = str(o).lstrip("+~").split("=", 1)[0]
        out.add(key.split(".", 1)[0].split("@", 1)[0].split("/", 1)[0])
    return frozenset(out)


def schema_for(target: Any, keys: Iterable[str] = ()) -> type:
    """The schema typing a config of the recipe ``target`` holding these top-level ``keys``: the
    recipe's (``run_schema``), or, where the config holds groups another recipe's schema declares (kept
    because the user asked for them: ``own_config``), that recipe option's schema when it extends the
    recipe's own."""
    own = run_schema(target)
    extra = (frozenset(keys) & _recipe_groups(CONF_DIR)) - _own_groups(own)
    if not extra:
        return own
    for option_target in recipe_options().values():
        candidate = run_schema(option_target)
        if issubclass(candidate, own) and extra <= _own_groups(candidate):
            return candidate
    return own


def register_configs() -> None:
    """Register the schema with Hydra's ConfigStore (config.yaml lists it first)."""
    from hydra.core.config_store import ConfigStore  # Hydra only to register: the node reads the schema without

    cs = ConfigStore.instance()
    cs.store(name="base_config", node=RunConfig)
    # a recipe option's own schema (RunConfig and its groups), which its YAML's defaults list names:
    # `- /recipe_schema/<option>` (conf/recipe/<option>.yaml)
    for option, target in recipe_options().items():
        own = run_schema(target)
        if own is not RunConfig:
            cs.store(group="recipe_schema", name=option, node=own, package="_global_")
    cs.store(
        group="hydra/launcher",
        name="launcher",
        node={"_target_": "hydra_plugins.launcher_plugin.plugin.LauncherPlugin"},
    )


def typed(cfg: Dict[str, Any]) -> RunConfig:
    """Merge a plain (e.g. loaded from YAML) config onto the schema of its recipe (``run_schema``) so
    types are enforced."""
    if OmegaConf.is_config(cfg):
        cfg = OmegaConf.to_container(cfg, resolve=False)
    target = (cfg.get("recipe") or {}).get("_target_") if isinstance(cfg, dict) else None
    # an archived config holds what its launch kept (own_config): every group of it is typed, none dropped
    base = OmegaConf.structured(schema_for(target, cfg.keys() if isinstance(cfg, dict) else ()))
    return OmegaConf.merge(base, cfg)


DEFAULT_WARMUP_STEPS = 5


def warmup_steps(cfg: RunConfig) -> int:
    """The warm-up a run uses: optim.warmup_steps, or when null the default, at most train.steps."""
    explicit = cfg.optim.warmup_steps
    return int(explicit) if explicit is not None else min(DEFAULT_WARMUP_STEPS, int(cfg.train.steps))


PACK_NODES_DEFAULT = 8  # cluster.pack_nodes=null: at most this many nodes, fewer when the points need fewer


def pack_nodes(cluster: Any, points: int) -> int:
    """The nodes of a pack of ``points`` points (cluster.pack_nodes, or as many as the points could use
    at once, at most PACK_NODES_DEFAULT and never fewer than one point needs)."""
    given = cluster.get("pack_nodes")
    if given:
        return int(given)
    per_point = int(cluster.get("nodes") or 1)
    return max(per_point, min(points * per_point, PACK_NODES_DEFAULT))


# the hang watch on several nodes when train.hang_timeout_s is null: half the collective timeout, at most this
MULTI_NODE_HANG_TIMEOUT_S = 300


def hang_timeout_s(train: Any, nodes: int) -> int:
    """train.hang_timeout_s as the ranks use it (0: off): a value given is kept (0 turns the watch off);
    null is off on one node and, on several nodes (where a lost peer often blocks the others without
    an error), half of train.dist_timeout_s up to MULTI_NODE_HANG_TIMEOUT_S, so that it fires first."""
    value = train.get("hang_timeout_s")
    if value is not None:
        return int(value)
    if int(nodes) <= 1:
        return 0
    return max(1, min(MULTI_NODE_HANG_TIMEOUT_S, int(train.get("dist_timeout_s") or 600) // 2))


def startup_timeout_s(train: Any, nodes: int, script: bool = False) -> int:
    """train.startup_timeout_s as the ranks use it (0: off): a value given is kept; null is off on one
    node and for a script (whose start the launcher does not see), and train.dist_timeout_s on several
    nodes (a rank stuck in NCCL's init or outside any collective would otherwise wait for ever; one
    waiting in a collective ends at that timeout anyway)."""
    value = train.get("startup_timeout_s")
    if value is not None:
        return int(value)
    return 0 if int(nodes) <= 1 or script else int(train.get("dist_timeout_s") or 600)


def _recipe_run_name(target: Any, model_name: Any = "") -> str:
    from launcher.config import recipe_contract  # the contract of the recipe, found by its module path

    return recipe_contract.run_name(target, model_name)


OmegaConf.register_new_resolver("recipe_run_name", _recipe_run_name, replace=True)


def _host_gpus_or(without_gpus: Any = 2, global_batch: Any = None, micro_batch: Any = None) -> int:
    from launcher import host  # the local backend's view of this host (LAUNCHER_HOST_GPUS fixes it)

    return host.default_processes(int(without_gpus), global_batch, micro_batch)


def _data_vocab_or(default: Any, multiple: Any = 1, *, _root_: Any) -> int:
    from launcher.data import checks  # a data=tokens run's vocabulary, from its datasets' manifests

    return checks.vocab_or(default, multiple, _root_=_root_)


# a model option's vocab_size: the dataset's (data=tokens) unless the user sets one
OmegaConf.register_new_resolver("data_vocab_or", _data_vocab_or, replace=True)


# conf/cluster/local.yaml's default process count: this host's GPUs (as many as the batch splits over),
# or N processes where it has none
OmegaConf.register_new_resolver("host_gpus_or", _host_gpus_or, replace=True)


def enum_value(x: Any) -> str:
    """An Enum member or a plain string -> the string (configs loaded untyped hold strings)."""
    return str(getattr(x, "value", x))
