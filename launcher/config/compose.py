"""Fast composition of sweep points, for any Hydra app.

Hydra composes every point from scratch (defaults tree, every YAML file merged onto the schema:
~0.05-0.2 s a point), and a sweep composes each point twice (the sweeper's validate_batch_is_legal,
then the launcher). SweepComposer stands in for the config loader's load_sweep_config: every
distinct combination of config-group choices (and hydra.* overrides) is composed by Hydra once; a
point is a copy of it with the point's value overrides applied by Hydra's own override code
(ConfigLoaderImpl._apply_overrides_to_config: OmegaConf.update/merge with Hydra's +/++/~ rules) and
the hydra node's per-point fields (overrides, override_dirname) set as Hydra sets them. A point
composed for the sweeper's check is kept for the launcher (`take`), so each point is composed once.
tests/unit/test_compose_fast.py compares the result with Hydra's own.

Nothing here knows the project's configs: `launch -m` and the launcher for any Hydra app
(hydra_plugins/launcher_plugin/generic.py) both use it. Importing it changes nothing in Hydra.
"""
from __future__ import annotations

import contextlib
import math
import pickle
import re
import sys
import time
from enum import Enum
from typing import List, Optional

from hydra._internal.config_loader_impl import ConfigLoaderImpl, get_overrides_dirname
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override, OverrideType, ValueType
from hydra.errors import ConfigCompositionException
from hydra.types import RunMode
from omegaconf import OmegaConf, ValueNode, open_dict, read_write
from omegaconf.errors import OmegaConfBaseException


def grid_points(overrides: List[str]) -> Optional[int]:
    """How many points the basic sweeper's grid of these overrides holds, counted from the grammar (a comma
    list, choice, range) without composing one; None where a sweep's size is not the grammar's (interval:
    a sweeper's search space; glob: the options on the search path) or the overrides do not parse."""
    from hydra.core.override_parser.types import ChoiceSweep, RangeSweep

    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except Exception:  # noqa: BLE001 - Hydra itself reports a bad override, with its own message
        return None
    n = 1
    for o in parsed:
        if not o.is_sweep_override() or o.is_hydra_override():
            continue
        v = o.value()
        if isinstance(v, ChoiceSweep):
            n *= len(v.list)
        elif isinstance(v, RangeSweep) and v.step:
            n *= max(0, math.ceil(round((v.stop - v.start) / v.step, 9)))
        else:
            return None
    return n


def override_lines(overrides) -> list:
    """Hydra's ``overrides.task`` (or ``overrides.hydra``) as typed: an override's text is not resolved
    (``name='x${nope}'`` is the config's interpolation to resolve, and to refuse naming its key, not
    the list's; iterating the ListConfig would resolve, and fail on, every line)."""
    return [str(line) for line in OmegaConf.to_container(overrides, resolve=False)]


def override_key(line: str) -> str:
    """The key an override line sets (``+key=v``, ``++key=v``, ``~key``: ``key``), without parsing it."""
    return str(line).split("=", 1)[0].lstrip("+~")


