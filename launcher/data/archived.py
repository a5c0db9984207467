"""A run's datasets in its archive (``data_manifest.json``, sealed with the run): what `launch` writes
(``record``: one entry per dataset of the blend, the absolute path it was read from and its
manifest as read at launch), what `launcher show` prints (``describe``), and what `launcher
reproduce` (every byte: ``hashes=True``) and `launcher resume` (sizes only) check before they
submit (``problems``: one line per changed file, naming it). Pure: no torch.
"""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Tuple

from launcher.data import checks
from launcher.data.manifest import MANIFEST, DatasetError, Manifest, verify

VERSION = 1


def record(tree: Any) -> Optional[Dict[str, Any]]:
    """What data_manifest.json holds for a valid resolved config, or None when it reads no dataset
    (data=synthetic). Read through checks.load: the manifests the launch checks read, once."""
    if not checks.uses_tokens(tree):
        return None
    datasets = []
    for s in checks.sources(tree):
        d = checks.load(s.path)
        datasets.append({"key": s.path_key, "path": d.path, "weight": s.weight if s.key != "data" else 1.0,
                         "manifest_sha256": d.sha256, "manifest": d.raw})
    return {"version": VERSION, "datasets": datasets}


def signature(tree: Any) -> Optional[Tuple[Any, ...]]:
    """What ``record`` depends on, cheaply (no JSON built): equal for two configs whose records are
    equal; None when the config reads no dataset."""
    if not checks.uses_tokens(tree):
        return None
    return tuple((s.key, s.weight, checks.load(s.path).path, checks.load(s.path).sha256) for s in checks.sources(tree))


def paths(tree: Any) -> List[str]:
    """The absolute dataset paths a config reads ([] for data=synthetic)."""
    if not checks.uses_tokens(tree):
        return []
    return [checks.absolute(s.path) for s in checks.sources(tree) if checks.given(s.path)]


def problems(archived: Optional[Dict[str, Any]], *, hashes: bool, only: Optional[Iterable[str]] = None) -> List[str]:
    """What changed in the archived run's datasets since its launch, one line per file naming it: a
    shard (or the tokenizer) missing, resized, or (``hashes``) of another content; the dataset's
    manifest.json replaced (the dataset prepared again). ``only``: the dataset paths to check (those
    the new job will read); None: all."""
    if not archived:
        return []
    wanted = set(only) if only is not None else None
    out: List[str] = []
    for entry in _entries(archived):
        root = Path(str(entry.get("path")))
        if wanted is not None and str(root) not in wanted:
            continue
        try:
            manifest = Manifest.from_json(entry.get("manifest"), root, where=f"data_manifest.json ({root})")
        except DatasetError as e:
            out.append(str(e))
            continue
        now = root / MANIFEST
        try:
            sha = hashlib.sha256(now.read_bytes()).hexdigest()
        except OSError as e:
            out.append(f"{now}: {e.strerror or 'unreadable'} (the dataset the run was launched with is gone)")
            continue
        if sha != entry.get("manifest_sha256"):
            out.append(f"{now}: differs from the manifest archived at launch (the dataset was prepared again)")
        out += verify(root, manifest, hashes=hashes)
    return out


def describe(archived: Optional[Dict[str, Any]]) -> List[str]:
    """One line per dataset for `launcher show`: path, weight, tokens per split, tokenizer sha256."""
    lines = []
    for entry in _entries(archived):
        m = _mapping(entry.get("manifest"))
        splits = {name: _mapping(s) for name, s in _mapping(m.get("splits")).items()}
        counts = ", ".join(f"{name} {_int(s.get('tokens')):,} tokens ({_int(s.get('documents')):,} documents)"
                           for name, s in splits.items())
        tok = _mapping(m.get("tokenizer"))
        weight = f"  weight {entry.get('weight')}" if str(entry.get("key", "")).startswith("data.blend") else ""
        sha = f"tokenizer sha256 {str(tok['sha256'])[:16]}" if tok.get("sha256") else "no tokenizer file"
        lines.append(f"{entry.get('path')}{weight}  {counts}  {sha} (vocab {tok.get('vocab_size')})")
    return lines


def _entries(archived: Any) -> List[Dict[str, Any]]:
    """The dataset entries of a data_manifest.json as read (a hand-edited one: its objects only)."""
    found = _mapping(archived).get("datasets")
    return [e for e in found if isinstance(e, dict)] if isinstance(found, list) else []


def _mapping(x: Any) -> Dict[str, Any]:
    return x if isinstance(x, dict) else {}


def _int(x: Any) -> int:
    return x if isinstance(x, int) and not isinstance(x, bool) else 0
