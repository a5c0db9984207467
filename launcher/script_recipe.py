"""``recipe=script``: a torchrun-style script run unchanged, one process per rank (docs/scripts.md).
What the login node knows of it: whether a config is one, the launch-time checks of its keys, and
the command each rank runs. Pure (no torch); the node side is launcher/runtime/script.py.

A script's path is taken as torchrun takes it: relative to the launch dir (and, failing that, to the
code snapshot's root: the git repo holding the launch dir, or outside git the launch dir itself). The
snapshot records where in it the launch ran (``launch_dir``); each rank's script starts there, in its
run's mirror of the snapshot (launcher.runtime.script.work_dir).
"""
from __future__ import annotations

import os
import re
import subprocess
from functools import lru_cache
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple

from launcher.archive import code
from launcher.config.recipe_target import SCRIPT_TARGET, code_root, is_script, module_problem

KEYS = ("script", "module", "args", "resume_args")  # the recipe keys only a script recipe reads
LIST_KEYS = ("args", "resume_args")

# what `launcher show` and the archive say of what the config composes but a script never reads
NOT_USED = "not used by this recipe"
# the layout keys a script decides itself (its own parallelism, batch and accumulation); the job's
# shape (world_size, nodes, procs_per_node) is what the scheduler gives its processes
UNUSED_LAYOUT = ("engine", "dp", "tp", "pp", "zero", "micro_batch_size", "grad_accum", "global_batch_size",
                 "sequence_parallel", "offload_optimizer", "offload_params")


def script_in(root: Path, launch_dir: Optional[str], script: str) -> str:
    """The script's path from ``root`` (a tree holding the snapshot's files: the snapshot, the run's
    mirror of it, or at launch the source tree), as torchrun takes it: relative to the launch dir
    ``launch_dir`` (its path from ``root``) where that holds it, else relative to ``root`` itself."""
    for base in ([launch_dir] if launch_dir not in (None, "", ".") else []) + ["."]:
        rel = os.path.normpath(os.path.join(str(base), script))
        if (Path(root) / rel).is_file():
            return Path(rel).as_posix()
    return Path(os.path.normpath(script)).as_posix()


def arguments(recipe: Mapping[str, Any], attempt: int = 1) -> List[str]:
    """The script's arguments on ``attempt``: ``recipe.args``, then from the second attempt on (a requeue,
    a restart, ``launcher resume``: the script resumes) ``recipe.resume_args``."""
    args = [str(a) for a in recipe.get("args") or []]
    if attempt > 1:
        args += [str(a) for a in recipe.get("resume_args") or []]
    return args


def command(recipe: Mapping[str, Any], where: Path, python: str, attempt: int = 1,
            launch_dir: Optional[str] = None) -> List[str]:
    """What one rank runs on ``attempt``: ``python <where>/<script> args...`` (``where``: the tree the
    script is found in, see ``script_in``) or ``python -m <module> args...``."""
    args = arguments(recipe, attempt)
    if recipe.get("module"):
        return [python, "-m", str(recipe["module"]), *args]
    return [python, str(Path(where) / script_in(Path(where), launch_dir, str(recipe["script"]))), *args]


def archived(resolved: Mapping[str, Any], layout: Dict[str, Any]) -> Dict[str, Any]:
    """What run.json records of a script run instead of the seed and the layout keys the config
    composed but the script never reads (``{}`` for any other recipe)."""
    if not is_script(resolved.get("recipe")):
        return {}
    return {"seed": NOT_USED, "not_used_by_recipe": ["seed", *(f"layout.{k}" for k in UNUSED_LAYOUT if k in layout)]}


# ---- `--k=v` in recipe.args, as a user types it -------------------------------------------------------
# Hydra's grammar takes `=` only inside a quoted string: `'recipe.args=[--device=cpu]'` would fail with
# "no viable alternative at input". ``quote_args`` quotes such elements before Hydra parses the line.

