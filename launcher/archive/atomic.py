"""Atomic file writes: a reader sees the old file or the new one, never half of one.

Each write is flushed to disk (fsync) before it replaces the old file, so a crash leaves the old
file or the whole new one. Writing many files at once (a sweep stages a dozen per point) can defer
that to one flush of the whole file system at the end (``deferred_sync``): one syncfs instead of
thousands of fsyncs; what the batch wrote becomes visible only after (the sweep publishes its runs
once the batch is flushed)."""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import itertools
import json
import os
import threading
import types
from pathlib import Path
from typing import Any, Iterator, Optional, Set, Tuple, Union

# while deferring (process-wide: a launch stages its runs from several threads): .dirs, the
# directories written (one flush per file system), .private (write in place)
_deferred = types.SimpleNamespace(dirs=None, private=False)
_lock = threading.Lock()


def write_text(path: Union[str, Path], text: str, visible: bool = False) -> None:
    """``visible``: the file may be read while this writes it (a record that already exists and that
    running jobs read), so it is replaced through a temporary file even in a private batch."""
    path = Path(path)
    if _deferred.private and not visible:  # nobody reads the dir yet: no temporary file
        with _lock:
            _deferred.dirs.add(str(path.parent))
        try:
            with _create(path) as f:
                f.write(text)
        except OSError as e:  # a full disk: no half-written file left behind
            path.unlink(missing_ok=True)
            raise _named(e, path) from e
        return
    try:
        fd, tmp = _temporary(path)
    except FileNotFoundError:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = _temporary(path)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            flush(f, path.parent)
        os.replace(tmp, path)
    except BaseException as e:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(e, OSError):
            raise _named(e, path) from e
        raise


_names = itertools.count()


def _temporary(path: Path) -> Tuple[int, str]:
    """A new file beside ``path`` for its next version (fd, name): named by this process, thread and a
    counter (tempfile.mkstemp's random names cost more than the write), made with the archive's mode
    (umask applied: archives are shared with the team, never 0600)."""
    for _ in range(100):
        tmp = os.path.join(path.parent, f".{path.name}.{os.getpid()}.{threading.get_ident()}.{next(_names)}.tmp")
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666), tmp
        except FileExistsError:  # left by a process of the same pid before (a container restarted)
            continue
    raise FileExistsError(f"no temporary name free beside {path}")


def flush(f: Any, directory: Union[str, Path]) -> None:
    """The open file ``f`` (in ``directory``) flushed to disk: now, or, inside ``deferred_sync``, with
    the rest of the batch."""
    dirs: Optional[Set[str]] = _deferred.dirs
    if dirs is None:
        os.fsync(f.fileno())
        return
    with _lock:
        dirs.add(str(directory))


def _named(e: OSError, path: Path) -> OSError:
    """``e`` naming the file it failed to write (a full disk's ENOSPC from write() names none)."""
    if e.filename is not None or e.errno is None:
        return e
    return type(e)(e.errno, e.strerror, str(path))


def _create(path: Path):
    """``path`` opened for writing as a NEW file: an existing one is unlinked first, never truncated
    (it may be hard-linked into other runs, RunDir.link_from). The folder is made when missing (a
    sweep writes thousands of files: mkdir only then)."""
    for _ in range(3):
        try:
            return open(path, "x")
        except FileExistsError:
            path.unlink(missing_ok=True)
        except FileNotFoundError:
            path.parent.mkdir(parents=True, exist_ok=True)
    return open(path, "x")


@contextlib.contextmanager
def deferred_sync(private: bool = False) -> Iterator[None]:
    """Writes inside skip their own fsync; on leaving, every file system they wrote to is flushed
    once (on an error too). ``private``: what is written is in a directory nobody reads until it is
    renamed into place whole (a sweep's staged runs), so each file is written in place, without a
    temporary file and a rename of its own. Nested uses flush at the outermost."""
    if _deferred.dirs is not None:
        yield
        return
    dirs: Set[str] = set()
    _deferred.dirs, _deferred.private = dirs, private
    try:
        yield
    finally:  # what was written is flushed on an error too (a failed submission records why)
        _deferred.dirs, _deferred.private = None, False
        sync_filesystems(dirs)


def sync_filesystems(dirs: Set[str]) -> None:
    """Flush the file system holding each of ``dirs`` (syncfs, once per device; else one sync)."""
    seen: Set[int] = set()
    for d in sorted(dirs):
        try:
            dev = os.stat(d).st_dev
        except OSError:
            continue
        if dev in seen:
            continue
        seen.add(dev)
        if not _syncfs(d):
            os.sync()
            return


@functools.lru_cache(maxsize=1)
def _libc_syncfs() -> Any:
    # The C library is already loaded in this process: its symbols need no ldconfig lookup (which
    # find_library would start as a subprocess on every first call).
    try:
        return ctypes.CDLL(None, use_errno=True).syncfs
    except (OSError, AttributeError):
        return None


def _syncfs(directory: str) -> bool:
    """Linux syncfs(2) on the file system holding ``directory``; False where it is unavailable."""
    syncfs = _libc_syncfs()
    if syncfs is None:
        return False
    fd = os.open(directory, os.O_RDONLY)
    try:
        return syncfs(fd) == 0
    finally:
        os.close(fd)


def write_json(path: Union[str, Path], obj: Any, visible: bool = False, compact: bool = False) -> None:
    """``compact``: one line, for a record of thousands of entries that people read through the CLI (an
    indent makes json use its pure-Python encoder, ~4x slower: 0.4 s for a 10,000-point sweep's)."""
    indent = None if compact else 2
    write_text(path, json.dumps(obj, indent=indent, sort_keys=True, default=str) + "\n", visible=visible)


def read_json(path: Union[str, Path], default: Any = None) -> Any:
    try:
        return json.loads(Path(path).read_text())
    except (FileNotFoundError, ValueError):  # ValueError: not JSON, or not text at all (binary junk)
        return default
