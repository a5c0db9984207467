"""The recipe contract: what a recipe tells the launcher about itself, found by module path.

A recipe ``pkg.mod.main`` may ship ``pkg/contract.py`` defining ``RECIPE = RecipeSpec(...)``. Every part
is optional; a recipe without a contract gets only what every recipe shares (the layout of its processes,
the cluster, submission, the bounds of the schema's keys) and is held to nothing of another recipe's:

- ``schema``: its run config schema, a dataclass extending ``launcher.config.schema.RunConfig`` with the
  recipe's own groups (composed only when the recipe is picked: its option's defaults list names
  ``/recipe_schema/<option>`` and the groups); their keys are typed, bounded and known as the
  launcher's own are;
- ``facts``: run config -> what ``launcher.config.layout.Facts.model`` holds for its rules and planner, with
  ``sizes``: the keys of its schema read from there (``model.x``: ``Facts.model.x``), whose bound rows
  are checked before any rule divides by them;
- ``rules``: extra rows of the rule table (``launcher.config.rules.Rule``), pure predicates over ``Facts``;
- ``check``: a pure check of the recipe's own settings (``recipe.params``): raises ValueError;
- ``planner``: run config -> ``CheckResult`` (errors, warnings, plan.json), run by `launch` on every
  point; ``plan_command`` and ``calibrate_command``: what `launcher plan` and `launcher plan
  --calibrate RUN...` run for the recipe (a recipe without them: "has no planner"); ``calibration``:
  the planner's calibration of a run (the report's before/after table); ``fits``: whether a shape of
  its model fits the GPU memory (preflight's rungs cut ``model.num_layers`` to what fits);
- ``run_files``: the files the recipe writes into its run dir (``RunFile``);
- ``report``: the recipe's section of ``launcher report`` (run dir -> ``ReportSection`` or None);
- ``results``: run dir -> what the run measured, as its results file holds it (preflight's rungs);
- ``link_check``: the recipe measures the link between nodes (``LinkCheck``): preflight's comm rung
  runs the recipe option whose contract has one;
- ``metrics``: the keys of its metrics rows (sweep=asha's objective is checked against them);
- ``steps_key``: the config key progress counts steps against (None: the recipe counts no steps);
- ``named_by_model``: its runs are named after ``model.name`` (else after the contract's ``name`` or
  the recipe's package).

A contract module must be light: the login side imports it (never torch or deepspeed). Found by its
spec first, so a recipe without one imports nothing at all.
"""
from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import os
import sys
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

CONTRACT_MODULE = "contract"  # the module of a recipe's package that holds its RECIPE


@dataclass(frozen=True)
class RunFile:
    """A file (or dir, ending in /) a recipe writes into its run dir: docs/archive.md's table row."""

    name: str
    writer: str
    description: str


@dataclass(frozen=True)
class ReportSection:
    """A recipe's part of the run page: its title, its HTML and whether it replaces the metrics section."""

    title: str
    html: str
    replaces_metrics: bool = True


@dataclass(frozen=True)
class RecipeSpec:
    name: str = ""  # the run name when the config gives none ("": the recipe's package)
    named_by_model: bool = False
    schema: Optional[type] = None  # a subclass of launcher.config.schema.RunConfig with the recipe's groups
    facts: Optional[Callable[[Any], Any]] = None  # run config -> Facts.model
    sizes: Tuple[str, ...] = ()  # keys of ``schema`` whose bound rows read Facts (VALUE rows)
    rules: Tuple[Any, ...] = ()  # launcher.config.rules.Rule rows
    check: Optional[Callable[[Any], Any]] = None  # resolved config (plain dicts) -> raises ValueError
    check_doc: str = ""  # where the checked settings are described (the fix line names it)
    # (run config, the Layout the rules built from it) -> CheckResult: the planner estimates the layout the
    # rules checked, never one of its own
    planner: Optional[Callable[[Any, Any], Any]] = None
    plan_command: Optional[Callable[[Any, Any], int]] = None  # (run config, `launcher plan`'s args) -> exit code
    calibrate_command: Optional[Callable[[List[Path], Any], int]] = None  # (run dirs, args) -> exit code
    # (run dir, its layout, its overrides.yaml) -> the planner's calibration of the run (`launcher report`)
    calibration: Optional[Callable[[Path, Dict[str, Any], Dict[str, Any]], Optional[Dict[str, Any]]]] = None
    # (run config, num_layers, Layout, recompute, dtype) -> whether the planner says it fits the GPU memory
    # (preflight shrinks a model to the layers that fit a rung's GPUs); None: never shrunk
    fits: Optional[Callable[..., bool]] = None
    run_files: Tuple[RunFile, ...] = ()
    report: Optional[Callable[[Path], Optional[ReportSection]]] = None
    results: Optional[Callable[[Path], Any]] = None  # run dir -> what the run measured (its results file)
    steps_key: Optional[str] = None
    # the keys of its metrics rows (fnmatch patterns: ``time_*_s``); sweep=asha's sweep.objective must be
    # one (empty: not declared, any key is taken)
    metrics: Tuple[str, ...] = ()
    link_check: Optional[LinkCheck] = None


