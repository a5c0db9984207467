"""The code snapshot: a copy of the source tree taken once per launch and shared by its sweep
points. Jobs import from it (PYTHONPATH, working directory), so a job that starts hours later runs
the code as it was at submission, and a reproduction runs the original run's code.

What it holds (one rule): in a git repo, the files git tracks plus the untracked files git does not
ignore (never an ignored file); outside one, every .py/.yaml/.yml/.cfg/.toml file. From those it
leaves out the launcher's own output dirs (SKIP_DIRS), files over MAX_FILE_BYTES (``skipped_large``),
and REFUSES secret-looking files (.env, .env.*, *.pem, *.key, id_rsa*, *credentials*, .netrc,
.pypirc, *.p12 ...: ``secrets.is_secret_file``) and binary files holding a known secret value
(``refused``). Every copied text file and the patch have every known secret value replaced by
``secrets.REDACTED`` (``redacted`` lists the files that held one)."""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Optional

from launcher.archive import atomic, code, secrets

PATCH_FILE = ".patch.diff"  # uncommitted changes of the source repo at snapshot time
MAX_FILE_BYTES = 5 * 1024 * 1024  # data files and checkpoints are not code
SKIP_DIRS = {".git", ".venv", "__pycache__", ".slurm-local", "runs", "outputs", "multirun", "wandb"}


def source_files(root: Path) -> List[str]:
    """Files git tracks plus untracked ones it does not ignore (relative paths); or, outside a
    git repo, every .py/.yaml/.yml/.cfg/.toml file under root. (``take`` then refuses the
    secret-looking ones.)"""
    try:
        out = subprocess.run(["git", "-C", str(root), "ls-files", "-co", "--exclude-standard", "-z"],
                             capture_output=True, text=True, timeout=60)
        if out.returncode == 0:
            return sorted(p for p in out.stdout.split("\0") if p and (root / p).is_file())
    except (OSError, subprocess.SubprocessError):
        pass
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS]
        for f in filenames:
            if f.endswith((".py", ".yaml", ".yml", ".cfg", ".toml")):
                files.append(str(Path(dirpath, f).relative_to(root)))
    return sorted(files)


def _is_text(data: bytes) -> bool:
    if b"\0" in data:
        return False
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _secret_looking(root: Path, rel: str) -> bool:
    """The file's path, or (a symlink) the name of what it points to, looks like a secret store."""
    if secrets.is_secret_file(rel):
        return True
    src = root / rel
    return src.is_symlink() and secrets.is_secret_file(Path(os.path.realpath(src)).name)


def _candidates(root: Path) -> List[str]:
    files = [rel for rel in source_files(root) if not any(part in SKIP_DIRS for part in Path(rel).parts)]
    # secret files git ignores (the usual .env) are never copied, but their values are secrets too
    files += [p.name for p in root.glob(".env*") if p.is_file() and p.name not in files]
    return files


def tree_secrets(root: Path) -> Dict[str, str]:
    """Secret values written in the source tree (name -> value, for ``secrets.scrub``): literals
    assigned to secret names in its config files (``secrets.secrets_in_text``) and in its
    secret-looking files (.env ...: ``secrets.secrets_in_secret_file``), used by this launch or not."""
    root = Path(root)
    found: Dict[str, str] = {}
    for rel in _candidates(root):
        secret_file = _secret_looking(root, rel)
        if not secret_file and not rel.lower().endswith(secrets.YAML_SUFFIXES + secrets.ASSIGNMENT_SUFFIXES):
            continue
        try:
            if (root / rel).stat().st_size > MAX_FILE_BYTES:
                continue
            text = (root / rel).read_text(errors="replace")
        except OSError:
            continue
        found.update(secrets.secrets_in_secret_file(rel, text) if secret_file else secrets.secrets_in_text(rel, text))
    return found


def take(root: Path, dest: Path, known: Optional[Mapping[str, Any]] = None,
         exclude: Iterable[Path] = ()) -> Dict[str, object]:
    """Copy the source tree at `root` to `dest` (read-only); returns its description. ``known``:
    the secret values to redact (``secrets.known_secrets``; default: those of os.environ);
    ``exclude``: directories never copied (the runs root, should it lie inside the tree)."""
    root = Path(root)
    known = {**(secrets.known_secrets() if known is None else known), **tree_secrets(root)}
    skip_under = [Path(os.path.realpath(d)) for d in (*exclude, dest.parent)]
    tmp = dest.with_name(dest.name + ".partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    digest = hashlib.sha256()
    copied, skipped, refused, redacted = 0, [], [], []
    for rel in source_files(root):
        src = root / rel
        if any(part in SKIP_DIRS for part in Path(rel).parts):
            continue
        real = Path(os.path.realpath(root / rel))
        if any(d == real or d in real.parents for d in skip_under):
            continue
        if _secret_looking(root, rel):
            refused.append(rel)
            continue
        if src.stat().st_size > MAX_FILE_BYTES:
            skipped.append(rel)
            continue
        data = src.read_bytes()
        if secrets.contains_secret(data, known):
            if not _is_text(data):  # replacing bytes inside a binary file would corrupt it
                refused.append(rel)
                continue
            data = secrets.scrub_bytes(data, known)
            redacted.append(rel)
        target = tmp / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
        shutil.copystat(src, target)
        digest.update(rel.encode() + b"\0" + data)
        copied += 1
    tmp.mkdir(parents=True, exist_ok=True)

    git = code.git_state(root, known)
    patch = secrets.scrub(str(git.pop("patch", "") or ""), known)
    refused = sorted(set(refused) | set(git.pop("patch_excluded", None) or []))
    atomic.write_text(tmp / PATCH_FILE, patch)
    info = {"source": str(root), "files": copied, "skipped_large": skipped, "refused": refused,
            "redacted": redacted, "sha256": digest.hexdigest(),
            "taken": __import__("time").strftime("%Y-%m-%dT%H:%M:%S%z"), "git": git}
    info = secrets.scrub_tree(info, known)
    atomic.write_json(tmp / ".snapshot.json", info)
    os.replace(tmp, dest)  # visible only once complete
    make_read_only(dest)
    return info


def make_read_only(path: Path) -> None:
    for dirpath, _, filenames in os.walk(path):
        for f in filenames:
            p = os.path.join(dirpath, f)
            os.chmod(p, os.stat(p).st_mode & ~0o222)


def info(dest: Path) -> Optional[Dict[str, object]]:
    return atomic.read_json(dest / ".snapshot.json")
