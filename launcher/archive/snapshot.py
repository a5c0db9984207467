"""The code snapshot: a copy of the source tree taken once per launch and shared by its sweep
points. Jobs import from it (PYTHONPATH, working directory), so a job that starts hours later runs
the code as it was at submission, and a reproduction runs the original run's code."""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path
from typing import Dict, List, Optional

from launcher.archive import atomic

PATCH_FILE = ".patch.diff"  # uncommitted changes of the source repo at snapshot time
MAX_FILE_BYTES = 5 * 1024 * 1024  # data files and checkpoints are not code
SKIP_DIRS = {".git", ".venv", "__pycache__", ".slurm-local", "runs", "outputs", "multirun", "wandb"}


def source_files(root: Path) -> List[str]:
    """Files git tracks plus untracked ones it does not ignore (relative paths); or, outside a
    git repo, every .py/.yaml file under root."""
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


def take(root: Path, dest: Path) -> Dict[str, object]:
    """Copy the source tree at `root` to `dest` (read-only); returns its description."""
    tmp = dest.with_name(dest.name + ".partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    digest = hashlib.sha256()
    copied, skipped = 0, []
    for rel in source_files(root):
        src = root / rel
        if any(part in SKIP_DIRS for part in Path(rel).parts):
            continue
        if src.stat().st_size > MAX_FILE_BYTES:
            skipped.append(rel)
            continue
        target = tmp / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, target)
        digest.update(rel.encode() + b"\0" + target.read_bytes())
        copied += 1
    tmp.mkdir(parents=True, exist_ok=True)
    from launcher.archive import code

    git = code.git_state(root)
    atomic.write_text(tmp / PATCH_FILE, str(git.pop("patch", "") or ""))
    info = {"source": str(root), "files": copied, "skipped_large": skipped, "sha256": digest.hexdigest(),
            "taken": __import__("time").strftime("%Y-%m-%dT%H:%M:%S%z"), "git": git}
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
