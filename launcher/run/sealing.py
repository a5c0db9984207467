"""RunDir's seal: manifest.json over every file, symlink, directory and checkpoint, every file then
read-only; verify compares a run dir with its manifest."""
from __future__ import annotations

import hashlib
import json
import os
import stat
import threading
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

from launcher.archive import atomic
from launcher.run.checkpoints import CheckpointDigests, checkpoint_problems
from launcher.run.io import (
    SweepNames,
    create_once,
    file_sha256,
    now_iso,
)


class Sealing:
    """A run's seal and its verification (a mixin of RunDir)."""

    # ---- seal ------------------------------------------------------------------------------------
    # The seal covers everything that can run or be resumed: every file (its sha256), symlink (as a
    # link: its target's text, never followed, wherever it points), directory (empty ones too) and
    # checkpoint of the run dir. Checkpoint files up to CHECKPOINT_HASHED_BYTES are hashed (each
    # checkpoint's own record checkpoint.json, meta.json, `latest`), larger ones named with their size
    # (checkpoint.json holds their sha256). A seal also leaves a mark beside the run dir
    # (<sweep>/.seals/<index>.json: when, and the manifest's sha256), so a manifest deleted or replaced
    # later is found, and the run is never sealed again over what changed.
    def _tree(self, trust_checkpoints: bool = False) -> Dict[str, Tuple[str, str]]:
        """rel -> (kind, digest) of everything in the run dir but manifest.json and wandb's late logs:
        ("file", sha256), ("link", target), ("dir", ""), ("other", ""); under checkpoints/, a file is
        ("checkpoint", "sha256:<hex>" or "bytes:<size>"). ``trust_checkpoints`` (the seal): a
        checkpoint file its checkpoint.json lists with this size takes its sha256 from there, unread
        (the committing rank hashed it; every rank's RNG file and done mark would be read again)."""
        ckpts = self._p(self.LATEST).parent.name + "/"
        known = CheckpointDigests(self._p(self.LATEST).parent) if trust_checkpoints else None
        out: Dict[str, Tuple[str, str]] = {}
        for rel, kind, entry in walk(self.path):
            if rel == self.MANIFEST or (kind == "file" and self._late_log(rel)):
                continue
            try:
                if kind == "file" and rel.startswith(ckpts):
                    size = entry.stat(follow_symlinks=False).st_size
                    sha = (known.get(rel[len(ckpts):], size) if known is not None else None) \
                        if size <= CHECKPOINT_HASHED_BYTES else None
                    out[rel] = ("checkpoint", f"sha256:{sha or file_sha256(Path(entry.path))}"
                                if size <= CHECKPOINT_HASHED_BYTES else f"bytes:{size}")
                elif kind == "file":
                    out[rel] = ("file", file_sha256(Path(entry.path)))
                elif kind == "link":
                    out[rel] = ("link", os.readlink(entry.path))
                else:
                    out[rel] = (kind, "")
            except FileNotFoundError:  # gone while walked (a write of an atomic file finishing)
                continue
        return out

    def _late_log(self, rel: str) -> bool:
        """wandb's own debug logs (wandb/<run>/logs/): its service process may still append to them
        after the run ended and was sealed; they are not run data."""
        parts = rel.split("/")
        return len(parts) > 2 and parts[0] == self.WANDB and "logs" in parts[1:-1]

    def _seal_mark(self) -> Path:
        return self.path.parent / SweepNames.SEALS / f"{self.path.name}.json"

    def seal_mark(self) -> Optional[Dict[str, Any]]:
        """The mark the run's seal left beside it (sealed, manifest_sha256), or None: never sealed
        (or reopened by ``launcher resume`` since)."""
        found = atomic.read_json(self._seal_mark())
        return found if isinstance(found, dict) and "due" not in found else None

    def _snapshot_digest(self) -> Optional[Dict[str, Any]]:
        """The shared code snapshot this run executes (outside the run dir): one digest of its tree."""
        path = self.snapshot().get("path")
        if not path or not Path(path).is_dir():
            return None
        return {"path": str(path), "sha256": snapshot_sha256(Path(path)), "digest": TREE_DIGEST}

    def held_at_end(self) -> Dict[str, str]:
        """rel -> sha256 of the records launch wrote that the job reads and never rewrites (the config,
        its overrides, seeds and plan, the run's record, the batch script): what the job's end passes
        to the seal made later (finish_in_job's due mark). Small files, read in milliseconds."""
        out: Dict[str, str] = {}
        for rel in (self.RUN, self.CONFIG, self.OVERRIDES, self.SEEDS, self.PLAN, self.SCRIPT):
            p = self._p(rel)
            try:
                st = os.lstat(p)
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode) and st.st_size <= HELD_AT_END_MAX_BYTES:
                out[rel] = file_sha256(p)
        return out

    def changed_since_end(self) -> List[str]:
        """The records the job's end held (its due mark) that differ now or are gone: a change made after
        the run read final and before its seal (empty: none, or no such mark)."""
        return self._changed_since(atomic.read_json(self._seal_mark()))

    def _changed_since(self, found: Any) -> List[str]:
        """changed_since_end, given the seal mark as read (``found``)."""
        held = found.get("held") if isinstance(found, dict) and "due" in found else None
        if not isinstance(held, dict) or not held:
            return []
        now = self.held_at_end()
        return sorted(rel for rel, digest in held.items() if now.get(rel) != digest)

    def seal(self) -> Dict[str, Any]:
        """manifest.json over everything in the run dir and the code snapshot's digest, then every file
        read-only (a symlink's target is never touched). Once: an existing manifest is never rewritten,
        and a run sealed before whose manifest is gone (its mark) is never sealed again, nor its status
        recorded (returns {}: a new seal would hide what changed; ``verify`` reports it)."""
        mpath = self._p(self.MANIFEST)
        existing = atomic.read_json(mpath)
        if existing:
            return existing
        if self._unsealed_since() or self.changed_since_end():
            return {}
        self.adopt_shared()  # a run that never started holds them too once sealed
        tree = self._tree(trust_checkpoints=True)
        manifest = {"run_dir": str(self.path), "sealed": now_iso(), "status": self.status().state.value,
                    "version": MANIFEST_VERSION,
                    "files": {rel: d for rel, (kind, d) in tree.items() if kind == "file"},
                    "links": {rel: d for rel, (kind, d) in tree.items() if kind == "link"},
                    "dirs": sorted(rel for rel, (kind, _) in tree.items() if kind == "dir"),
                    "special": {rel: kind for rel, (kind, _) in tree.items() if kind in ("other", "unreadable")},
                    "checkpoint_files": {rel: d for rel, (kind, d) in tree.items() if kind == "checkpoint"},
                    "snapshot": self._snapshot_digest(),
                    "checkpoints": [p.name for p in self.checkpoints()], "latest": self._latest_name()}
        text = json.dumps(manifest, indent=2, sort_keys=True, default=str) + "\n"
        if not create_once(mpath, text):  # another process sealed it first: its manifest stands
            return atomic.read_json(mpath) or {}
        atomic.write_json(self._seal_mark(), {"run_dir": str(self.path), "sealed": manifest["sealed"],
                                              "manifest_sha256": hashlib.sha256(text.encode()).hexdigest()})
        for _, kind, entry in walk(self.path):
            if kind == "file":
                os.chmod(entry.path, entry.stat(follow_symlinks=False).st_mode & ~0o222)
        return manifest

    def _latest_name(self) -> Optional[str]:
        p = self._p(self.LATEST)
        try:
            return p.read_text().strip() if p.is_file() and not p.is_symlink() else None
        except OSError:
            return None

    def _unsealed_since(self) -> bool:
        """Sealed once (its mark says so), and its manifest is gone."""
        return self.seal_mark() is not None and not self._p(self.MANIFEST).exists()

    def lost_seal(self) -> Optional[str]:
        """Why a run without its manifest was sealed or started all the same (its manifest, or its
        status.json, removed since: it must not read as pending), cheaply (nothing hashed); None when
        nothing says so."""
        if self._p(self.MANIFEST).exists():
            return None
        found = atomic.read_json(self._seal_mark())  # read once: the seal, or the due mark of the job's end
        if isinstance(found, dict) and "due" not in found:
            return f"{self.MANIFEST} missing: the run was sealed {found.get('sealed')} ({self._seal_mark()})"
        changed = self._changed_since(found)
        if changed:
            return (f"{', '.join(changed)} changed after the run ended and before its seal (the job held "
                    f"other bytes at its end: {self._seal_mark()}); the run is not sealed over it")
        if self._p(self.STATUS).exists():  # the usual case: what only a started job writes is not looked for
            return None
        started = self._started()
        if started:
            return f"{self.STATUS} missing although the run started ({', '.join(started)} exist)"
        return None

    def _started(self) -> List[str]:
        """What only a started job writes (after its first status): metrics, checkpoints, each rank's record,
        the nodes' topology, a rank's error. Any one left says the run started, whatever else was removed."""
        found = [n for n in (self.METRICS, self.LATEST) if os.path.lexists(self._p(n))]
        for pattern in (self.RANK, self.TOPOLOGY, self.RANK_ERROR):
            if not os.path.isdir(self.path / pattern.split("/")[0]):  # no folder, nothing to glob (a pending run)
                continue
            hits = self._glob(pattern, r="*", name="*", n="*")
            if hits:
                found.append(str(hits[0].relative_to(self.path)))
        return found

    def verify(self) -> List[str]:
        """What no longer matches the seal (empty = intact): a file, symlink, directory or checkpoint
        changed, missing or added, ``latest`` re-pointed, the code snapshot changed or holding a
        symlink; the manifest missing for a finished run or one sealed before (its mark), or not the
        one sealed; status.json missing for a run that started. An unfinished, unsealed run is intact
        by definition, and so is a finished one whose seal is due (seal_due: its job's end seals it)."""
        manifest = atomic.read_json(self._p(self.MANIFEST))
        mark = self.seal_mark()
        if not isinstance(manifest, dict) or not manifest:
            lost = self.lost_seal()
            if lost or not self.is_final():
                return [lost] if lost else []
            return [] if self.seal_due() else [f"{self.MANIFEST} missing for a finished run"]
        problems = []
        if mark is not None and mark.get("manifest_sha256") != file_sha256(self._p(self.MANIFEST)):
            problems.append(f"{self.MANIFEST} is not the manifest the run was sealed with {mark.get('sealed')}")
        names, latest = [p.name for p in self.checkpoints()], self._latest_name()
        if "links" in manifest:
            problems += tree_problems(sealed_tree(manifest), self._tree(), manifest, names, latest, self.LATEST)
        else:  # a manifest of an older launcher: files only (links followed), checkpoints by name
            now = self._legacy_files()
            sealed = manifest.get("files", {})
            problems += [f"{rel} changed" for rel, digest in sealed.items() if rel in now and now[rel] != digest]
            problems += [f"{rel} missing" for rel in sealed if rel not in now]
            problems += [f"{rel} added after the seal" for rel in now if rel not in sealed]
            problems += checkpoint_problems(manifest, names, latest)[0]
        snap = manifest.get("snapshot")
        if snap:
            path = Path(snap["path"])
            if not path.is_dir():
                problems.append(f"code snapshot {path} missing")
            else:
                digest, links = tree_digest(path)
                if snap.get("digest") != TREE_DIGEST:
                    digest = legacy_tree_sha256(path)
                if digest != snap["sha256"]:
                    problems.append(f"code snapshot {path} changed")
                problems += [f"code snapshot {path} holds a symlink {rel} -> {target} (a snapshot never does)"
                             for rel, target in links.items()]
        return problems

    def _legacy_files(self) -> Dict[str, str]:
        """The files a manifest of an older launcher hashed (symlinks followed; no checkpoint, no *.tmp)."""
        ckpts = self._p(self.LATEST).parent
        return {str(p.relative_to(self.path)): file_sha256(p) for p in sorted(self.path.rglob("*"))
                if p.is_file() and p.name != self.MANIFEST and not p.name.endswith(".tmp")
                and ckpts not in p.parents and not self._late_log(str(p.relative_to(self.path)))}


