"""DeepSpeed's JIT-compiled host ops (``cpu_adam`` for ``zero.offload_optimizer``) on a cluster: each
node builds or loads them in a node-local dir, seeded from and published to the shared cache.

torch builds a JIT op in ``TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions/<py>_<accel>/``)
under a lock file in the op's dir. With a home shared by every node (NFS), the first jobs of every
node build in the same dir at once, and a builder killed mid-build (a preempted job, a time limit, an
OOM) leaves its lock behind: torch's ``FileBaton`` then waits on it forever, in every later job of
every node. So, unless the user set ``TORCH_EXTENSIONS_DIR`` (kept as it is):

- the ranks build and load in a node-local dir (``$TMPDIR/launcher-torch-extensions-<uid>/<install>``, one per
  Python install: a build holds its install's absolute paths, and ninja rebuilds another's);
- that dir is seeded with a finished build from the shared cache (its ``<op>.so``, no lock), copied
  whole under another name and renamed into place, so a node loads in seconds what another built;
  a node's build older than a shared one of the same install (the same ``build.ninja``: a venv made
  again at the same path, its headers newer than the node's build) is replaced by it, where ninja
  would otherwise build it again inside the job (minutes, on every node);
- what a node built is published to the shared cache the same way (copy, then rename) for later jobs;
- a lock in the node-local dir older than ``STALE_LOCK_S`` is a builder that died: removed.

No library does this: torch's and DeepSpeed's builders take one dir and trust its lock.
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import MutableMapping, Optional

ENV = "TORCH_EXTENSIONS_DIR"
STALE_LOCK_S = 1800.0  # a build takes minutes; a lock this old has no live builder behind it


def build_folder() -> str:
    """torch's name for the builds of this interpreter and accelerator (``py312_cpu``, ``py312_cu128``)."""
    import torch

    accel = (f"rocm{torch.version.hip.replace('.', '')}" if torch.version.hip
             else f"cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda else "cpu")
    return f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}_{accel}"


def shared_root() -> Path:
    """Where torch builds when ``TORCH_EXTENSIONS_DIR`` is unset (the shared cache)."""
    from torch.utils.cpp_extension import get_default_build_root

    return Path(get_default_build_root()) / build_folder()


def install_key() -> str:
    """The Python install a build belongs to: torch writes the install's absolute include and source
    paths into a build (build.ninja, .ninja_deps), so ninja rebuilds another install's build when it
    loads it; two venvs on one node would each rebuild over the other's."""
    import hashlib

    return hashlib.sha1(sys.prefix.encode()).hexdigest()[:12]


def local_root() -> Path:
    return (Path(tempfile.gettempdir()) / f"launcher-torch-extensions-{os.getuid()}" / install_key()
            / build_folder())


def built(op_dir: Path, name: str) -> bool:
    """A finished build: the op's library is there and no builder holds the dir."""
    return (op_dir / f"{name}.so").is_file() and not (op_dir / "lock").exists()


def _copy_into_place(src: Path, dest: Path) -> bool:
    """``src`` copied to ``dest`` whole or not at all (another name, then a rename): False if ``dest``
    exists (another rank or node won) or the copy failed."""
    if dest.exists():
        return False
    tmp = dest.parent / f".{dest.name}.{os.getpid()}.tmp"
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(src, tmp, ignore=shutil.ignore_patterns("lock"))  # mtimes kept: ninja sees it built
        os.rename(tmp, dest)
        return True
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        return False


def superseded(op_dir: Path, shared_op: Path, name: str) -> bool:
    """The node's finished build is older than a finished shared one made for the same install (the same
    build.ninja: paths and flags), so the shared one was built against what is installed now."""
    try:
        same = (op_dir / "build.ninja").read_bytes() == (shared_op / "build.ninja").read_bytes()
        newer = (shared_op / f"{name}.so").stat().st_mtime > (op_dir / f"{name}.so").stat().st_mtime
    except OSError:
        return False
    return same and newer and built(op_dir, name) and built(shared_op, name)


def _replace(src: Path, dest: Path) -> bool:
    """``dest`` (a finished build) replaced by a copy of ``src``: the copy made beside it, the old one
    renamed away, the copy renamed in (a rank that loads meanwhile sees one build or none: it seeds or
    builds as before)."""
    old = dest.parent / f".{dest.name}.{os.getpid()}.old"
    try:
        os.rename(dest, old)
    except OSError:  # another rank of the node is replacing it
        return False
    try:
        return _copy_into_place(src, dest)
    finally:
        shutil.rmtree(old, ignore_errors=True)


def clear_stale_lock(op_dir: Path, now: Optional[float] = None) -> bool:
    lock = op_dir / "lock"
    try:
        if (now if now is not None else time.time()) - lock.stat().st_mtime > STALE_LOCK_S:
            lock.unlink()
            return True
    except OSError:
        pass
    return False


def prepare(name: str, env: MutableMapping[str, str] = os.environ, *, shared: Optional[Path] = None,
            local: Optional[Path] = None) -> Optional[Path]:
    """Point torch's JIT builds of op ``name`` at the node-local dir, seeded from the shared cache;
    returns that dir, or None where the user chose ``TORCH_EXTENSIONS_DIR`` (nothing changed)."""
    if env.get(ENV):
        return None
    shared, local = shared or shared_root(), local or local_root()
    op = local / name
    if not built(op, name) and built(shared / name, name):
        _copy_into_place(shared / name, op)
    elif superseded(op, shared / name, name):
        _replace(shared / name, op)
    clear_stale_lock(op)
    local.mkdir(parents=True, exist_ok=True)
    env[ENV] = str(local)
    return local


def publish(name: str, local: Optional[Path], *, shared: Optional[Path] = None) -> bool:
    """After a load: the node's build into the shared cache for later jobs, where it has none yet."""
    if local is None or not built(local / name, name):
        return False
    shared = shared or shared_root()
    if (shared / name).exists() and not built(shared / name, name):  # a stale or partial shared build:
        return False  # left as it is (another node may be building there; it is only the seed)
    return _copy_into_place(local / name, shared / name)


def cpu_adam(params, **kwargs):
    """DeepSpeedCPUAdam, its op built or loaded node-locally (above)."""
    local = prepare("cpu_adam")
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    opt = DeepSpeedCPUAdam(params, **kwargs)
    publish("cpu_adam", local)
    return opt