_LIST_OVERRIDE = re.compile(rf"^(\+{{0,2}}recipe\.(?:{'|'.join(LIST_KEYS)})=)\[(.*)\]$", re.DOTALL)


def quote_args(argv: List[str]) -> List[str]:
    """``argv`` (a launch's overrides) with each element of a ``recipe.args=[...]`` or
    ``recipe.resume_args=[...]`` that Hydra's grammar cannot take unquoted (``--device=cpu``) quoted as
    one string; every other line, and a line Hydra parses as it is, unchanged."""
    return [_quoted_list(a) for a in argv]


def _parses(line: str) -> bool:
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        OverridesParser.create().parse_override(line)
        return True
    except (HydraException, ValueError):
        return False


def _quoted_list(line: str) -> str:
    m = _LIST_OVERRIDE.match(line)
    if m is None or _parses(line):
        return line
    items = _split(m.group(2))
    if items is None:
        return line
    out = m.group(1) + "[" + ",".join(
        e if not e or _parses(f"k=[{e}]") else _quote(e) for e in (i.strip() for i in items)) + "]"
    return out if _parses(out) else line  # still not Hydra's: its own error says where


def _split(text: str) -> Optional[List[str]]:
    """The elements of a list's inside at its top-level commas (quotes and brackets kept whole), or
    None where a quote or bracket is left open or closes one never opened."""
    items, start, depth, quote, i = [], 0, 0, None, 0
    while i < len(text):
        ch = text[i]
        if quote:
            if ch == "\\":
                i += 1
            elif ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch in "[{(":
            depth += 1
        elif ch in "]})":
            depth -= 1
            if depth < 0:  # `[a],[b]`: a sweep over lists, not one list
                return None
        elif ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
        i += 1
    if quote or depth:
        return None
    items.append(text[start:])
    return [] if len(items) == 1 and not items[0].strip() else items


def _quote(text: str) -> str:
    """``text`` as one quoted string of Hydra's grammar (a backslash is escaped only before a quote or
    at the end, as Hydra reads it)."""
    q = "'" if '"' in text and "'" not in text else '"'
    out = re.sub(rf"(\\+)(?={q}|$)", lambda m: m.group(1) * 2, text)
    return q + out.replace(q, "\\" + q) + q


def snapshot_root(cwd: Path) -> Path:
    """The tree the snapshot is taken from for a script launched in ``cwd`` (as
    launcher.submit.pipeline.source_root chooses it)."""
    return code.repo_root(cwd) or cwd


def problems(tree: Mapping[str, Any]) -> List[Tuple[str, str]]:
    """(key, problem) of the recipe's script keys (at most one), for launcher.config.rules."""
    found = _problem(tree)
    return [(found[0], found[1])] if found else []


def fix(tree: Mapping[str, Any]) -> str:
    found = _problem(tree)
    return found[2] if found else ""


def _problem(tree: Mapping[str, Any]) -> Optional[Tuple[str, str, str]]:
    recipe = tree.get("recipe") if isinstance(tree, Mapping) else None
    if not isinstance(recipe, Mapping):
        return None
    script, module = recipe.get("script"), recipe.get("module")
    listed = tuple(k for k in LIST_KEYS if recipe.get(k))
    return _check(str(recipe.get("_target_")), script if script is None else str(script),
                  module if module is None else str(module), listed, os.getcwd(), code_root())


