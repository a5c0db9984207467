"""A launch from a tree unchanged since this user's last snapshot of it links that snapshot's files (and
their bytecode) into the new snapshot instead of reading, scanning, copying and compiling them again:
the snapshot of a repo of a few hundred files cost ~0.3-0.5 s of every launch, most of a small sweep's.

Unchanged means: the same files (the snapshot's rule: launcher.archive.snapshot), each with the same
size, modification and change times, inode and mode (what git's index trusts), the same secret values
known to the launch (which decide the files left out: compared by an HMAC under this user's key, never
stored), the same recipe imports, and, where the last snapshot bundled the launcher's own packages, the
same files there. The entry naming the last snapshot lives in this user's cache, signed with the
user's key (``snapshot.cache_secret``): an entry planted or changed in a shared cache is ignored. A
snapshot is read-only once taken, so two snapshots sharing a file's inode cannot diverge; where a link
cannot be made (another file system, the old snapshot deleted) the tree is copied as before."""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Optional, Tuple

from launcher.archive import atomic
from launcher.archive.tree import INFO_FILE


def _entry_path(base: Path, root: Path) -> Path:
    return base / "snapshots" / f"{hashlib.sha256(os.path.realpath(root).encode()).hexdigest()[:32]}.json"


RACY_NS = 2_000_000_000  # a file changed this close to its stat may change again unseen (coarse timestamps)


def _stats(h: Any, top: str, rels: Iterable[str], since_ns: int) -> bool:
    """Each file's stats into ``h``; whether none changed after ``since_ns``."""
    settled = True
    for rel in rels:
        try:
            st = os.stat(os.path.join(top, rel))
        except OSError:
            h.update(f"{rel}\0missing\n".encode())
            continue
        settled &= max(st.st_mtime_ns, st.st_ctime_ns) < since_ns
        h.update(f"{rel}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ctime_ns}\0{st.st_ino}\0{st.st_mode}\n".encode())
    return settled


def fingerprint(root: Path, files: Iterable[str], known: Mapping[str, Any], imports: Iterable[str],
                secret: bytes) -> Tuple[str, bool]:
    """(what the snapshot of ``root`` depends on, as one digest of stats, not contents; whether it can be
    trusted later: no file changed within RACY_NS of now, as git's index distrusts a racily clean file
    whose next change could keep the same timestamps). Taken before the files are read."""
    h = hashlib.sha256(f"{root}\n".encode())
    settled = _stats(h, str(root), files, time.time_ns() - RACY_NS)
    values = "\0".join(f"{k}={v}" for k, v in sorted((str(k), str(v)) for k, v in known.items()))
    h.update(hmac.new(secret, values.encode(), hashlib.sha256).digest())
    h.update("\0".join(sorted(set(imports))).encode())
    return h.hexdigest(), settled


def bundled_fingerprint(dirs: Iterable[str]) -> str:
    """The same of the launcher's own packages a snapshot bundled (their files as they are now)."""
    h = hashlib.sha256()
    for top in sorted(dirs):
        h.update(f"{top}\n".encode())
        _stats(h, top, _walk(Path(top)), 0)
    return h.hexdigest()


def matches(entry: Mapping[str, Any], tree_fp: str) -> bool:
    """Whether the entry's snapshot was taken of this tree as it is now."""
    return entry.get("fingerprint") == tree_fp and \
        entry.get("bundled") == bundled_fingerprint(entry.get("bundled_dirs") or [])


def _walk(top: Path) -> List[str]:
    out = []
    for dirpath, dirnames, filenames in os.walk(top):
        dirnames.sort()
        out += [os.path.relpath(os.path.join(dirpath, f), top) for f in sorted(filenames)]
    return out


def _sign(secret: bytes, entry: Mapping[str, Any]) -> str:
    body = json.dumps({k: v for k, v in entry.items() if k != "sig"}, sort_keys=True)
    return hmac.new(secret, body.encode(), hashlib.sha256).hexdigest()


def previous(base: Optional[Path], root: Path, secret: Optional[bytes]) -> Optional[Dict[str, Any]]:
    """This user's entry for the last snapshot of ``root`` (its signature checked), or None."""
    if base is None or secret is None:
        return None
    entry = atomic.read_json(_entry_path(base, root))
    if not isinstance(entry, dict) or not hmac.compare_digest(str(entry.get("sig", "")), _sign(secret, entry)):
        return None
    return entry


def link_into(entry: Mapping[str, Any], tmp: Path, fresh: Iterable[str]) -> Optional[Dict[str, Any]]:
    """Hard links of every file of the entry's snapshot but the per-launch records (``fresh``, in its top
    dir: written anew) under ``tmp``; its description to build on, or None (``tmp`` removed) where the
    snapshot is gone or a link fails."""
    fresh = set(fresh)
    prev = Path(str(entry.get("dest", "")))
    info = atomic.read_json(prev / INFO_FILE)
    if not isinstance(info, dict) or info.get("sha256") != entry.get("sha256"):
        return None
    try:
        for dirpath, _dirs, filenames in os.walk(prev):
            rel = os.path.relpath(dirpath, prev)
            os.makedirs(os.path.join(tmp, rel), exist_ok=True)
            for f in filenames:
                if rel == "." and f in fresh:
                    continue
                os.link(os.path.join(dirpath, f), os.path.join(tmp, rel, f))
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        return None
    return info


def record(base: Optional[Path], root: Path, secret: Optional[bytes], entry: Dict[str, Any]) -> None:
    """Name ``entry["dest"]`` as the last snapshot of ``root`` (a cache that cannot be written costs
    only the next launch's copy)."""
    if base is None or secret is None:
        return
    try:
        atomic.write_json(_entry_path(base, root), {**entry, "sig": _sign(secret, entry)})
    except OSError:
        pass
