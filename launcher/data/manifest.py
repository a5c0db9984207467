"""A prepared dataset's manifest: typed records, load, verify, and the writer (docs/data.md).

The format ("launcher-tokens/1"): DIR/manifest.json, DIR/tokenizer.json and content-hashed shards
DIR/shards/<split>-<sha16>.bin (token ids, documents concatenated, each followed by the EOS id) with
DIR/shards/<split>-<sha16>.idx (int64 document starts, n_documents + 1 entries). Pure: no torch; numpy
only where tokens are written (the writer imports it: reading a manifest, every `launcher` command, does not).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

if TYPE_CHECKING:
    import numpy as np

from launcher.archive import atomic

FORMAT = "launcher-tokens/1"
MANIFEST = "manifest.json"
TOKENIZER = "tokenizer.json"
SHARDS = "shards"
SPLITS = ("train", "val")
# a shard closes at a document boundary once it holds this many tokens (64 MiB of uint16)
DEFAULT_SHARD_TOKENS = 1 << 25
_CHUNK = 1 << 20  # bytes read at a time while hashing
# blend block (launcher.data.tokens): samples whose dataset assignment is computed (and cached) together;
# here, so the login-side checks read it without the reader (numpy)
BLOCK = 4096


class DatasetError(ValueError):
    """A dataset (or the input of one) that cannot be used: the message names the file and the fix."""


def dtype_for(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 65535 else "uint32"


@dataclass(frozen=True)
class Shard:
    bin: str             # relative to the dataset dir
    idx: str
    bin_size: int
    bin_sha256: str
    idx_size: int
    idx_sha256: str
    documents: int
    tokens: int          # EOS included


@dataclass(frozen=True)
class Split:
    documents: int
    tokens: int
    longest_document: int  # tokens, its EOS included
    shards: Tuple[Shard, ...] = ()


@dataclass(frozen=True)
class Tokenizer:
    file: Optional[str]   # relative to the dataset dir; None: a dataset written without one (tests)
    sha256: Optional[str]
    vocab_size: int
    eos_id: int
    kind: str             # "byte-level-bpe" (trained on the inputs) or "file" (--tokenizer)
    source: Optional[str]  # the --tokenizer path it was copied from


@dataclass(frozen=True)
class Input:
    path: str
    size: int
    sha256: str
    format: str           # "text" or "jsonl"
    documents: int


@dataclass(frozen=True)
class Prepare:
    seconds: float
    tokens_per_s: float
    workers: int


@dataclass(frozen=True)
class Manifest:
    dir: Path             # where it was loaded from or written to (not in the JSON)
    tokenizer: Tokenizer
    dtype: str            # numpy dtype name of the .bin files
    text_field: str
    val_fraction: float
    inputs: Tuple[Input, ...]
    splits: Mapping[str, Split]
    prepare: Prepare
    format: str = FORMAT

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    @property
    def eos_id(self) -> int:
        return self.tokenizer.eos_id

    def split(self, name: str) -> Split:
        try:
            return self.splits[name]
        except KeyError:
            raise DatasetError(f"{self.dir / MANIFEST}: no split {name!r} (it has {', '.join(self.splits)})") from None

    def to_json(self) -> Dict[str, Any]:
        """The manifest.json object, "format" first."""
        return {"format": self.format, "tokenizer": dataclasses.asdict(self.tokenizer), "dtype": self.dtype,
                "text_field": self.text_field, "val_fraction": self.val_fraction,
                "inputs": [dataclasses.asdict(i) for i in self.inputs],
                "splits": {name: {**dataclasses.asdict(s), "shards": [dataclasses.asdict(sh) for sh in s.shards]}
                           for name, s in self.splits.items()},
                "prepare": dataclasses.asdict(self.prepare)}

    @classmethod
    def load(cls, dir: Union[str, Path]) -> Manifest:
        """The manifest of the dataset in ``dir``; DatasetError naming the file and the key otherwise."""
        root = Path(dir).expanduser().resolve()
        path = root / MANIFEST
        if not root.is_dir():
            raise DatasetError(f"{root}: no such dataset directory "
                               "(make one with `launcher data prepare FILE... -o DIR`)")
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise DatasetError(f"{path}: missing: {root} is not a prepared dataset "
                               "(make one with `launcher data prepare FILE... -o DIR`)") from None
        except (OSError, ValueError) as e:
            raise DatasetError(f"{path}: not readable as JSON ({e}); prepare the dataset again") from None
        return cls.from_json(data, root, where=path)

    @classmethod
    def from_json(cls, data: Any, root: Path, where: Union[str, Path]) -> Manifest:
        r = _Reader(str(where))
        fmt = r.get(data, "format", str)
        if fmt != FORMAT:
            raise DatasetError(f"{where}: format {fmt!r} is not {FORMAT!r}; "
                               "prepare the dataset again with this launcher")
        tok = r.get(data, "tokenizer", dict)
        tokenizer = Tokenizer(file=r.get(tok, "file", (str, type(None)), "tokenizer"),
                              sha256=r.get(tok, "sha256", (str, type(None)), "tokenizer"),
                              vocab_size=r.get(tok, "vocab_size", int, "tokenizer"),
                              eos_id=r.get(tok, "eos_id", int, "tokenizer"),
                              kind=r.get(tok, "kind", str, "tokenizer"),
                              source=r.get(tok, "source", (str, type(None)), "tokenizer"))
        if tokenizer.file is not None:
            r.inside(tokenizer.file, "tokenizer.file")
        if not 0 <= tokenizer.eos_id < tokenizer.vocab_size:
            r.fail("tokenizer.eos_id", f"is {tokenizer.eos_id}, outside the vocabulary (0..{tokenizer.vocab_size - 1})")
        dtype = r.get(data, "dtype", str)
        if dtype != dtype_for(tokenizer.vocab_size):
            r.fail("dtype", f"is {dtype!r}; a vocabulary of {tokenizer.vocab_size} is stored as "
                   f"{dtype_for(tokenizer.vocab_size)!r}")
        inputs = tuple(Input(path=r.get(i, "path", str, f"inputs[{n}]"), size=r.get(i, "size", int, f"inputs[{n}]"),
                             sha256=r.get(i, "sha256", str, f"inputs[{n}]"),
                             format=r.get(i, "format", str, f"inputs[{n}]"),
                             documents=r.get(i, "documents", int, f"inputs[{n}]"))
                       for n, i in enumerate(r.get(data, "inputs", list)) if r.is_obj(i, f"inputs[{n}]"))
        splits = {}
        for name, s in r.get(data, "splits", dict).items():
            at = f"splits.{name}"
            r.is_obj(s, at)
            shards = tuple(Shard(**{f.name: r.get(sh, f.name, f.type == "str" and str or int, f"{at}.shards[{n}]")
                                    for f in dataclasses.fields(Shard)})
                           for n, sh in enumerate(r.get(s, "shards", list, at)) if r.is_obj(sh, f"{at}.shards[{n}]"))
            for n, sh in enumerate(shards):
                r.inside(sh.bin, f"{at}.shards[{n}].bin")
                r.inside(sh.idx, f"{at}.shards[{n}].idx")
            splits[name] = Split(documents=r.get(s, "documents", int, at), tokens=r.get(s, "tokens", int, at),
                                 longest_document=r.get(s, "longest_document", int, at), shards=shards)
            held = sum(sh.tokens for sh in shards)
            if held != splits[name].tokens:
                r.fail(f"{at}.tokens", f"is {splits[name].tokens}, but its shards hold {held}")
        if "train" not in splits:
            r.fail("splits.train", "missing")
        p = r.get(data, "prepare", dict)
        prepare = Prepare(seconds=float(r.get(p, "seconds", (int, float), "prepare")),
                          tokens_per_s=float(r.get(p, "tokens_per_s", (int, float), "prepare")),
                          workers=r.get(p, "workers", int, "prepare"))
        return cls(dir=root, tokenizer=tokenizer, dtype=dtype, text_field=r.get(data, "text_field", str),
                   val_fraction=float(r.get(data, "val_fraction", (int, float))), inputs=inputs, splits=splits,
                   prepare=prepare, format=fmt)


class _Reader:
    """Typed reads of the manifest's JSON, each failure naming the file and the dotted key."""

    def __init__(self, where: str):
        self.where = where

    def fail(self, key: str, problem: str) -> None:
        raise DatasetError(f"{self.where}: key {key!r} {problem}; prepare the dataset again")

    def inside(self, rel: str, at: str) -> None:
        """A file the manifest names lies inside the dataset dir (a loader reads what it names)."""
        if Path(rel).is_absolute() or ".." in Path(rel).parts or not rel:
            self.fail(at, f"is {rel!r}, not a path inside the dataset directory")

    def is_obj(self, obj: Any, at: str) -> bool:
        if not isinstance(obj, dict):
            self.fail(at, f"is {type(obj).__name__}, expected an object")
        return True

    def get(self, obj: Dict[str, Any], key: str, types: Any, at: str = "") -> Any:
        dotted = f"{at}.{key}" if at else key
        if key not in obj:
            self.fail(dotted, "missing")
        value = obj[key]
        types = types if isinstance(types, tuple) else (types,)
        if isinstance(value, bool) and bool not in types or not isinstance(value, types):
            names = " or ".join("null" if t is type(None) else t.__name__ for t in types)
            self.fail(dotted, f"is {value!r}, expected {names}")
        if isinstance(value, int) and not isinstance(value, bool) and value < 0:
            self.fail(dotted, f"is {value}, expected >= 0")
        return value


