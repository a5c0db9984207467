"""The tree a launch snapshots: the git repo the user launches from, else the dir holding their code,
else the launcher's own repo (launcher.submit.pipeline takes the snapshot; launcher.archive.snapshot copies)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, List, Sequence

from launcher.archive import code


def snapshot_root(checked: Sequence[Any]) -> Path:
    """The tree a launch of these checked points snapshots."""
    repo = code.repo_root(Path.cwd())
    if repo is not None:  # (the usual case: nothing to walk, however many points)
        return repo
    recipes = [c.resolved["recipe"] for c in checked]
    # the code a run imports: its recipe's, and every class or factory its config instantiates (a
    # user's model._target_=mypkg.net.Net, built by a recipe of the launcher's)
    built = [t for c in checked for t in config_targets(c.resolved)]
    return source_root(Path.cwd(), [str(r.get("module") or r["_target_"]) for r in recipes] + built,
                       [str(r["script"]) for r in recipes if r.get("script")])


def config_targets(tree: Any) -> List[str]:
    """Every ``_target_`` string of a resolved config (plain dicts and lists), the recipe's included."""
    if isinstance(tree, dict):
        own = [tree["_target_"]] if isinstance(tree.get("_target_"), str) else []
        return own + [t for v in tree.values() for t in config_targets(v)]
    if isinstance(tree, list):
        return [t for v in tree for t in config_targets(v)]
    return []


def source_root(cwd: Path, targets: List[str], scripts: Sequence[str] = ()) -> Path:
    """The tree to snapshot: the git repo holding the working dir; else the working dir itself when it
    holds the top-level module of a target (a recipe's, or a class its config builds) or a script (a
    user's own code, not in git); else the repo holding the launcher (whose recipes the run uses)."""
    repo = code.repo_root(cwd)
    if repo is not None:
        return repo
    tops = {t.split(".")[0] for t in targets}
    if any((cwd / top).is_dir() or (cwd / f"{top}.py").is_file() for top in tops) or \
            any((cwd / s).is_file() for s in scripts):
        return cwd
    return code.repo_root(Path(__file__).resolve().parent) or cwd