MANIFEST_VERSION = 2  # 2: symlinks, directories and checkpoint files sealed too (1: files only)
# A sweep's runs share one code snapshot (read-only, ~900 files for the launcher's own tree): hashing it was
# most of each seal's time, so a command sealing a sweep's runs (cancel, a settle, 9,000 runs: 220-380 s)
# hashed it once per run. The seal takes its digest once per process and SNAPSHOT_MEMO_S; `verify` always
# hashes it afresh, so a change made after a seal is still found.
SNAPSHOT_MEMO_S = 60.0
_snapshot_memo: Dict[Tuple[str, int, int], Tuple[float, str]] = {}
_snapshot_lock = threading.Lock()  # a cancel seals in threads: one of them hashes, the others wait for it


def snapshot_sha256(path: Path) -> str:
    """tree_sha256 of a code snapshot, taken once per process per SNAPSHOT_MEMO_S (the seal's)."""
    st = os.stat(path)
    key = (str(path), st.st_dev, st.st_ino)
    with _snapshot_lock:
        now = time.monotonic()
        hit = _snapshot_memo.get(key)
        if hit is not None and now - hit[0] < SNAPSHOT_MEMO_S:
            return hit[1]
        digest = tree_sha256(path)
        _snapshot_memo[key] = (now, digest)
        return digest