class SweepComposer:
    PROGRESS_AFTER_S = 1.0

    def __init__(self, config_loader) -> None:
        self.loader = config_loader
        self.original = config_loader.load_sweep_config
        self.bases = {}  # (config name, base override lines) -> composed config, pickled (a point unpickles it)
        self.kept = {}  # point overrides -> config composed for the sweeper's check, for the launcher
        self.expected = None  # points of the coming batch (the progress bar's total), when known
        self.composed = 0  # points composed (a statistic for tests and benchmarks)
        self.parsed = {}  # override text -> Hydra's parsed Override
        self.fast = {}  # base key -> FastBase
        self._hydra_lines = {}  # id(master config) -> its hydra override lines
        self._constant = {}  # id(master config) -> its command line's overrides that sweep nothing
        self._groups = {}  # key -> whether it names a config group
        self._burst = None  # [start time, count, rich Progress or None, task]
        self.allow_fast = True  # points on the fast path are FastPoints (see ``point``)

    @classmethod
    def install(cls, config_loader, fast: bool = True) -> SweepComposer:
        """Make ``config_loader.load_sweep_config`` this composer's (once per loader). ``fast=False``:
        every point is a composed config (a launcher that hands the config itself to the app's task
        function needs one), never a FastPoint."""
        found = getattr(config_loader, "_launcher_composer", None)
        if found is not None:
            found.allow_fast = fast  # what this caller can take (a config, or also a FastPoint)
            return found
        composer = cls(config_loader)
        composer.allow_fast = fast
        composer._attach()
        return composer

    def _attach(self) -> None:
        self.loader.load_sweep_config = self.load_sweep_config
        self.loader._launcher_composer = self

    @contextlib.contextmanager
    def removed(self):
        """Hydra's own load_sweep_config while the block runs: Hydra's state, pickled for the nodes,
        then holds neither this composer nor its composed configs."""
        self.kept.clear()
        for name in ("load_sweep_config", "_launcher_composer"):
            self.loader.__dict__.pop(name, None)
        try:
            yield
        finally:
            self._attach()

    def load_sweep_config(self, master_config, sweep_overrides):
        """What Hydra's load_sweep_config returns; kept for the launcher's `take`. A point on the fast
        path (see ``point``) is checked and kept as a FastPoint; the sweeper (whose validation is all
        that calls this) then gets the config of the point's group choices, which it discards."""
        key = tuple(sweep_overrides)
        got = self.kept.get(key)
        if got is None:
            got = self.kept[key] = self.point(master_config, list(sweep_overrides))
        return got.base_cfg() if isinstance(got, FastPoint) else got

    def take(self, master_config, sweep_overrides):
        """The point: the one composed for the sweeper's check, or composed now (a FastPoint or a
        config)."""
        got = self.kept.pop(tuple(sweep_overrides), None)
        return got if got is not None else self.point(master_config, list(sweep_overrides))

    def _parse(self, master_config, sweep_overrides):
        """(parsed overrides, the value overrides among them, the base's key)."""
        hydra_lines = self._hydra_lines.get(id(master_config))
        if hydra_lines is None:
            hydra_lines = self._hydra_lines[id(master_config)] = list(
                OmegaConf.to_container(master_config.hydra.overrides.hydra))
        lines = hydra_lines + list(sweep_overrides)
        new = [line for line in dict.fromkeys(lines) if line not in self.parsed]
        if new:  # each distinct override text parsed once (the parsed Override is only read)
            simple = {line: o for line, o in ((line, plain_number_override(line)) for line in new) if o}
            self.parsed.update(simple)
            rest = [line for line in new if line not in simple]
            if rest:
                self.parsed.update(zip(rest, OverridesParser.create().parse_overrides(rest)))
        parsed = [self.parsed[line] for line in lines]
        if any(o.is_sweep_override() or o.get_key_element() == "hydra.searchpath" for o in parsed):
            return parsed, None, None
        # the base: every hydra override and every config-group choice; merged on: app values
        values = [o for o in parsed if not o.is_hydra_override()
                  and (isinstance(o.value(), dict) or not self._is_group(o.key_or_group))]
        base_lines = [o.input_line for o in parsed if o not in values]
        return parsed, values, (master_config.hydra.job.config_name, tuple(base_lines))

    def _constant_lines(self, master_config) -> frozenset:
        """The override lines of the command line that sweep nothing (the same in every point)."""
        found = self._constant.get(id(master_config))
        if found is None:
            lines = override_lines(master_config.hydra.overrides.task)
            plain = [line for line in lines if "," not in line and "(" not in line]  # no sweep, no function
            found = self._constant[id(master_config)] = frozenset(
                o.input_line for o in OverridesParser.create().parse_overrides(plain) if not o.is_sweep_override())
        return found

    def _is_group(self, key: str) -> bool:
        """Whether ``key`` names a config group (asked of Hydra's repository once per key: ~0.1 ms each)."""
        found = self._groups.get(key)
        if found is None:
            found = self._groups[key] = bool(self.loader.repository.group_exists(key))
        return found

    def _base(self, bkey):
        """The composed config of these group choices, pickled (unpickling copies a config ~4x faster
        than copy.deepcopy)."""
        base = self.bases.get(bkey)
        if base is None:
            base = self.bases[bkey] = pickle.dumps(self.loader.load_configuration(
                config_name=bkey[0], overrides=list(bkey[1]), run_mode=RunMode.RUN),
                protocol=pickle.HIGHEST_PROTOCOL)
        return base

    def point(self, master_config, sweep_overrides):
        """The point as a FastPoint where the fast path applies (see FastBase), else its composed
        config (``compose``)."""
        parsed, values, bkey = self._parse(master_config, sweep_overrides)
        if values is not None and self.allow_fast:
            # plain values go onto the base per point; any other value override (`+key=...`, a dict)
            # is part of the base (a sweep's constant extras: composed once)
            # a value the command line sets for every point (`train.steps=2`) is part of the base too:
            # a point then puts in only what it sweeps (and re-resolves only what depends on that)
            constant = self._constant_lines(master_config)
            swept = [o for o in values if FastBase.eligible(o) and o.input_line not in constant]
            fixed = [o for o in values if not FastBase.eligible(o) or o.input_line in constant]
            if _overlap([o.key_or_group for o in swept], [o.key_or_group for o in fixed]):
                swept = None  # the order they are applied in would matter: the full path keeps it
            fkey = (bkey, tuple(o.input_line for o in fixed))
            fast = self.fast.get(fkey) if swept is not None else False
            if fast is None:
                fast = self.fast[fkey] = self._fast_base(master_config, bkey, fixed)
            got = fast.point(parsed, len(values), swept) if fast else None
            if got is not None:
                self._tick()
                self.composed += 1
                return got
        return self.compose(master_config, sweep_overrides)

    def _fast_base(self, master_config, bkey, fixed):
        """The FastBase of these group choices with these overrides applied; False where they fail
        or the result does not resolve (each point then takes the full path, which reports it)."""
        try:
            cfg = pickle.loads(self._base(bkey))
            ConfigLoaderImpl._apply_overrides_to_config(fixed, cfg)
            return FastBase(cfg, master_config)
        except OmegaConfBaseException:
            return False

    def compose(self, master_config, sweep_overrides):
        self._tick()
        parsed, values, bkey = self._parse(master_config, sweep_overrides)
        if values is None:
            return self.original(master_config, sweep_overrides)  # Hydra's own errors / search path
        cfg = pickle.loads(self._base(bkey))
        try:
            ConfigLoaderImpl._apply_overrides_to_config(values, cfg)
        except OmegaConfBaseException as e:  # as load_configuration reports it
            raise ConfigCompositionException().with_traceback(sys.exc_info()[2]) from e
        app = [o for o in parsed if not o.is_hydra_override()]
        cfg.hydra.overrides.task = task_overrides(list(cfg.hydra.overrides.task), app, len(values))
        dirname = cfg.hydra.job.config.override_dirname
        cfg.hydra.job.override_dirname = get_overrides_dirname(
            overrides=app, kv_sep=dirname.kv_sep, item_sep=dirname.item_sep, exclude_keys=dirname.exclude_keys)
        OmegaConf.copy_cache(from_config=master_config, to_config=cfg)
        self.composed += 1
        return cfg

    def _tick(self) -> None:
        """Count a composed point; past PROGRESS_AFTER_S of composing, a progress bar on stderr."""
        now = time.perf_counter()
        if self._burst is None:
            self._burst = [now, 0, None, None]
        b = self._burst
        b[1] += 1
        if b[2] is None and now - b[0] > self.PROGRESS_AFTER_S:
            # rich: only once composing is slow enough to show a bar
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            cols = [TextColumn("composing"), BarColumn(), MofNCompleteColumn() if self.expected else TextColumn(
                "{task.completed} point(s)"), TimeElapsedColumn()]
            b[2] = Progress(*cols, console=Console(stderr=True), transient=True)
            b[2].start()
            b[3] = b[2].add_task("compose", total=self.expected)
        if b[2] is not None:
            b[2].update(b[3], completed=b[1])

    def end(self) -> None:
        """Composing is over (for now): take the bar down."""
        if self._burst and self._burst[2] is not None:
            self._burst[2].stop()
        self._burst = None


