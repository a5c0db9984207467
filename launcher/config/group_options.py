"""A ``<group>.name`` that no option of its config group provides is refused at launch.

``data.name=my_corpus`` used to pass: the data option composed (synthetic) kept its own data, and the
run trained on it under another name. For every config group whose options set ``name`` (data,
parallelism, optim, cluster, model, ...), the name a run's config holds must be one an option
provides: an option of that group in ANY config dir on the search path the config was composed
from (``launch --config-dir DIR``, ``hydra.searchpath``: a user's own ``cluster/mine.yaml`` provides
``cluster.name=mine``), or one the caller accepts (a reproduction: the archived run's). A group whose
node names a ``_target_`` (``model._target_=pkg.Net``: the user's own class) takes any name, a label;
the run's name (``name=``) is no group.

Pure: reads the options' YAML (no Hydra composition), never imports torch.
"""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import yaml

from launcher.archive import yamlio
from launcher.config import schema
from launcher.config.errors import ConfigError

# what the refusal suggests for a group, beyond picking one of its options
_FIXES = {
    "data": "data=tokens data.path=DIR (a dataset `launcher data prepare FILE... -o DIR` made)",
    "model": "model._target_=pkg.Net for a class of your own (its name is then a label)",
}


@dataclass(frozen=True)
class Group:
    """The names a group's options provide: name -> the option (file stem) that sets it. ``open``:
    some option's name is an interpolation (``name: ${...}``), so any name may be one."""

    name: str
    names: Tuple[Tuple[str, str], ...]
    open: bool = False

    @property
    def options(self) -> List[str]:
        return sorted({option for _, option in self.names})


def search_dirs(extra: Iterable[str] = ()) -> Tuple[str, ...]:
    """The config dirs a config was composed from: the launcher's conf/, ``extra`` (a point's own:
    ``Point.config_dirs``) and, where Hydra composed in this process and says so (``launch``'s run
    mode), every dir of its search path."""
    dirs = [str(schema.CONF_DIR), *extra]
    try:
        from hydra.core.hydra_config import HydraConfig  # only asked: Hydra is loaded where it composed

        if HydraConfig.initialized():
            dirs += dirs_of(HydraConfig.get().runtime.config_sources)
    except Exception:  # no Hydra, or a config without a runtime node: conf/ alone
        pass
    return tuple(dict.fromkeys(os.path.abspath(d) for d in dirs))


def dirs_of(sources: Any) -> Tuple[str, ...]:
    """The dirs of Hydra's ``hydra.runtime.config_sources`` (``--config-dir``, ``hydra.searchpath``;
    a ``pkg://`` source as its package's dir)."""
    out = []
    for src in sources or ():
        where = _source_dir(str(src.get("schema") if isinstance(src, dict) else src.schema),
                            str(src.get("path") if isinstance(src, dict) else src.path))
        if where:
            out.append(where)
    return tuple(out)


def _source_dir(kind: str, path: str) -> Optional[str]:
    if kind == "file":
        return path
    if kind == "pkg":  # a package of configs (hydra.searchpath=[pkg://mypkg.conf])
        try:
            spec = importlib.util.find_spec(path.replace("/", "."))
        except (ImportError, ValueError):
            return None
        locations = list(spec.submodule_search_locations or []) if spec else []
        return locations[0] if locations else None
    return None  # structured configs (ConfigStore): the schema's defaults, not options that set a name


def groups(dirs: Sequence[str]) -> Dict[str, Group]:
    """Every config group (a subdir of a search dir) whose options set ``name``, over all ``dirs``."""
    return _groups(tuple(_stamp(d) for d in dirs))


def _stamp(d: str) -> Tuple[str, float]:
    """A dir and when it last changed (one more option in a subdir changes the subdir: see _groups)."""
    try:
        subs = [e for e in os.scandir(d) if e.is_dir()]
        return d, max([os.stat(d).st_mtime] + [e.stat().st_mtime for e in subs])
    except OSError:
        return d, 0.0


@lru_cache(maxsize=16)
def _groups(stamped: Tuple[Tuple[str, float], ...]) -> Dict[str, Group]:
    found: Dict[str, Dict[str, str]] = {}
    opened: set = set()
    for d, _ in stamped:
        root = Path(d)
        if not root.is_dir():
            continue
        for sub in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith((".", "_"))):
            for option in sorted(sub.glob("*.yaml")) + sorted(sub.glob("*.yml")):
                name = _option_name(option)
                if name is None:
                    continue
                if "${" in name:
                    opened.add(sub.name)
                found.setdefault(sub.name, {}).setdefault(name, option.stem)
    return {g: Group(g, tuple(sorted(names.items())), g in opened) for g, names in found.items()}


def _option_name(path: Path) -> Optional[str]:
    """The ``name`` an option sets in its group's node (None: it sets none, is not readable, or its
    ``# @package`` header puts it elsewhere, e.g. a recipe option's global ``name``)."""
    try:
        text = path.read_text()
        body = yamlio.safe_load(text)
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None
    if any(line.strip().startswith("# @package") for line in text.splitlines()[:5]):
        return None
    name = body.get("name") if isinstance(body, dict) else None
    return str(name) if isinstance(name, (str, int)) and not isinstance(name, bool) else None


def problems(tree: Mapping[str, Any], dirs: Union[Sequence[str], Mapping[str, Group]],
             accepted: Optional[Mapping[str, Iterable[str]]] = None) -> List[ConfigError]:
    """One ConfigError per ``<group>.name`` of the resolved config ``tree`` that no option of the group
    in ``dirs`` provides (nor ``accepted``: group -> names taken as given). Unset names (null,
    MISSING) are the schema's to judge. ``dirs`` may be their ``groups(dirs)``, read already (a
    launch's points share one search path: its dirs are listed once, not once a point)."""
    out: List[ConfigError] = []
    for g in (dirs if isinstance(dirs, Mapping) else groups(dirs)).values():
        node = tree.get(g.name)
        if not isinstance(node, dict) or g.open or node.get("_target_"):  # (a null one names no class)
            continue
        name = node.get("name")
        if not isinstance(name, str) or name in ("", "???"):
            continue
        if name in dict(g.names) or name in set((accepted or {}).get(g.name, ())):
            continue
        listed = ", ".join(n if n == o else f"{n} ({g.name}={o})" for n, o in g.names)
        fix = f"pick one of its options, {g.name}=<option>"
        if g.name in _FIXES:
            fix += f" (e.g. {_FIXES[g.name]})"
        fix += f", or put your own {g.name}/{name}.yaml in a config dir (launch --config-dir DIR)"
        out.append(ConfigError(f"{g.name}.name", (
            f"{name!r} names no option of the {g.name} group: no config dir on the search path provides it "
            f"(its options: {listed}); the run would get the composed option's settings under another name"),
            fix))
    return out
