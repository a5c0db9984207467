"""What ``data=tokens`` is checked for before anything queues: the rows of the rule table read these
(launcher.config.rules: path, blend, seq_len against the documents, eval against the val split; a recipe's
contract: its model's vocabulary against the tokenizer's). Each finder returns (key, problem) pairs, one per
offending key (``data.path``, ``data.blend[1].weight``, ``model.seq_len``, ...).

The manifests are read on the login side, cheaply: manifest.json only (sizes and counts; no shard is
opened, none hashed), once per file version however many rows and sweep points ask
(``load``). Pure: no torch.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from launcher.data.manifest import BLOCK, MANIFEST, DatasetError, Manifest

TOKENS = "tokens"  # the data option whose datasets these checks read (conf/data/tokens.yaml)
PREPARE = "`launcher data prepare FILE... -o DIR`"


@dataclass(frozen=True)
class Loaded:
    """A dataset's manifest as read at launch: typed, the sha256 of manifest.json's bytes, its JSON."""

    path: str  # the dataset dir, absolute
    manifest: Manifest
    sha256: str
    raw: Dict[str, Any]


@dataclass(frozen=True)
class Source:
    """One dataset a config names: its key (``data`` or ``data.blend[i]``), its path as given, its weight."""

    key: str
    path: Any
    weight: Any = 1.0

    @property
    def path_key(self) -> str:
        return f"{self.key}.path"


def _data(tree: Any) -> Dict[str, Any]:
    node = tree.get("data") if isinstance(tree, dict) else None
    return node if isinstance(node, dict) else {}


def uses_tokens(tree: Any) -> bool:
    return _data(tree).get("name") == TOKENS


def sources(tree: Any) -> List[Source]:
    """The datasets the config's ``data`` names: its ``blend`` when non-empty, else its ``path`` (as
    launcher.data.tokens reads them)."""
    data = _data(tree)
    blend = data.get("blend") or []
    if isinstance(blend, list) and blend:
        return [Source(f"data.blend[{i}]", b.get("path") if isinstance(b, dict) else None,
                       b.get("weight", 1.0) if isinstance(b, dict) else None) for i, b in enumerate(blend)]
    return [Source("data", data.get("path"))]


def given(path: Any) -> bool:
    return isinstance(path, str) and path not in ("", "???")


def absolute(path: str) -> str:
    """A dataset path as the job must read it: absolute (the job runs in its run dir's work/)."""
    return os.path.abspath(os.path.expanduser(path))


def make_absolute(tree: Any) -> None:
    """A valid config's dataset paths made absolute in place (as archived and as the job reads them)."""
    data = _data(tree)
    if not uses_tokens(tree):
        return
    if given(data.get("path")):
        data["path"] = absolute(data["path"])
    for entry in data.get("blend") or []:
        if isinstance(entry, dict) and given(entry.get("path")):
            entry["path"] = absolute(entry["path"])


def load(path: str) -> Loaded:
    """The dataset at ``path`` (DatasetError naming the file otherwise), read once per version of its
    manifest.json."""
    root = absolute(path)
    try:
        st = os.stat(os.path.join(root, MANIFEST))
        stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
    except OSError:
        stamp = None
    return _load(root, stamp)


@lru_cache(maxsize=64)
def _load(root: str, stamp: Any) -> Loaded:
    manifest = Manifest.load(root)  # names the dir or the file, and the fix
    data = (Path(root) / MANIFEST).read_bytes()
    return Loaded(str(manifest.dir), manifest, hashlib.sha256(data).hexdigest(), json.loads(data))


def _loaded(tree: Any) -> List[Tuple[Source, Loaded]]:
    """The datasets of a ``data=tokens`` config that load (the others are path_problems')."""
    out = []
    if not uses_tokens(tree):
        return out
    for s in sources(tree):
        if given(s.path):
            try:
                out.append((s, load(s.path)))
            except DatasetError:
                continue
    return out


# ---- the finders the rule rows read ---------------------------------------------------------------

def path_problems(tree: Any) -> List[Tuple[str, str]]:
    """A dataset path missing, not a prepared dataset (no manifest), or its manifest unreadable."""
    if not uses_tokens(tree):
        return []
    out = []
    for s in sources(tree):
        if not given(s.path):
            if s.key == "data":
                out.append(("data.path", "data=tokens needs a prepared dataset, and none is given"))
            else:
                out.append((s.path_key, "a blend entry needs the path of a prepared dataset"))
            continue
        try:
            load(s.path)
        except DatasetError as e:
            out.append((s.path_key, str(e)))
    return out


def unread_problems(tree: Any) -> List[Tuple[str, str]]:
    """``data.path`` / ``data.blend`` set for a data option that reads neither (data=synthetic)."""
    data = _data(tree)
    if uses_tokens(tree) or not data:
        return []
    name = data.get("name")
    return [(f"data.{k}", f"is set, but data={name} never reads it: the run would train on the {name} data")
            for k in ("path", "blend") if (given(data.get(k)) if k == "path" else bool(data.get(k)))]


def weight_problems(tree: Any) -> List[Tuple[str, str]]:
    """A blend weight that is not a positive finite number, or too small a share to be sampled."""
    if not uses_tokens(tree):
        return []
    blend = [s for s in sources(tree) if s.key != "data"]
    out, good = [], []
    for s in blend:
        w = s.weight
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w <= 0:
            out.append((f"{s.key}.weight", f"is {w!r}: a blend weight must be a number > 0 (its relative share of "
                        "the samples)"))
        else:
            good.append((s, float(w)))
    if not out and len(good) > 1:
        total = sum(w for _, w in good)
        out += [(f"{s.key}.weight", f"is {w:g} of a total {total:g}: less than 1/{BLOCK} of the samples, "
                 f"too small a share for the blend to draw (launcher.data.tokens.BLOCK)")
                for s, w in good if w * BLOCK < total]
    return out


def seq_len_of(f: Any) -> Optional[Tuple[str, int]]:
    """(key, value) of the run's sequence length, as its recipe declares it: its facts' ``seq_len``
    (``Facts.model``), named by the config key of a group that holds that value (``model.seq_len``,
    or another group's: ``lm.seq_len``); else the config's ``model.seq_len``; None for a recipe that
    declares none."""
    v = getattr(getattr(f, "model", None), "seq_len", None)
    flat = f.values.flat if f.values.tree else {}
    if _count(v):
        if flat.get("model.seq_len") == v:  # the usual case, without sorting every key
            return "model.seq_len", v
        keys = sorted(k for k in flat if k.count(".") == 1 and k.endswith(".seq_len"))
        return next((k for k in keys if flat.get(k) == v), "model.seq_len"), v
    v = flat.get("model.seq_len")
    return ("model.seq_len", v) if _count(v) else None


def _count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def sample_problems(f: Any) -> List[Tuple[str, str]]:
    """A train split with no sample of seq_len+1 tokens: with packing off, no document that long (the
    manifest's ``longest_document``); with packing on, fewer tokens than that in the whole split."""
    tree = f.values.tree
    found = seq_len_of(f)
    if found is None:
        return []
    key, seq_len = found
    packing = _data(tree).get("packing", True) is not False
    out = []
    for s, d in _loaded(tree):
        train = d.manifest.splits.get("train")
        if train is None:
            continue
        if not packing and train.longest_document < seq_len + 1:
            out.append((key, f"{seq_len} needs documents of seq_len+1 = {seq_len + 1} tokens with "
                        f"data.packing=false, but the longest train document of {d.path} ({s.path_key}) has "
                        f"{train.longest_document}: every document would be skipped"))
        elif packing and train.tokens < seq_len + 1:
            out.append((key, f"{seq_len} needs seq_len+1 = {seq_len + 1} tokens, but the train split of "
                        f"{d.path} ({s.path_key}) holds {train.tokens}"))
    return out


def sample_fix(f: Any) -> str:
    found = seq_len_of(f)
    loaded = _loaded(f.values.tree)
    if found is None or not loaded:
        return "set data.packing=true or a shorter seq_len"
    key = found[0]
    if _data(f.values.tree).get("packing", True) is False:
        longest = min((d.manifest.splits["train"].longest_document for _, d in loaded
                       if "train" in d.manifest.splits), default=2)
        return (f"set data.packing=true (documents packed into windows), or {key}={max(1, longest - 1)} or less")
    tokens = min((d.manifest.splits["train"].tokens for _, d in loaded if "train" in d.manifest.splits), default=2)
    return f"set {key}={max(1, tokens - 1)} or less, or prepare more text into the dataset"


def eval_problems(f: Any) -> List[Tuple[str, str]]:
    """Eval asked for (``data.eval_every`` > 0) on a dataset whose val split has no sample: no
    document (``val_fraction`` 0, or the split came out empty), or none of seq_len+1 tokens."""
    tree = f.values.tree
    seq_len = (seq_len_of(f) or (None, None))[1]
    every = _data(tree).get("eval_every")
    if not isinstance(every, int) or isinstance(every, bool) or every <= 0:
        return []
    packing = _data(tree).get("packing", True) is not False
    out = []
    for s, d in _loaded(tree):
        val = d.manifest.splits.get("val")
        if val is None or val.documents == 0:
            out.append(("data.eval_every", f"{every} evaluates on the val split, but the val split "
                        f"of {d.path} ({s.path_key}) has 0 documents"))
        elif seq_len is not None and not packing and val.longest_document < seq_len + 1:
            out.append(("data.eval_every", f"{every} evaluates on the val split, but no val document "
                        f"of {d.path} ({s.path_key}) has seq_len+1 = {seq_len + 1} tokens (the longest has "
                        f"{val.longest_document}; data.packing=false)"))
        elif seq_len is not None and packing and val.tokens < seq_len + 1:
            out.append(("data.eval_every", f"{every} evaluates on the val split, but the val split of "
                        f"{d.path} ({s.path_key}) holds {val.tokens} tokens, fewer than seq_len+1 = {seq_len + 1}"))
    return out


def vocab_or(default: Any, multiple: Any = 1, *, _root_: Any = None) -> int:
    """A model option's vocabulary (``${data_vocab_or:512,${oc.select:parallelism.tp,1}}``): a data=tokens
    run's, from its datasets' manifests (the largest tokenizer among them), rounded up to a multiple of
    ``multiple`` (a vocab-parallel embedding splits it over tp); ``default`` for other data, or
    where no dataset loads (path_problems name it). A value the user sets replaces it; one smaller than
    the tokenizer's is refused (the recipes' vocab_size rows)."""
    from omegaconf import OmegaConf

    data = _root_.get("data") if _root_ is not None and hasattr(_root_, "get") else None
    if data is None:
        return int(default)
    tree = {"data": OmegaConf.to_container(data, resolve=True) if OmegaConf.is_config(data) else data}
    found = tokenizer_vocab(tree)
    if found is None:
        return int(default)
    step = max(1, int(multiple or 1))
    return -(-int(found[0]) // step) * step


def tokenizer_vocab(tree: Any) -> Optional[Tuple[int, str]]:
    """The largest tokenizer vocabulary among the config's datasets, and the dataset that has it."""
    found = [(d.manifest.vocab_size, d.path) for _, d in _loaded(tree)]
    return max(found) if found else None