# A sweep hands each point back as text (`seed=17`, `optim.lr=0.0003`); Hydra's parser (ANTLR) takes
# ~0.3 ms a line. The lines that are a dotted key (or `+key`, `++key`) set to a plain decimal number
# are read here, into
# the Override Hydra's parser returns for them (tests/unit/test_compose_fast.py compares the two);
# every other line goes to Hydra's parser.
_PLAIN_KEY = r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*"
_INT = r"[+-]?(?:0|[1-9][0-9]*)"
_FLOAT = (r"[+-]?(?:(?:0|[1-9][0-9]*)?\.[0-9]+|(?:0|[1-9][0-9]*)\.)(?:[eE][+-]?[0-9]+)?"
          r"|[+-]?(?:0|[1-9][0-9]*)[eE][+-]?[0-9]+")
_PLAIN_NUMBER = None


def plain_number_override(line: str):
    """Hydra's Override for ``key=<int or float>``, ``+key=...`` or ``++key=...`` (a plain dotted key, a
    plain decimal number); None for anything else."""
    global _PLAIN_NUMBER
    if _PLAIN_NUMBER is None:
        _PLAIN_NUMBER = re.compile(rf"(\+\+|\+)?({_PLAIN_KEY})=(?:({_INT})|({_FLOAT}))")
    m = _PLAIN_NUMBER.fullmatch(line)
    if m is None:
        return None

    kind = {None: OverrideType.CHANGE, "+": OverrideType.ADD, "++": OverrideType.FORCE_ADD}[m.group(1)]
    value = int(m.group(3)) if m.group(3) is not None else float(m.group(4))
    return Override(type=kind, key_or_group=m.group(2), value_type=ValueType.ELEMENT,
                    _value=value, package=None, input_line=line)


