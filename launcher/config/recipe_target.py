"""Whether ``recipe._target_`` names a function that exists (and ``recipe.module`` a module ``python
-m`` can run), found without importing or running anything: the module by its import spec, the
function in its source by ``ast``."""
from __future__ import annotations

import ast
import contextlib
import importlib.machinery
import importlib.util
import os
from contextvars import ContextVar
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterator, List, Mapping, Optional

SCRIPT_TARGET = "launcher.runtime.script.main"  # recipe=script's target (launcher.script_recipe: its login side)


def is_script(recipe: Any) -> bool:
    """Whether ``recipe`` (the config's recipe section) is a script recipe."""
    return isinstance(recipe, Mapping) and recipe.get("_target_") == SCRIPT_TARGET


# the code the job will import from: the working dir at a launch (its tree becomes the snapshot), the
# archived snapshot for `launcher resume` / `reproduce` (whatever the working dir is then)
_code_root: ContextVar[Optional[str]] = ContextVar("code_root", default=None)


@contextlib.contextmanager
def searched_in(code_dir: Optional[Path]) -> Iterator[None]:
    """Look for recipe targets in ``code_dir`` (a code snapshot) instead of the working dir."""
    token = _code_root.set(str(code_dir) if code_dir is not None else None)
    try:
        yield
    finally:
        _code_root.reset(token)


def code_root() -> Optional[str]:
    """The code snapshot ``searched_in`` names (None: the working dir's tree, at a launch)."""
    return _code_root.get()


def target_problem(target: str, recipe: bool = True) -> Optional[str]:
    """Why ``recipe._target_`` (``package.module.function``) cannot be found, or None. Imports nothing
    and runs nothing: the module is found on sys.path (and the code the job imports first: the working
    dir, whose tree is snapshotted, or the snapshot of ``searched_in``) by spec, the function looked up
    in its source by ``ast``. ``recipe=False``: any name the module binds (a class or factory a
    config instantiates, e.g. ``model._target_``), not held to a recipe's ``fn(cfg, ctx)``."""
    return _target_problem(target, _code_root.get() or os.getcwd(), recipe)


@lru_cache(maxsize=64)
def _target_problem(target: str, cwd: str, recipe: bool = True) -> Optional[str]:
    parts = target.split(".")
    if len(parts) < 2 or not all(p.isidentifier() for p in parts):
        return f"{target!r} is not a dotted path module.function"
    spec, n = _find(parts, cwd, len(parts) - 1)
    if spec is None:
        return f"module {parts[0]!r} of {target!r} is not importable here"
    module, name = ".".join(parts[:n]), parts[n]
    if n == len(parts) - 1 and spec.submodule_search_locations and importlib.machinery.PathFinder.find_spec(
            target, list(spec.submodule_search_locations)) is not None:
        return f"{target!r} is a module, not a function in it"
    origin = spec.origin or ""
    if not origin.endswith(".py"):
        return None  # compiled or namespace: nothing to read, the job will tell
    try:
        with open(origin, "rb") as fh:
            tree = ast.parse(fh.read(), filename=origin)
    except (OSError, SyntaxError, ValueError) as e:
        return f"{module} ({origin}) cannot be read: {e}"
    if _top_level_names(tree) & {name, "*", "__getattr__"}:
        fn = next((n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name),
                  None)
        return _signature_problem(target, fn) if fn is not None and recipe else None
    what = "submodule nor name" if spec.submodule_search_locations else "name"
    return f"{module} ({origin}) has no {what} {name!r}"


def module_problem(module: str, cwd: str) -> Optional[str]:
    """Why ``python -m module`` would not find ``module`` (``pkg.train``), or None. Found as
    ``target_problem`` finds a recipe's module: in ``cwd`` (the code snapshot's root) or installed."""
    parts = module.split(".")
    if not all(p.isidentifier() for p in parts):
        return f"{module!r} is not a dotted module name"
    spec, n = _find(parts, cwd, len(parts))
    if spec is None:
        return f"module {parts[0]!r} is not importable from {cwd} or the installed packages"
    if n < len(parts):
        return f"{'.'.join(parts[:n])} ({spec.origin or 'a package'}) has no submodule {parts[n]!r}"
    if spec.submodule_search_locations and importlib.machinery.PathFinder.find_spec(
            module + ".__main__", list(spec.submodule_search_locations)) is None:
        return f"{module!r} is a package without a __main__ module: `python -m` cannot run it"
    return None


def _find(parts: List[str], cwd: str, depth: int):
    """(spec, n): the spec of the longest prefix ``parts[:n]`` (n <= depth) found, without importing
    anything (a submodule in its parent's directories); (None, 0) when even ``parts[0]`` is not."""
    spec = importlib.machinery.PathFinder.find_spec(parts[0], [cwd])
    if spec is None:
        try:
            spec = importlib.util.find_spec(parts[0])  # a top-level name: finding it imports nothing
        except (ImportError, ValueError):
            spec = None
    if spec is None:
        return None, 0
    n = 1
    while n < depth and spec.submodule_search_locations:
        sub = importlib.machinery.PathFinder.find_spec(".".join(parts[:n + 1]), list(spec.submodule_search_locations))
        if sub is None:
            break
        spec, n = sub, n + 1
    return spec, n


def _signature_problem(target: str, fn: ast.FunctionDef) -> Optional[str]:
    """Why a recipe function cannot be called as the job calls it, ``fn(cfg, ctx)``, or None."""
    a = fn.args
    positional = [*a.posonlyargs, *a.args]
    required = len(positional) - len(a.defaults)
    kw_required = [k.arg for k, d in zip(a.kwonlyargs, a.kw_defaults) if d is None]
    if (len(positional) < 2 and a.vararg is None) or required > 2 or kw_required:
        args = ", ".join(p.arg for p in positional)
        return (f"{target}({args}) is called as {fn.name}(cfg, ctx) by the job: "
                f"define it as def {fn.name}(cfg, ctx) "
                "(cfg: the run's config, ctx: launcher.runtime.context.RunContext)")
    return None


def _top_level_names(tree: ast.Module) -> set:
    """Names a module binds at its top level (inside if/try/with blocks too), '*' for a star import."""
    out: set = set()

    def visit(body: List[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                out.add(node.name)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                out.update((a.asname or a.name).split(".")[0] for a in node.names)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    out.update(n.id for n in ast.walk(t) if isinstance(n, ast.Name))
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                for attr in ("body", "orelse", "finalbody", "handlers"):  # if / try / with / for blocks
                    inner = getattr(node, attr, None)
                    if isinstance(inner, list):
                        visit(inner)

    visit(tree.body)
    return out