TREE_DIGEST = 2  # tree_sha256's scheme (2: files, symlinks as links, directories); 1: files only
CHECKPOINT_HASHED_BYTES = 1 << 20  # larger checkpoint files are sealed by size (checkpoint.json: their sha256)
HELD_AT_END_MAX_BYTES = 16 << 20  # a record larger than this is not held by digest at the job's end (a config is KBs)




def walk(root: Path) -> Iterator[Tuple[str, str, os.DirEntry]]:
    """Everything under ``root``, depth first and sorted, never following a symlink: (relative path,
    kind, entry), kind one of file, link, dir, other (a fifo, a socket), unreadable (a directory that
    cannot be listed). What vanishes while walked is left out."""
    def below(top: str, prefix: str) -> Iterator[Tuple[str, str, os.DirEntry]]:
        try:
            with os.scandir(top) as it:
                entries = sorted(it, key=lambda e: e.name)
        except (FileNotFoundError, NotADirectoryError):
            return
        for e in entries:
            rel = prefix + e.name
            try:
                kind = ("link" if e.is_symlink() else "dir" if e.is_dir(follow_symlinks=False)
                        else "file" if e.is_file(follow_symlinks=False) else "other")
            except FileNotFoundError:
                continue
            if kind == "dir":
                try:
                    os.scandir(e.path).close()
                except PermissionError:
                    kind = "unreadable"
            yield rel, kind, e
            if kind == "dir":
                yield from below(e.path, rel + "/")

    yield from below(str(root), "")