class FastPoint:
    """A sweep point on the fast path: its resolved config (plain dicts, as
    ``OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)`` of Hydra's composition), its task
    overrides and config-group choices (what Hydra's hydra node would hold)."""

    __slots__ = ("resolved", "overrides", "choices", "_base")

    def __init__(self, resolved, overrides, choices, base) -> None:
        self.resolved, self.overrides, self.choices, self._base = resolved, overrides, choices, base

    def base_cfg(self):
        return self._base.config()


class FastBase:
    """The fast path for points that differ from their group choices' composition only in plain
    values (``optim.lr=3e-4``, ``seed=7``: most sweeps). Instead of a config per point (a copy of the
    whole DictConfig, then its resolution: ~2.5 ms), a point is the base's resolution (computed once)
    with its values put in, checked by Hydra's own override code on one scratch copy of the base (same
    type conversion and errors), after which the scratch gets its old values back.

    Exact because: a value is written into the resolution as the typed config converted it; every
    top-level section that holds an interpolation anywhere (``name: ${model.name}``) is resolved
    again, per point, from the scratch with the point's values in (so whatever depends on a swept
    value follows it); sections without interpolations cannot depend on anything else. A point whose
    values are anything else (``+key``, ``~key``, a dict or list, an interpolation, a key that is not
    a plain value of the config), or whose resolution fails, takes the full path (``compose``), which
    reports errors as Hydra does."""

    def __init__(self, cfg, master_config) -> None:
        self._blob, self._master = pickle.dumps(cfg, protocol=pickle.HIGHEST_PROTOCOL), master_config
        hydra_node = self._reset()
        scratch = self.scratch
        self.task = list(hydra_node.overrides.task)
        self.choices = OmegaConf.to_container(hydra_node.runtime.choices)
        self.resolved = OmegaConf.to_container(scratch, resolve=True, enum_to_str=True)
        self._resolved_blob = pickle.dumps(self.resolved, protocol=pickle.HIGHEST_PROTOCOL)
        raw = OmegaConf.to_container(scratch, resolve=False)
        # (path, text) of every interpolation; a point re-resolves the top-level sections holding
        # those its values may change (see ``_dependent``)
        self.interpolations = [(path, text) for path, text in _interpolations(raw, "")]
        self._config = None

    def _reset(self):
        """A fresh scratch copy of the base (app part); returns the base's hydra node."""
        scratch = pickle.loads(self._blob)
        with read_write(scratch), open_dict(scratch):
            hydra_node = scratch.pop("hydra")
        OmegaConf.copy_cache(from_config=self._master, to_config=scratch)
        self.scratch = scratch
        return hydra_node

    def config(self):
        """The full composed config of the group choices (hydra node included), read-only."""
        if self._config is None:
            self._config = pickle.loads(self._blob)
            OmegaConf.set_readonly(self._config, True)
        return self._config

    def _dependent(self, keys) -> set:
        """Top-level sections holding an interpolation that may read one of ``keys``. Conservative:
        an interpolation may read a key if its text names any part of the key's path, or any part of
        the path of another such interpolation (a chain ``a: ${b}``, ``b: ${c}``). Resolvers see the
        config only through interpolations written in the text, so one that names nothing of it
        (``${oc.env:HOME}``) keeps the base's value."""
        names = {part for k in keys for part in k.split(".")}
        found: set = set()
        grew = True
        while grew:
            grew = False
            for path, text in self.interpolations:
                if path not in found and any(re.search(rf"\b{re.escape(n)}\b", text) for n in names):
                    found.add(path)
                    names.update(re.split(r"[.\[\]]", path))
                    names.discard("")
                    grew = True
        return {re.split(r"[.\[]", path, maxsplit=1)[0] for path in found}

    def _node(self, key: str):
        parent_key, _, leaf = key.rpartition(".")
        parent = OmegaConf.select(self.scratch, parent_key) if parent_key else self.scratch
        return parent._get_node(leaf) if OmegaConf.is_dict(parent) else None

    @staticmethod
    def eligible(o) -> bool:
        if o.type is not OverrideType.CHANGE or o.package is not None:
            return False
        v = o.value()
        return v is None or isinstance(v, (bool, int, float)) or (isinstance(v, str) and "${" not in v)

    def point(self, parsed, n_values: int, values):
        """The FastPoint with ``values`` (plain value overrides) put in, or None where the full path
        must decide (errors included). ``n_values``: the point's value overrides, these and the
        base's (Hydra's task overrides are counted from them)."""
        scratch, restore = self.scratch, []
        try:
            for o in values:
                key = o.key_or_group
                parent_key, _, leaf = key.rpartition(".")
                try:
                    parent = OmegaConf.select(scratch, parent_key) if parent_key else scratch
                    node = parent._get_node(leaf) if OmegaConf.is_dict(parent) else None
                except OmegaConfBaseException:  # not a key of the config: Hydra's error, from the full path
                    return None
                if not isinstance(node, ValueNode):
                    return None
                restore.append((node, node._value()))
            try:
                ConfigLoaderImpl._apply_overrides_to_config(values, scratch)
                if any(self._node(o.key_or_group) is not node for (node, _), o in zip(restore, values)):
                    self._reset()  # a node was replaced, not set: its old value cannot be put back
                    return None
                dynamic = self._dependent([o.key_or_group for o in values])
                resolved = pickle.loads(self._resolved_blob)  # the point's own copy (C speed)
                for k in dynamic:  # sections holding interpolations: resolved with the values in
                    v = scratch._get_node(k)
                    resolved[k] = (OmegaConf.to_container(v, resolve=True, enum_to_str=True)
                                   if OmegaConf.is_config(v) else scratch[k])
                for o in values:
                    parts = o.key_or_group.split(".")
                    if parts[0] in dynamic:
                        continue  # resolved above, value included
                    at = resolved
                    for part in parts[:-1]:
                        at = at[part]
                    value = OmegaConf.select(scratch, o.key_or_group)
                    at[parts[-1]] = value.name if isinstance(value, Enum) else value
            except OmegaConfBaseException:
                return None
        finally:
            for node, old in reversed(restore):
                node._set_value(old)
        resolved = {k: resolved[k] for k in self.resolved}  # the config's own key order
        task = task_overrides(self.task, [o for o in parsed if not o.is_hydra_override()], n_values)
        return FastPoint(resolved, task, self.choices, self)


def task_overrides(base_task, app, n_values: int):
    """hydra.overrides.task of a point: its base's task overrides (the app's group choices, composed
    into the base) are replaced by every app override of the point, in command-line order."""
    return base_task[:len(base_task) - (len(app) - n_values)] + [o.input_line for o in app]


def _overlap(keys, others) -> bool:
    """A key of one list equal to, inside or above a key of the other."""
    return any(a == b or a.startswith(b + ".") or b.startswith(a + ".") for a in keys for b in others)


def _interpolations(node, path: str):
    """(dotted path, text) of every string holding an interpolation in a raw config container."""
    if isinstance(node, str):
        if "${" in node:
            yield path, node
    elif isinstance(node, dict):
        for k, v in node.items():
            yield from _interpolations(v, f"{path}.{k}" if path else str(k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _interpolations(v, f"{path}[{i}]")


# ---- sweepers that need results ------------------------------------------------------------------
