"""The code a run was launched with: git commit, branch, and a patch of every uncommitted change
(secret-looking files left out, known secret values redacted); and the launcher's own version and
commit, recorded apart from the user's code.

The patch and the dirty flag hold the user's code only: what the snapshot leaves out as output, not
code (launcher.archive.tree: any runs root, Hydra's output dirs, the launcher's own dirs
and files, files over the snapshot's size limit) is never in them. A changed file larger than
PATCH_MAX_BYTES (untracked) or binary is listed by name, size and sha256 (``patch_listed``), not
embedded. The patch is made by a constant number of git calls, however many files changed."""
from __future__ import annotations

import hashlib
import os
import stat
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Optional

from launcher.archive import secrets, tree

PATCH_MAX_BYTES = 256 * 1024  # an untracked file larger than this is listed in the record, not embedded
BINARY_PROBE = 8000  # git's own test: a NUL byte in a file's first 8000 bytes makes it binary
_ARGS_PER_CALL = 1000  # paths passed to one git command (an argument list has a length limit)
# plain output whatever the user's git config says (color.ui=always, an external diff, a textconv)
_PLAIN = ("--no-color", "--no-ext-diff", "--no-textconv", "--no-renames", "--src-prefix=a/", "--dst-prefix=b/")


def git(repo: Path, *args: str, check: bool = False, env: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """A git command's output in ``repo`` (None where it could not run or failed)."""
    try:
        out = subprocess.run(
            ["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=60, check=check,
            env=dict(env) if env is not None else None,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 else None


def repo_root(start: Path) -> Optional[Path]:
    top = git(start, "rev-parse", "--show-toplevel")
    return Path(top.strip()) if top else None


NOT_A_REPO = "not a git repo"


def is_binary(data: bytes) -> bool:
    return b"\0" in data[:BINARY_PROBE]


def classify(rel: str, data: Optional[bytes], known: Mapping[str, Any], tracked: bool, binary: bool = False,
             link: bool = False) -> str:
    """Where a changed file (its bytes; None: deleted) goes in the record: ``excluded`` (a secret-looking
    name, or a binary file holding a known secret value: a binary diff is encoded, so it could not be
    scrubbed), ``listed`` (by name, size and sha256: binary (``binary``: git says so), or untracked and
    over PATCH_MAX_BYTES), or ``patch`` (a text diff, known secret values redacted; a symlink's target)."""
    if secrets.is_secret_file(rel):
        return "excluded"
    if link:
        return "patch"
    if data is None:  # deleted: its text is in the commit; a binary one is only named
        return "listed" if binary else "patch"
    binary = binary or is_binary(data)
    if binary and secrets.contains_secret(data, known):
        return "excluded"
    if binary or (not tracked and len(data) > PATCH_MAX_BYTES):
        return "listed"
    return "patch"


def listing(rel: str, data: Optional[bytes]) -> Dict[str, object]:
    """A changed file the patch names instead of holding: its path, size and sha256 (deleted: only that)."""
    if data is None:
        return {"path": rel, "deleted": True}
    return {"path": rel, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def _changed_tracked(root: Path, base: str) -> Dict[str, bool]:
    """The tracked files that differ from ``base`` (path -> whether git takes it for binary): one call."""
    out = git(root, "diff", *_PLAIN, "--numstat", "-z", base) or ""
    changed: Dict[str, bool] = {}
    for entry in filter(None, out.split("\0")):
        added, deleted, rel = entry.split("\t", 2)
        changed[rel] = added == "-" and deleted == "-"
    return changed


def _patch(root: Path, base: str, paths: List[str], new: List[str]) -> str:
    """The diff of ``paths`` between ``base`` (a commit, or the empty tree) and the working tree, the
    ``new`` files (untracked, or staged only) as new files: through a throw-away index (``base``'s tree,
    ``new`` marked intent-to-add), so nothing is written into the repo, neither an object nor its index."""
    if not paths:
        return ""
    with tempfile.TemporaryDirectory(prefix="launcher-patch-") as tmp:
        env = {**os.environ, "GIT_INDEX_FILE": str(Path(tmp) / "index"), "GIT_LITERAL_PATHSPECS": "1"}
        if git(root, "read-tree", base, env=env) is None:
            return ""
        for i in range(0, len(new), _ARGS_PER_CALL):
            git(root, "add", "--intent-to-add", "--", *new[i:i + _ARGS_PER_CALL], env=env)
        return "".join(git(root, "diff", *_PLAIN, "--binary", base, "--", *paths[i:i + _ARGS_PER_CALL], env=env)
                       or "" for i in range(0, len(paths), _ARGS_PER_CALL))


def _empty_tree(root: Path) -> str:
    """The empty tree's id (what a repo without a commit is compared with)."""
    return (git(root, "hash-object", "-t", "tree", "/dev/null") or "").strip()


def git_state(start: Path, known: Optional[Mapping[str, Any]] = None,
              exclude: Iterable[Path] = ()) -> Dict[str, object]:
    """Commit, branch and a patch (tracked changes + untracked files git does not ignore) of the repo
    holding `start` (the user's code; outside git: no commit, ``note`` says so; the launcher's own
    commit is ``launcher_state``'s). What is not code is left out of the patch and of ``dirty`` (the
    snapshot's rule, ``tree.not_code``; ``exclude``: the runs root and other dirs, wherever they lie).
    Secret-looking files are left out of the patch (listed in ``patch_excluded``) and every known secret
    value (``known``, default: the secret-named variables of os.environ) is redacted in it. Binary files,
    and untracked ones over PATCH_MAX_BYTES, are listed in ``patch_listed`` (path, bytes, sha256).
    ``dirty``: the patch holds or lists a change."""
    known = secrets.known_secrets() if known is None else known
    root = repo_root(start)
    if root is None:
        return {"repo": None, "commit": None, "branch": None, "dirty": None, "patch": "", "patch_excluded": [],
                "patch_listed": [], "note": NOT_A_REPO}
    commit = (git(root, "rev-parse", "--verify", "-q", "HEAD") or "").strip() or None
    branch = (git(root, "rev-parse", "--abbrev-ref", "HEAD") or "").strip() or None
    left_out = tree.not_code(root, exclude)
    base = commit or _empty_tree(root)  # no commit yet: every file the index holds is a change
    tracked = _changed_tracked(root, base)
    untracked = [rel for rel in (git(root, "ls-files", "--others", "--exclude-standard", "-z") or "").split("\0")
                 if rel and not rel.endswith("/")]  # (a nested repo is no file)
    excluded: List[str] = []
    listed: List[Dict[str, object]] = []
    embed: List[str] = []
    new: List[str] = []
    for rel, binary in [*tracked.items(), *((rel, False) for rel in untracked)]:
        if left_out(rel):
            continue
        path = root / rel
        try:
            st: Optional[os.stat_result] = os.lstat(path)
        except OSError:
            st = None
        link = st is not None and stat.S_ISLNK(st.st_mode)
        if st is not None and not link and not stat.S_ISREG(st.st_mode):
            continue
        if st is not None and not link and st.st_size > tree.MAX_FILE_BYTES:
            continue  # the snapshot leaves it out too ("skipped_large"): data, not code
        try:
            data = None if st is None or link else path.read_bytes()
        except OSError:
            continue
        where = classify(rel, data, known, tracked=rel in tracked, binary=binary, link=link)
        if where == "excluded":
            excluded.append(rel)
        elif where == "listed":
            listed.append(listing(rel, data))
        else:
            embed.append(rel)
            if st is not None:
                new.append(rel)
    patch = _patch(root, base, sorted(embed), sorted(new))
    return {
        "repo": str(root),
        "commit": commit,
        "branch": branch,
        "dirty": bool(patch) or bool(listed),
        "patch": secrets.scrub(patch, known),
        "patch_excluded": sorted(excluded),
        "patch_listed": sorted(listed, key=lambda x: str(x["path"])),
    }


def launcher_state() -> Dict[str, object]:
    """The launcher itself: its version, where it runs from, and (installed from a git checkout) that
    checkout's commit and whether it has uncommitted changes."""
    from launcher import __version__

    path = Path(__file__).resolve().parents[1]
    root = repo_root(path)
    commit = ((git(root, "rev-parse", "HEAD") or "").strip() or None) if root else None
    status = git(root, "status", "--porcelain", "--untracked-files=no") if commit else None
    return {"version": __version__, "path": str(path), "repo": str(root) if root else None, "commit": commit,
            "dirty": bool(status.strip()) if status is not None else None}