def tree_digest(root: Path) -> Tuple[str, Dict[str, str]]:
    """(tree_sha256 of ``root``, its symlinks: rel -> target)."""
    h = hashlib.sha256()
    links: Dict[str, str] = {}
    for rel, kind, entry in walk(root):
        name = os.fsencode(rel)
        if kind == "file":
            h.update(b"f\0" + name + b"\0" + file_sha256(Path(entry.path)).encode() + b"\n")
        elif kind == "link":
            links[rel] = os.readlink(entry.path)
            h.update(b"l\0" + name + b"\0" + os.fsencode(links[rel]) + b"\n")
        else:
            h.update(kind[0].encode() + b"\0" + name + b"\n")
    return h.hexdigest(), links




def tree_sha256(root: Path) -> str:
    """One digest of everything under ``root``: each file's relative path and content, each symlink's
    path and target (never followed), each directory's path."""
    return tree_digest(Path(root))[0]


def legacy_tree_sha256(root: Path) -> str:
    """tree_sha256 as an older launcher computed it (files only, symlinks followed): its manifests."""
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        if p.is_file():
            h.update(str(p.relative_to(root)).encode() + b"\0" + file_sha256(p).encode())
    return h.hexdigest()


_KIND = {"file": "file", "link": "symlink", "dir": "directory", "other": "special file",
         "unreadable": "unreadable directory", "checkpoint": "checkpoint file"}


def sealed_tree(manifest: Dict[str, Any]) -> Dict[str, Tuple[str, str]]:
    """What a manifest sealed, in RunDir._tree's shape."""
    out: Dict[str, Tuple[str, str]] = {rel: ("dir", "") for rel in manifest.get("dirs", [])}
    out.update({rel: (kind, "") for rel, kind in manifest.get("special", {}).items()})
    out.update({rel: ("file", d) for rel, d in manifest.get("files", {}).items()})
    out.update({rel: ("link", d) for rel, d in manifest.get("links", {}).items()})
    out.update({rel: ("checkpoint", d) for rel, d in manifest.get("checkpoint_files", {}).items()})
    return out


def tree_problems(sealed: Dict[str, Tuple[str, str]], now: Dict[str, Tuple[str, str]],
                   manifest: Dict[str, Any], names: List[str], latest: Optional[str],
                   latest_path: str) -> List[str]:
    """What differs between a sealed tree and the run dir now (``names``: its checkpoints, ``latest``:
    what checkpoints/latest (``latest_path``) names): one line per path, one per checkpoint added or missing (not one
    per file in it), one for ``latest`` re-pointed."""
    problems, whole = checkpoint_problems(manifest, names, latest)
    repointed = manifest.get("latest") != latest
    for rel in sorted(set(sealed) | set(now)):
        if any(rel == w or rel.startswith(w + "/") for w in whole) or (rel == latest_path and repointed):
            continue
        was, got = sealed.get(rel), now.get(rel)
        if was == got:
            continue
        if got is None:
            if not rel.endswith(".tmp"):  # an atomic write's temporary file, sealed as it was being renamed
                plain = was[0] in ("file", "checkpoint")
                problems.append(f"{rel} missing" + ("" if plain else f" (a {_KIND[was[0]]})"))
        elif was is None:
            what = "" if got[0] in ("file", "checkpoint") else f" (a {_KIND[got[0]]}" + (
                f" to {got[1]})" if got[0] == "link" else ")")
            problems.append(f"{rel} added after the seal{what}")
        elif was[0] != got[0]:
            problems.append(f"{rel} changed (a {_KIND[was[0]]} when sealed, a {_KIND[got[0]]} now)")
        elif got[0] == "link":
            problems.append(f"{rel} changed (a symlink to {got[1]}, sealed pointing to {was[1]})")
        else:
            problems.append(f"{rel} changed")
    return problems