@lru_cache(maxsize=64)
def _check(target: str, script: Optional[str], module: Optional[str], listed: Tuple[str, ...],
           cwd: str, snapshot: Optional[str] = None) -> Optional[Tuple[str, str, str]]:
    """(key, problem, fix) of the first thing wrong, or None. ``listed``: the list keys set (args,
    resume_args). ``snapshot``: the code snapshot a resume or reproduction runs
    (launcher.config.recipe_target.searched_in), else the launch dir's tree."""
    if target != SCRIPT_TARGET:
        if script or module or listed:
            key = "recipe.script" if script else "recipe.module" if module else f"recipe.{listed[0]}"
            return (key, f"is set, but recipe._target_={target} runs, which never reads it",
                    "choose the script recipe: recipe=script (or drop the key)")
        return None
    if not script and not module:
        return ("recipe.script", "recipe=script runs a script, but neither recipe.script (a file) nor recipe.module "
                "(`python -m`) is set", "set recipe.script=train.py or recipe.module=mypkg.train")
    if script and module:
        return ("recipe.module", f"both recipe.script={script} and recipe.module={module} are set; the job runs one",
                "set only one: recipe.module=null or recipe.script=null")
    root = Path(snapshot) if snapshot else snapshot_root(Path(cwd))
    launch = _snapshot_launch_dir(root) if snapshot else _relative(Path(cwd), root)
    where = f"the code snapshot {snapshot}" if snapshot else _where(root, Path(cwd))
    if module:
        here = root / launch if launch else None
        problem = module_problem(module, str(root))
        if problem and here is not None and here != root and module_problem(module, str(here)) is None:
            problem = None  # `python -m` in the launch dir finds it there, as under torchrun
        return ("recipe.module", f"{problem}: the job would fail when it starts",
                f"name a module in {where}, e.g. recipe.module=mypkg.train") if problem else None
    return _script_problem(script, Path(cwd), root, launch, where, taken=bool(snapshot))


def _snapshot_launch_dir(snapshot: Path) -> Optional[str]:
    """Where in the code snapshot its launch ran (launcher.archive.snapshot records it)."""
    from launcher.archive import snapshot as snapshots

    return (snapshots.info(snapshot) or {}).get("launch_dir")


def _where(root: Path, cwd: Path) -> str:
    """Where the job looks for the script, in words (the launch dir is not spelled out: it is $PWD,
    which the archive may print redacted)."""
    return ("the launch dir (the code snapshot's root)" if _relative(cwd, root) == "."
            else f"the launch dir or {root} (the git repo's root: the code snapshot's root)")


def _script_problem(script: str, cwd: Path, root: Path, launch: Optional[str], where: str,
                    taken: bool = False) -> Optional[Tuple[str, str, str]]:
    """``launch``: the launch dir's path in ``root`` (None: outside it); ``taken``: ``root`` is a
    snapshot already (what it holds, the job finds)."""
    path = Path(script)
    if path.is_absolute():
        inside = _relative(path, root)
        given = os.path.relpath(os.path.realpath(path), os.path.realpath(cwd)) if inside and not taken else inside
        return ("recipe.script", f"{script} is an absolute path: the job runs the code snapshot's copy, not this file",
                f"set recipe.script={given} (its path from the launch dir)" if given else
                f"move the script into {where} and give its path relative to the launch dir")
    target = root / script_in(root, launch, script)
    if not target.is_file():
        return ("recipe.script", f"no file {script} in {where}, where the job looks for it",
                "give the script's path relative to the launch dir, as torchrun takes it")
    inside = _relative(target, root)
    if inside is None:
        return ("recipe.script", f"{script} lies outside {where}: the code snapshot leaves it out",
                f"move the script into {where}")
    if not taken and not _copied(root, inside):
        return ("recipe.script", f"{inside} is not in the code snapshot (git ignores it, or outside git it is not "
                "a .py file): the job would not find it", "un-ignore it in .gitignore, or name it *.py outside git")
    return None


def _relative(path: Path, root: Path) -> Optional[str]:
    try:
        return Path(os.path.realpath(path)).relative_to(os.path.realpath(root)).as_posix()
    except ValueError:
        return None


def _copied(root: Path, rel: str) -> bool:
    """Whether the code snapshot of ``root`` holds ``rel`` (launcher.archive.snapshot.source_files'
    rule: in git what it tracks or does not ignore; outside git the .py/.yaml/... files)."""
    if code.repo_root(root) is None:
        return rel.endswith((".py", ".yaml", ".yml", ".cfg", ".toml"))
    try:
        res = subprocess.run(["git", "-C", str(root), "check-ignore", "-q", rel],
                             capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return True  # cannot tell: the job will
    return res.returncode != 0
