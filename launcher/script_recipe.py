"""``recipe=script``: a torchrun-style script run unchanged, one process per rank (docs/scripts.md).
What the login node knows of it: whether a config is one, the launch-time checks of its keys, and
the command each rank runs. Pure (no torch); the node side is launcher/runtime/script.py.

Paths are relative to the code snapshot's root, where the job finds them: the git repo holding the
launch dir, or (outside git) the launch dir itself.
"""
from __future__ import annotations

import os
import subprocess
from functools import lru_cache
from pathlib import Path
from typing import Any, List, Mapping, Optional, Tuple

from launcher.archive import code
from launcher.recipe_target import code_root, module_problem

SCRIPT_TARGET = "launcher.runtime.script.main"
KEYS = ("script", "module", "args")  # the recipe keys only a script recipe reads


def is_script(recipe: Any) -> bool:
    """Whether ``recipe`` (the config's recipe section) is a script recipe."""
    return isinstance(recipe, Mapping) and recipe.get("_target_") == SCRIPT_TARGET


def command(recipe: Mapping[str, Any], code_dir: Path, python: str) -> List[str]:
    """What one rank runs: ``python <code_dir>/<script> args...`` or ``python -m <module> args...``."""
    args = [str(a) for a in recipe.get("args") or []]
    if recipe.get("module"):
        return [python, "-m", str(recipe["module"]), *args]
    return [python, str(Path(code_dir) / str(recipe["script"])), *args]


def snapshot_root(cwd: Path) -> Path:
    """The tree the snapshot is taken from for a script launched in ``cwd`` (as
    launcher.submit.pipeline.source_root chooses it)."""
    return code.repo_root(cwd) or cwd


def problems(tree: Mapping[str, Any]) -> List[Tuple[str, str]]:
    """(key, problem) of the recipe's script keys (at most one), for launcher.rules."""
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
    return _check(str(recipe.get("_target_")), script if script is None else str(script),
                  module if module is None else str(module), bool(recipe.get("args")), os.getcwd(), code_root())


@lru_cache(maxsize=64)
def _check(target: str, script: Optional[str], module: Optional[str], has_args: bool,
           cwd: str, snapshot: Optional[str] = None) -> Optional[Tuple[str, str, str]]:
    """(key, problem, fix) of the first thing wrong, or None. ``snapshot``: the code snapshot a
    resume or reproduction runs (launcher.recipe_target.searched_in), else the launch dir's tree."""
    if target != SCRIPT_TARGET:
        if script or module or has_args:
            key = "recipe.script" if script else "recipe.module" if module else "recipe.args"
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
    where = f"the code snapshot {snapshot}" if snapshot else _where(root, Path(cwd))
    if module:
        problem = module_problem(module, str(root))
        return ("recipe.module", f"{problem}: the job would fail when it starts",
                f"name a module in {where}, e.g. recipe.module=mypkg.train") if problem else None
    return _script_problem(script, Path(cwd), root, where, taken=bool(snapshot))


def _where(root: Path, cwd: Path) -> str:
    """The code snapshot's root, in words (the launch dir is not spelled out: it is $PWD, which the
    archive treats as secret-named and would print redacted)."""
    return ("the launch dir (the code snapshot's root)" if _relative(cwd, root) == "."
            else f"{root} (the git repo's root: the code snapshot's root)")


def _script_problem(script: str, cwd: Path, root: Path, where: str,
                    taken: bool = False) -> Optional[Tuple[str, str, str]]:
    """``taken``: ``root`` is a snapshot already (what it holds, the job finds)."""
    path = Path(script)
    if path.is_absolute():
        inside = _relative(path, root)
        return ("recipe.script", f"{script} is an absolute path: the job runs the code snapshot's copy, not this file",
                f"set recipe.script={inside}" if inside else f"move the script into {where} and give its path "
                "relative to it")
    target = root / path
    if not target.is_file():
        here = _relative(cwd / path, root) if (cwd / path).is_file() else None
        return ("recipe.script", f"no file {script} in {where}, where the job looks for it",
                f"set recipe.script={here} (its path from the snapshot's root)" if here and here != script
                else f"give the script's path relative to {where}")
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