def file_sha256(path: Union[str, Path]) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(_CHUNK), b""):
            h.update(block)
    return h.hexdigest()


def verify(dir: Union[str, Path], manifest: Optional[Manifest] = None, *, hashes: bool = True) -> List[str]:
    """Every problem of the dataset in ``dir`` as one line naming the file (missing, size differs,
    sha256 differs); [] when intact. ``hashes=False``: sizes only (fast: no file is read)."""
    root = Path(dir).expanduser().resolve()
    if manifest is None:
        try:
            manifest = Manifest.load(root)
        except DatasetError as e:
            return [str(e)]
    problems: List[str] = []
    files: List[Tuple[str, Optional[int], Optional[str]]] = []
    if manifest.tokenizer.file is not None:
        files.append((manifest.tokenizer.file, None, manifest.tokenizer.sha256))
    for split in manifest.splits.values():
        for sh in split.shards:
            files += [(sh.bin, sh.bin_size, sh.bin_sha256), (sh.idx, sh.idx_size, sh.idx_sha256)]
    for rel, size, sha in files:
        path = root / rel
        try:
            actual = path.stat().st_size
        except FileNotFoundError:
            problems.append(f"{path}: missing (the manifest lists it)")
            continue
        except OSError as e:
            problems.append(f"{path}: unreadable ({e.strerror})")
            continue
        if size is not None and actual != size:
            problems.append(f"{path}: size {actual} bytes differs from the manifest's {size}")
        elif hashes and sha is not None:
            try:
                digest = file_sha256(path)
            except OSError as e:
                problems.append(f"{path}: unreadable ({e.strerror})")
                continue
            if digest != sha:
                problems.append(f"{path}: sha256 {digest[:16]}... differs from the manifest's {sha[:16]}... "
                                "(changed after it was prepared)")
    return problems