@dataclass(frozen=True)
class LinkCheck:
    """What preflight's comm rung needs of a recipe that measures the link between two nodes."""

    overrides: Callable[[bool], Tuple[str, ...]]  # use_gpus -> its settings for a short rung (CPU: small)
    inter_busbw: Callable[[Any], Optional[float]]  # its results -> best inter-node all-reduce bus bandwidth, GB/s


NO_CONTRACT = RecipeSpec()


@dataclass
class CheckResult:
    """What a recipe's planner says of a run config: errors (``launcher.config.errors.ConfigError``: they stop
    the launch), warnings (they stop it unless submit.force=true) and the plan archived as plan.json."""

    errors: List[Any] = field(default_factory=list)
    warnings: List[str] = field(default_factory=list)
    plan: Optional[Dict[str, Any]] = None  # the planner's estimate, archived as <run_dir>/plan.json


class ContractError(ValueError):
    """A recipe's contract module exists but cannot be loaded, or holds no RecipeSpec."""


def of(target: Any, strict: bool = True) -> RecipeSpec:
    """The contract of ``recipe._target_`` (``pkg.mod.fn``): ``RECIPE`` of ``pkg.contract``, or
    NO_CONTRACT when the recipe ships none (or the target is not a dotted path). ContractError when
    its contract module cannot be loaded (``strict=False``: NO_CONTRACT, for what only shows a run)."""
    if not isinstance(target, str):
        return NO_CONTRACT
    try:
        return _of(target, os.getcwd())
    except ContractError:
        if strict:
            raise
        return NO_CONTRACT


@lru_cache(maxsize=64)
def _of(target: str, cwd: str) -> RecipeSpec:
    name = contract_module(target)
    if name is None or not _exists(name, cwd):
        return NO_CONTRACT
    try:
        module = _import(name, cwd)
    except Exception as e:  # the recipe's own code: whatever it raises is the user's to see
        raise ContractError(f"its contract {name} cannot be loaded: {type(e).__name__}: {e}") from e
    spec = getattr(module, "RECIPE", None)
    if not isinstance(spec, RecipeSpec):
        raise ContractError(f"its contract {name} defines no RECIPE = launcher.config.recipe_contract.RecipeSpec(...)")
    return spec


def _import(name: str, cwd: str) -> Any:
    """Import the contract module, from the working dir first (as ``_exists`` found it: `launch` run in
    a project whose recipe package is not on sys.path)."""
    if importlib.machinery.PathFinder.find_spec(name.split(".")[0], [cwd]) is None or cwd in sys.path:
        return importlib.import_module(name)
    sys.path.insert(0, cwd)
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(cwd)


def contract_module(target: str) -> Optional[str]:
    """``pkg.sub.mod.fn`` -> ``pkg.sub.contract``; None for a function of a top-level module."""
    parts = target.split(".")
    if len(parts) < 3 or not all(p.isidentifier() for p in parts):
        return None
    return ".".join(parts[:-2] + [CONTRACT_MODULE])


def _exists(module: str, cwd: str) -> bool:
    """Whether ``module`` can be found, without importing it or its parent packages."""
    parts = module.split(".")
    spec = importlib.machinery.PathFinder.find_spec(parts[0], [cwd])
    if spec is None:
        try:
            spec = importlib.util.find_spec(parts[0])  # a top-level name: finding it imports nothing
        except (ImportError, ValueError):
            return False
    for n in range(1, len(parts)):
        if spec is None or not spec.submodule_search_locations:
            return False
        spec = importlib.machinery.PathFinder.find_spec(".".join(parts[:n + 1]), list(spec.submodule_search_locations))
    return spec is not None


def default_name(target: Any) -> str:
    """A run's name from its recipe alone: the package holding the recipe's module (``mlp.train.main``
    -> ``mlp``), or the module (``train.main`` -> ``train``)."""
    parts = str(target or "").split(".")
    return parts[-3] if len(parts) >= 3 else (parts[0] or "run")


def run_name(target: Any, model_name: Any = "") -> str:
    """The run's name where the config sets none (``name`` defaults to this): the contract's."""
    spec = of(target, strict=False)  # a broken contract: the rules name it, the name need not fail first
    if spec.named_by_model and model_name:
        return str(model_name)
    return spec.name or default_name(target)


def steps(target: Any, values: Callable[[str], Any]) -> Optional[int]:
    """The steps a run counts to (``values``: a dotted key's value), or None when its recipe counts none."""
    key = of(target, strict=False).steps_key
    v = values(key) if key else None
    return int(v) if isinstance(v, int) and not isinstance(v, bool) else None


def tree_get(tree: Any, key: str) -> Any:
    """The value at a dotted key of a resolved config (plain dicts), or None."""
    node = tree
    for part in key.split("."):
        if not isinstance(node, dict):
            return None
        node = node.get(part)
    return node
