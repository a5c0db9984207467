"""The code a run was launched with: git commit, branch, and a patch of every uncommitted change
(secret-looking files left out, known secret values redacted); and the launcher's own version and
commit, recorded apart from the user's code."""
from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional

from launcher.archive import secrets


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


def _refused(root: Path, rel: str, known: Mapping[str, Any]) -> bool:
    """A changed file the patch leaves out: a secret-looking name (.env, *.pem ...), or a binary
    file holding a known secret value (a binary diff is encoded, so it could not be scrubbed)."""
    if secrets.is_secret_file(rel):
        return True
    path = root / rel
    try:
        data = path.read_bytes() if path.is_file() else b""
    except OSError:
        return False
    return b"\0" in data and secrets.contains_secret(data, known)


NOT_A_REPO = "not a git repo"


def git_state(start: Path, known: Optional[Mapping[str, Any]] = None) -> Dict[str, object]:
    """Commit, branch and a patch (tracked changes + untracked files git does not ignore) of the repo
    holding `start` (the user's code; outside git: no commit, ``note`` says so; the launcher's own
    commit is ``launcher_state``'s). Secret-looking files are left out of the patch (listed in
    ``patch_excluded``) and every known secret value (``known``, default: the secret-named variables of
    os.environ) is redacted in it."""
    known = secrets.known_secrets() if known is None else known
    root = repo_root(start)
    if root is None:
        return {"repo": None, "commit": None, "branch": None, "dirty": None, "patch": "", "patch_excluded": [],
                "note": NOT_A_REPO}
    commit = (_git(root, "rev-parse", "HEAD") or "").strip() or None
    branch = (_git(root, "rev-parse", "--abbrev-ref", "HEAD") or "").strip() or None
    excluded: List[str] = []
    patch = ""
    if commit:
        changed = (_git(root, "diff", "--no-renames", "--name-only", "-z", "HEAD") or "").split("\0")
        excluded += [rel for rel in filter(None, changed) if _refused(root, rel, known)]
        spec = ["--", "."] + [f":(exclude,literal){rel}" for rel in excluded] if excluded else []
        patch = _git(root, "diff", "--no-renames", "--binary", "HEAD", *spec) or ""
    untracked = (_git(root, "ls-files", "--others", "--exclude-standard", "-z") or "").split("\0")
    for rel in filter(None, untracked):
        if _refused(root, rel, known):
            excluded.append(rel)
            continue
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
        "dirty": bool(patch) or bool(excluded),
        "patch": secrets.scrub(patch, known),
        "patch_excluded": sorted(excluded),
    }


def launcher_state() -> Dict[str, object]:
    """The launcher itself: its version, where it runs from, and (installed from a git checkout) that
    checkout's commit and whether it has uncommitted changes."""
    from launcher import __version__

    path = Path(__file__).resolve().parents[1]
    root = repo_root(path)
    commit = ((_git(root, "rev-parse", "HEAD") or "").strip() or None) if root else None
    status = _git(root, "status", "--porcelain", "--untracked-files=no") if commit else None
    return {"version": __version__, "path": str(path), "repo": str(root) if root else None, "commit": commit,
            "dirty": bool(status.strip()) if status is not None else None}