def is_dataset(dir: Union[str, Path]) -> bool:
    """``dir`` holds a manifest of this format (so prepare may replace it as a whole)."""
    try:
        data = json.loads((Path(dir) / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and data.get("format") == FORMAT


def check_destination(out_dir: Union[str, Path]) -> Path:
    """``out_dir`` resolved, where a dataset may be written: absent, empty, or a dataset (replaced
    whole); DatasetError for anything else (a file, a directory holding other things)."""
    out = Path(out_dir).expanduser().resolve()
    if out.is_dir():
        if any(out.iterdir()) and not is_dataset(out):
            raise DatasetError(f"-o {out}: the directory holds files and is not a prepared dataset; "
                               "give a new or empty directory")
    elif out.exists():
        raise DatasetError(f"-o {out}: is a file, not a directory; give a new or empty directory")
    return out


class DatasetWriter:
    """Writes a dataset aside (a hidden directory next to ``out_dir``) and puts it in place whole on
    ``finish``: a reader of ``out_dir`` sees the old dataset or the new one, never a mix. ``add`` takes
    documents already tokenized, concatenated with their EOS ids, and their lengths; shards close at a
    document boundary once they hold ``shard_tokens``. Use as a context manager: an error removes
    what was written aside."""

    def __init__(self, out_dir: Union[str, Path], *, vocab_size: int, eos_id: int,
                 shard_tokens: int = DEFAULT_SHARD_TOKENS):
        import numpy as np  # only where tokens are written
        if vocab_size < 1 or not 0 <= eos_id < vocab_size:
            raise DatasetError(f"eos_id {eos_id} lies outside the vocabulary of {vocab_size}")
        if shard_tokens < 1:
            raise DatasetError(f"--shard-tokens {shard_tokens}: must be at least 1")
        self.out = check_destination(out_dir)
        self.vocab_size, self.eos_id, self.shard_tokens = vocab_size, eos_id, shard_tokens
        self.dtype = np.dtype(dtype_for(vocab_size))
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.stage = Path(tempfile.mkdtemp(dir=self.out.parent, prefix=f".{self.out.name}.prepare-"))
        # mkdtemp makes it 0700: the dataset, once in place, is as readable as any directory the user makes
        # (the umask's), so teammates and the jobs of other accounts can train on it
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(self.stage, 0o777 & ~umask)
        (self.stage / SHARDS).mkdir()
        self._shards: Dict[str, List[Shard]] = {s: [] for s in SPLITS}
        self._longest: Dict[str, int] = {s: 0 for s in SPLITS}
        self._open: Dict[str, Optional[_OpenShard]] = {s: None for s in SPLITS}

    def __enter__(self) -> DatasetWriter:
        return self

    def __exit__(self, kind, *_) -> None:
        if kind is not None:
            self.abort()

    def abort(self) -> None:
        for shard in self._open.values():
            if shard is not None:
                shard.f.close()
        shutil.rmtree(self.stage, ignore_errors=True)

    def add(self, split: str, tokens: np.ndarray, lengths: np.ndarray) -> None:
        import numpy as np  # only where tokens are written
        if split not in SPLITS:
            raise DatasetError(f"split {split!r}: a dataset has the splits {', '.join(SPLITS)}")
        lengths = np.asarray(lengths, dtype=np.int64)
        lengths = lengths[lengths > 0]
        tokens = np.asarray(tokens)
        if int(lengths.sum()) != len(tokens):
            raise DatasetError(f"{len(tokens)} tokens given with document lengths summing to {int(lengths.sum())}")
        if not len(tokens):
            return
        low, high = int(tokens.min()), int(tokens.max())
        if low < 0 or high >= self.vocab_size:
            raise DatasetError(f"token id {low if low < 0 else high} lies outside the vocabulary of {self.vocab_size}")
        self._longest[split] = max(self._longest[split], int(lengths.max()))
        tokens = tokens.astype(self.dtype, copy=False)
        ends = np.cumsum(lengths)
        start_doc, start_tok = 0, 0
        while start_doc < len(lengths):
            shard = self._open[split] or self._new_shard(split)
            room = self.shard_tokens - shard.tokens
            # the documents that fit the shard's room (at least one when the shard is empty)
            stop = int(np.searchsorted(ends, start_tok + room, side="right"))
            if stop == start_doc and shard.tokens == 0:
                stop = start_doc + 1
            if stop > start_doc:
                end_tok = int(ends[stop - 1])
                shard.write(tokens[start_tok:end_tok], lengths[start_doc:stop])
                start_doc, start_tok = stop, end_tok
            if start_doc < len(lengths) or shard.tokens >= self.shard_tokens:
                self._close(split)

    def _new_shard(self, split: str) -> _OpenShard:
        n = len(self._shards[split])
        self._open[split] = _OpenShard(self.stage / SHARDS / f".{split}-{n}.bin.tmp")
        return self._open[split]

    def _close(self, split: str) -> None:
        import numpy as np  # only where tokens are written
        shard, self._open[split] = self._open[split], None
        if shard is None or shard.tokens == 0:
            return
        shard.f.close()
        bin_sha = shard.sha.hexdigest()
        name = f"{split}-{bin_sha[:16]}"
        idx = np.concatenate([[0], np.cumsum(np.concatenate(shard.lengths))]).astype("<i8").tobytes()
        bin_rel, idx_rel = f"{SHARDS}/{name}.bin", f"{SHARDS}/{name}.idx"
        if (self.stage / bin_rel).exists():  # the same tokens twice: one file serves both entries
            shard.path.unlink()
            if hashlib.sha256(idx).hexdigest() != file_sha256(self.stage / idx_rel):
                raise DatasetError(f"two {split} shards hold the same tokens split into different documents; "
                                   "prepare again with another --shard-tokens")
        else:
            os.replace(shard.path, self.stage / bin_rel)
            (self.stage / idx_rel).write_bytes(idx)
        self._shards[split].append(Shard(bin=bin_rel, idx=idx_rel, bin_size=shard.tokens * self.dtype.itemsize,
                                         bin_sha256=bin_sha, idx_size=len(idx),
                                         idx_sha256=hashlib.sha256(idx).hexdigest(),
                                         documents=sum(len(x) for x in shard.lengths), tokens=shard.tokens))

    def finish(self, *, tokenizer_json: Optional[str] = None, tokenizer_kind: str = "byte-level-bpe",
               tokenizer_source: Optional[str] = None, inputs: Iterable[Input] = (), text_field: str = "text",
               val_fraction: float = 0.0, prepare: Optional[Prepare] = None) -> Manifest:
        """Closes the shards, writes the tokenizer and (last) the manifest, and renames the whole into
        place (an old dataset there is replaced whole)."""
        for split in SPLITS:
            self._close(split)
        tok_file = tok_sha = None
        if tokenizer_json is not None:
            text = tokenizer_json if tokenizer_json.lstrip().startswith("{") else Path(tokenizer_json).read_text()
            (self.stage / TOKENIZER).write_text(text)
            tok_file, tok_sha = TOKENIZER, file_sha256(self.stage / TOKENIZER)
        splits = {s: Split(documents=sum(sh.documents for sh in self._shards[s]),
                           tokens=sum(sh.tokens for sh in self._shards[s]), longest_document=self._longest[s],
                           shards=tuple(self._shards[s])) for s in SPLITS}
        manifest = Manifest(dir=self.out, tokenizer=Tokenizer(file=tok_file, sha256=tok_sha, vocab_size=self.vocab_size,
                                                              eos_id=self.eos_id, kind=tokenizer_kind,
                                                              source=tokenizer_source),
                            dtype=self.dtype.name, text_field=text_field, val_fraction=float(val_fraction),
                            inputs=tuple(inputs), splits=splits, prepare=prepare or Prepare(0.0, 0.0, 1))
        atomic.sync_filesystems({str(self.stage)})  # the shards on disk before the manifest names them
        atomic.write_text(self.stage / MANIFEST, json.dumps(manifest.to_json(), indent=2) + "\n")
        self._put_in_place()
        return manifest

    def _put_in_place(self) -> None:
        check_destination(self.out)  # again: something may have appeared there meanwhile
        old = None
        if self.out.is_dir():
            if any(self.out.iterdir()):
                old = Path(tempfile.mkdtemp(dir=self.out.parent, prefix=f".{self.out.name}.old-"))
                os.replace(self.out, old)
            else:
                self.out.rmdir()
        os.replace(self.stage, self.out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


class _OpenShard:
    def __init__(self, path: Path):
        self.path, self.f, self.sha = path, open(path, "wb"), hashlib.sha256()
        self.tokens, self.lengths = 0, []

    def write(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        data = tokens.astype(tokens.dtype.newbyteorder("<"), copy=False).tobytes()
        self.f.write(data)
        self.sha.update(data)
        self.tokens += len(tokens)
        self.lengths.append(lengths)


def write_dataset(out_dir: Union[str, Path], docs_by_split: Mapping[str, Iterable[Sequence[int]]], *,
                  vocab_size: int, eos_id: int, tokenizer_json: Optional[str] = None,
                  inputs: Iterable[Input] = (), text_field: str = "text", val_fraction: float = 0.0,
                  tokenizer_kind: str = "byte-level-bpe", tokenizer_source: Optional[str] = None,
                  prepare: Optional[Prepare] = None, shard_tokens: int = DEFAULT_SHARD_TOKENS) -> Manifest:
    """A dataset of documents already tokenized (without their EOS: it is appended here; empty
    documents are skipped). ``tokenizer_json``: the tokenizer's JSON text, or the path of a
    tokenizer.json to copy; None writes none (a dataset for tests)."""
    import numpy as np  # only where tokens are written

    with DatasetWriter(out_dir, vocab_size=vocab_size, eos_id=eos_id, shard_tokens=shard_tokens) as w:
        for split, docs in docs_by_split.items():
            batch: List[np.ndarray] = []
            for doc in docs:
                doc = np.asarray(doc, dtype=np.int64)
                if len(doc):
                    batch.append(np.append(doc, eos_id))
                if len(batch) >= 4096:
                    w.add(split, np.concatenate(batch), np.array([len(d) for d in batch]))
                    batch = []
            if batch:
                w.add(split, np.concatenate(batch), np.array([len(d) for d in batch]))
        return w.finish(tokenizer_json=tokenizer_json, tokenizer_kind=tokenizer_kind,
                        tokenizer_source=tokenizer_source, inputs=inputs, text_field=text_field,
                        val_fraction=val_fraction, prepare=prepare)
