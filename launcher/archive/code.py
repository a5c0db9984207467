"""The code a run was launched with: git commit, branch, and a patch of every uncommitted change."""
from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Dict, Optional


def _git(repo: Path, *args: str, check: bool = False) -> Optional[str]:
    try:
        out = subprocess.run(
            ["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=60, check=check
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 else None


def repo_root(start: Path) -> Optional[Path]:
    top = _git(start, "rev-parse", "--show-toplevel")
    return Path(top.strip()) if top else None


def git_state(start: Path) -> Dict[str, object]:
    """Commit, branch and a patch (tracked changes + untracked files) of the repo holding `start`,
    or else of the repo this package was installed from (an editable install)."""
    root = repo_root(start) or repo_root(Path(__file__).resolve().parent)
    if root is None:
        return {"repo": None, "commit": None, "branch": None, "dirty": None, "patch": ""}
    commit = (_git(root, "rev-parse", "HEAD") or "").strip() or None
    branch = (_git(root, "rev-parse", "--abbrev-ref", "HEAD") or "").strip() or None
    patch = _git(root, "diff", "--binary", "HEAD") or "" if commit else ""
    untracked = (_git(root, "ls-files", "--others", "--exclude-standard", "-z") or "").split("\0")
    for rel in filter(None, untracked):
        # `git diff --no-index` exits 1 when files differ, so read stdout regardless
        out = subprocess.run(
            ["git", "-C", str(root), "diff", "--binary", "--no-index", "/dev/null", rel],
            capture_output=True, text=True, timeout=60,
        )
        patch += out.stdout
    return {
        "repo": str(root),
        "commit": commit,
        "branch": branch,
        "dirty": bool(patch),
        "patch": patch,
    }
