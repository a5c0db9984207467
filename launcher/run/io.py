"""The run dir's file operations every part of it shares: a lock, times, reading a record (size-capped,
regular files only), writing one once, the sweep's per-point record, a file's digest; and the sweep dir's
names the run dir reads (SweepNames)."""
from __future__ import annotations

import contextlib
import datetime as _dt
import functools
import hashlib
import json
import os
import secrets
import stat
import sys
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

import yaml

from launcher.archive import atomic, yamlio


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive fcntl lock on ``path`` (made if absent), held for the block: one writer at a time across
    the nodes that share the file system."""
    import fcntl

    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX)
        yield
    finally:
        try:
            fcntl.lockf(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)


def now_iso() -> str:
    return _dt.datetime.now().astimezone().isoformat(timespec="seconds")


def parse_iso(text: Optional[str]) -> Optional[float]:
    """A time now_iso wrote, as seconds since the epoch (None: absent or not such a time)."""
    try:
        return _dt.datetime.fromisoformat(str(text)).timestamp() if text else None
    except ValueError:
        return None


def fill_name(pattern: str, **parts: Any) -> str:
    for k, v in parts.items():
        pattern = pattern.replace(f"<{k}>", str(v))
    return pattern



class Unreadable(ValueError):
    """A file of a run dir that is there but does not hold what it should (junk, binary, another
    shape): the message names the file and why; ``path``: the file."""

    def __init__(self, why: str, path: Optional[Path] = None) -> None:
        super().__init__(why)
        self.path = path

    def __reduce__(self):  # pickled back as it was (a job's result may carry it)
        return (Unreadable, (str(self), self.path))


RECORD_MAX = 16 << 20  # bytes: a record (run.json, status.json, config.yaml, ...) larger is none of ours
ROWS_MAX = 512 << 20  # bytes: a JSON-lines record (metrics.jsonl, restarts.jsonl) of the longest runs


def _kind(mode: int) -> str:
    return ("a FIFO" if stat.S_ISFIFO(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
            else "a socket" if stat.S_ISSOCK(mode) else "a directory" if stat.S_ISDIR(mode) else "not a file")


def open_regular(path: Path):
    """``path`` opened for reading (binary), only where it is a regular file: a FIFO, a device or a socket
    (a FIFO as metrics.jsonl, a log linked to /dev/zero) is refused with Unreadable naming it, before a byte
    is read (opened without blocking, checked with fstat). FileNotFoundError where there is none."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise
    except OSError as e:
        raise Unreadable(f"{path.name} cannot be read ({e.strerror or e})", path) from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise Unreadable(f"{path.name} is {_kind(mode)}, not a file: not read", path)
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_bounded(path: Path, limit: int = RECORD_MAX) -> bytes:
    """The bytes of the regular file ``path`` (open_regular), refused with Unreadable where it holds more
    than ``limit`` (a sparse 1 GB status.json is never read into memory)."""
    with open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        if size > limit:
            raise Unreadable(f"{path.name} holds {size:,} bytes, more than such a record holds ({limit:,}): "
                             "not read", path)
        return f.read(limit)


def read_tail(path: Path, limit: int) -> bytes:
    """The last ``limit`` bytes of the regular file ``path`` (a log: its end says why it ended)."""
    with open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        f.seek(max(0, size - limit))
        return f.read(limit)


def read_record(path: Path) -> Optional[Dict[str, Any]]:
    """The JSON object ``path`` holds (None: no such file); Unreadable for anything else."""
    try:
        data = read_bounded(path)
    except FileNotFoundError:
        return None
    try:
        found = json.loads(data)
    except ValueError:  # not JSON, or not UTF-8 text at all
        raise Unreadable(f"{path.name} is not JSON", path) from None
    if not isinstance(found, dict):
        kind = {list: "list", str: "string", bool: "boolean", type(None): "null"}.get(type(found), "number")
        raise Unreadable(f"{path.name} holds a JSON {kind}, not an object", path)
    return found


def read_yaml_mapping(path: Path) -> Dict[str, Any]:
    """The YAML mapping ``path`` holds ({} for an empty file); FileNotFoundError where there is none,
    Unreadable for anything else."""
    try:
        text = read_bounded(path).decode()
    except UnicodeDecodeError:
        raise Unreadable(f"{path.name} is not text", path) from None
    try:
        found = yamlio.load(text)
    except yaml.YAMLError as e:  # a python/object tag, a syntax error, aliases past the bound
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise Unreadable(f"{path.name} is not a plain YAML mapping ({first})", path) from None
    if found is None:
        return {}
    if not isinstance(found, dict):
        raise Unreadable(f"{path.name} holds a YAML {type(found).__name__}, not a mapping", path)
    return found


def read_object_lines(path: Path) -> List[Dict[str, Any]]:
    """The JSON objects of a JSON-lines file, one a line; lines that are not one (junk, a line being
    written) are skipped. A file that is no regular file, or too large, is named on stderr and read as
    empty: the commands that show a run go on without it."""
    try:
        data = read_bounded(path, ROWS_MAX)
    except Unreadable as e:
        print(f"launcher: warning: {path}: {e}", file=sys.stderr)
        return []
    rows = []
    for line in data.decode(errors="replace").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows




def names_in(directory: Path) -> List[str]:
    """The names in ``directory`` (one listing; none where it does not exist)."""
    try:
        return os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return []


def put_json(path: Path, obj: Any) -> None:
    """A node-side record written by many ranks at once (each its own file), replaced whole (a reader
    sees the old or the new one) but not flushed: one create, one write and one rename each, no fsync
    per rank (thousands at once in one directory). A crash may lose it; the next attempt writes it
    again."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        f = open(tmp, "w")
    except FileNotFoundError:  # its folder (ranks/) not made yet
        path.parent.mkdir(parents=True, exist_ok=True)
        f = open(tmp, "w")
    with f:
        f.write(json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")
    os.replace(tmp, path)


def create_once(path: Path, text: str) -> bool:
    """``path`` written with ``text`` if it does not exist (False: it does; two processes sealing at
    once: one manifest, never a second over it). Flushed before it appears."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.seal")
    with open(tmp, "x") as f:
        f.write(text)
        f.flush()
        atomic.flush(f, path.parent)  # now, or with the batch it belongs to (atomic.deferred_sync)
    try:
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    except OSError:  # no hard links on this file system
        if path.exists():
            return False
        os.replace(tmp, path)
        return True
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)


def read_points(path: Path) -> Dict[str, Any]:
    """A sweep's per-point record, read once per version of the file (listing a sweep's runs asks for
    every point: the file is parsed once, not once per run)."""
    try:
        st = path.stat()
    except OSError:
        return {}
    return _points_at(str(path), st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=8)
def _points_at(path: str, mtime_ns: int, size: int) -> Dict[str, Any]:
    return atomic.read_json(path, {}) or {}


def file_sha256(path: Path) -> str:
    """sha256 of one file, streamed 1 MiB at a time (checkpoints may be far larger than memory)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


class SweepNames:
    """The sweep dir's names a run dir reads too (SweepDir has them)."""
    SHARED, POINTS = "shared", "points.json"
    SEALS = ".seals"  # <index>.json: each sealed run's mark (RunDir.seal_mark)
