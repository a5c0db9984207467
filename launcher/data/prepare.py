"""`launcher data prepare`: text files -> a tokenized dataset (launcher/data/manifest.py's format).

Every input is read and checked first (an empty file, a bad JSONL line, a missing tokenizer: a
DatasetError naming the file and the fix before anything is written); then the tokenizer is trained
(byte-level BPE) or loaded, the documents are encoded by a pool of processes (one per core, each
running the Rust tokenizer on its own batches) and the shards are written aside and put in place
whole. Login-side: no torch; `tokenizers` and rich are imported only here, inside the functions.
"""
from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import json
import os
import sys
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np

from launcher.data.manifest import (
    DEFAULT_SHARD_TOKENS,
    DatasetError,
    DatasetWriter,
    Input,
    Manifest,
    Prepare,
    check_destination,
    dtype_for,
)

EOS = "<|endoftext|>"
# what ends a document with a given tokenizer: the first of these among its special tokens
# (most byte-level BPEs, Llama 3, Llama 2 / Mistral / T5, Gemma)
EOS_NAMES = (EOS, "<|end_of_text|>", "</s>", "<eos>")
DEFAULT_VOCAB_SIZE = 4096
DEFAULT_VAL_FRACTION = 0.01
BYTE_ALPHABET = 256  # the byte-level pre-tokenizer's initial alphabet
JSONL_SUFFIXES = (".jsonl", ".ndjson")
# documents go to the workers in batches of about this many characters; below twice this a
# corpus is encoded in this process (starting the pool would cost more than it saves)
_BATCH_CHARS = 1 << 20
_BATCH_DOCS = 4096


@dataclass(frozen=True)
class Source:
    """One input file, read and checked: its record and its documents."""
    input: Input
    docs: Tuple[str, ...]
    undecodable: bool  # held bytes that are not UTF-8 (read as U+FFFD)


def default_workers() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def expand(paths: Sequence[Union[str, Path]], glob: Union[str, Sequence[str], None] = None
           ) -> List[Tuple[Path, bool]]:
    """The input files in order, each with whether it was named itself (not found in a directory).
    A directory is walked recursively for the files whose name matches ``glob`` (one pattern or
    several; sorted)."""
    globs = [glob] if isinstance(glob, str) else list(glob or ())
    shown = " ".join(f"--glob {g!r}" for g in globs)
    out: List[Tuple[Path, bool]] = []
    dirs: List[Path] = []
    if not paths:
        raise DatasetError("no input files: give FILE... (text files, or .jsonl with a text field)")
    for given in paths:
        p = Path(given).expanduser()
        if p.is_dir():
            if not globs:
                raise DatasetError(f"{p}: is a directory; give --glob PATTERN to take the files in it "
                                   "(e.g. --glob '*.txt')")
            dirs.append(p)
            found = sorted(f for f in p.rglob("*") if any(fnmatch.fnmatch(f.name, g) for g in globs) and f.is_file())
            out += [(f.resolve(), False) for f in found]
        elif p.is_file():
            out.append((p.resolve(), True))
        elif p.exists():
            raise DatasetError(f"{p}: not a regular file (give text or .jsonl files)")
        else:
            raise DatasetError(f"{p}: no such file")
    seen: set = set()
    out = [(f, named) for f, named in out if not (f in seen or seen.add(f))]  # a file given twice is read once
    if dirs and not any(not named for _, named in out):
        raise DatasetError(f"{', '.join(map(str, dirs))}: no file under {'it' if len(dirs) == 1 else 'them'} "
                           f"matches {shown}")
    return out


def read_source(path: Path, text_field: str = "text", named: bool = True) -> Optional[Source]:
    """``path`` read and checked; None for an empty file found in a directory (one named itself
    is an error: it holds no documents)."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise DatasetError(f"{path}: cannot be read ({e.strerror}); fix its permissions or leave it out") from None
    try:
        text, undecodable = data.decode("utf-8"), False
    except UnicodeDecodeError:
        text, undecodable = data.decode("utf-8", errors="replace"), True
    fmt = "jsonl" if path.suffix.lower() in JSONL_SUFFIXES else "text"
    docs = _jsonl_docs(path, text, text_field) if fmt == "jsonl" else ((text,) if text.strip() else ())
    if not docs:
        if not named:
            return None
        what = f"no line with a non-empty {text_field!r}" if fmt == "jsonl" and text.strip() else "no text"
        raise DatasetError(f"{path}: empty ({what}): it holds no documents; leave it out")
    return Source(Input(path=str(path), size=len(data), sha256=hashlib.sha256(data).hexdigest(), format=fmt,
                        documents=len(docs)), docs, undecodable)


def _jsonl_docs(path: Path, text: str, field: str) -> Tuple[str, ...]:
    docs = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as e:
            raise DatasetError(f"{path}:{n}: not JSON ({e}); a .jsonl file holds one JSON object per line") from None
        if not isinstance(row, dict) or field not in row:
            keys = ", ".join(map(repr, row)) if isinstance(row, dict) else f"a {type(row).__name__}"
            raise DatasetError(f"{path}:{n}: no {field!r} field (it has {keys or 'no keys'}); "
                               "name the field with --text-field KEY")
        if not isinstance(row[field], str):
            raise DatasetError(f"{path}:{n}: {field!r} is {type(row[field]).__name__}, not text")
        if row[field]:
            docs.append(row[field])
    return tuple(docs)


def load_tokenizer(path: Union[str, Path]):
    """A local tokenizer.json and its EOS id (the first of EOS_NAMES among its special tokens)."""
    from tokenizers import Tokenizer

    p = Path(path).expanduser()
    if not p.is_file():
        raise DatasetError(f"--tokenizer {p}: {'is a directory' if p.is_dir() else 'no such file'}; "
                           "give a Hugging Face tokenizer.json file")
    try:
        text = p.read_text()
        json.loads(text)
        tok = Tokenizer.from_str(text)
    except Exception as e:  # OSError, ValueError (not JSON), and tokenizers' bare Exception (not a tokenizer)
        raise DatasetError(f"--tokenizer {p}: not a Hugging Face tokenizer JSON ({str(e)[:200]}); "
                           "give a tokenizer.json (tokenizers' Tokenizer.save)") from None
    special = {a.content: i for i, a in tok.get_added_tokens_decoder().items() if a.special}
    for name in EOS_NAMES:
        if name in special:
            return tok, int(special[name])
    have = f" (its special tokens: {', '.join(sorted(special, key=special.get))})" if special else ""
    raise DatasetError(f"--tokenizer {p}: has no end-of-document special token, none of "
                       f"{', '.join(EOS_NAMES)}{have}; add {EOS!r} as a special token")


def train_tokenizer(docs: Sequence[str], vocab_size: int, *, show_progress: bool = False):
    """A byte-level BPE tokenizer trained on ``docs``, EOS (id 0) its one special token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=show_progress,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(docs, trainer, length=len(docs))
    return tok, tok.token_to_id(EOS)


def is_val(doc: str, val_fraction: float) -> bool:
    """Whether ``doc`` belongs to the validation split: a pure function of its content."""
    h = int.from_bytes(hashlib.sha256(doc.encode("utf-8")).digest()[:8], "big")
    return h < val_fraction * 2.0 ** 64


# ------------------------------------------------------------------------------- encoding --

_worker = {}  # in each pool process: the tokenizer and what a batch needs


def _init_worker(tokenizer_json: str, eos_id: int, dtype: str, val_fraction: float) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process per core already
    from tokenizers import Tokenizer

    _worker.update(tok=Tokenizer.from_str(tokenizer_json), eos=eos_id, dtype=dtype, val=val_fraction)


def _encode(docs: Sequence[str]) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A batch encoded: its documents' ids concatenated, each followed by EOS; the documents'
    lengths (EOS included; 0 for one that encodes to nothing) and which go to val."""
    w = _worker
    encs = w["tok"].encode_batch_fast(list(docs), add_special_tokens=False)
    ids = [e.ids for e in encs]
    lengths = np.array([len(i) + 1 if i else 0 for i in ids], dtype=np.int64)
    flat: List[int] = []
    for i in ids:
        if i:
            flat.extend(i)
            flat.append(w["eos"])
    flat = np.array(flat, dtype=w["dtype"])
    val = np.array([is_val(d, w["val"]) for d in docs], dtype=bool)
    return flat, lengths, val


def _batches(docs: Sequence[str]) -> Iterator[Sequence[str]]:
    start, chars = 0, 0
    for i, d in enumerate(docs):
        chars += len(d)
        if chars >= _BATCH_CHARS or i + 1 - start >= _BATCH_DOCS:
            yield docs[start:i + 1]
            start, chars = i + 1, 0
    if start < len(docs):
        yield docs[start:]


def _encoded(docs: Sequence[str], workers: int, init: tuple) -> Iterator[Tuple[int, tuple]]:
    """(characters, _encode's result) per batch, in order; a pool of ``workers`` processes for a
    corpus worth it, this process otherwise."""
    batches = _batches(docs)
    if workers <= 1 or sum(map(len, docs)) < 2 * _BATCH_CHARS:
        _init_worker(*init)
        with _env(TOKENIZERS_PARALLELISM="true" if workers > 1 else "false"):
            for b in batches:
                yield sum(map(len, b)), _encode(b)
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    # spawn: a fresh process, never a fork of one whose Rust threads have run (tokenizers would
    # disable itself in the child)
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"), initializer=_init_worker,
                             initargs=init) as pool:
        window = deque()
        for b in batches:
            window.append((sum(map(len, b)), pool.submit(_encode, b)))
            if len(window) >= 2 * workers:
                n, f = window.popleft()
                yield n, f.result()
        while window:
            n, f = window.popleft()
            yield n, f.result()


@contextlib.contextmanager
def _env(**values: str) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# -------------------------------------------------------------------------------- prepare --

def prepare(files: Sequence[Union[str, Path]], out_dir: Union[str, Path], *, tokenizer: Optional[str] = None,
            vocab_size: Optional[int] = None, text_field: str = "text", val_fraction: float = DEFAULT_VAL_FRACTION,
            workers: Optional[int] = None, shard_tokens: int = DEFAULT_SHARD_TOKENS,
            glob: Union[str, Sequence[str], None] = None,
            progress: bool = True) -> Manifest:
    """Tokenize ``files`` into a dataset in ``out_dir`` (docs/data.md). ``tokenizer``: a local
    tokenizer.json to use (copied into the dataset); without one a byte-level BPE of ``vocab_size``
    is trained on the inputs. ``workers``: processes encoding (default: every core). ``glob``: the
    pattern(s) of the files taken from a directory among ``files``."""
    t0 = time.perf_counter()
    files = [files] if isinstance(files, (str, Path)) else files
    workers = default_workers() if workers is None else workers
    if workers < 1:
        raise DatasetError(f"--workers {workers}: must be at least 1")
    if not 0.0 <= val_fraction < 1.0:
        raise DatasetError(f"--val-fraction {val_fraction}: must be in [0, 1) (e.g. 0.01)")
    if shard_tokens < 1:
        raise DatasetError(f"--shard-tokens {shard_tokens}: must be at least 1")
    if tokenizer is not None and vocab_size is not None:
        raise DatasetError("--vocab-size sizes a tokenizer trained here; a --tokenizer file has its own vocabulary "
                           "(give one of them)")
    vocab_size = DEFAULT_VOCAB_SIZE if vocab_size is None else vocab_size
    if tokenizer is None and vocab_size < BYTE_ALPHABET + 1:
        raise DatasetError(f"--vocab-size {vocab_size}: a byte-level BPE needs at least {BYTE_ALPHABET + 1} "
                           f"(the {BYTE_ALPHABET} bytes and {EOS}); e.g. --vocab-size 4096")
    check_destination(out_dir)
    given = load_tokenizer(tokenizer) if tokenizer is not None else None
    ui = _Progress(progress)
    with ui:
        sources = _read_all(expand(files, glob), text_field, ui)
        docs = [d for s in sources for d in s.docs]
        if val_fraction > 0 and all(is_val(d, val_fraction) for d in docs):
            raise DatasetError(f"--val-fraction {val_fraction} puts every one of the {len(docs)} document(s) in the "
                               "val split, none in train; lower it (or give more documents)")
        with _env(TOKENIZERS_PARALLELISM="true" if workers > 1 else "false", RAYON_NUM_THREADS=str(workers)):
            if given is None:
                ui.phase(f"training a byte-level BPE tokenizer (vocab {vocab_size})")
                tok, eos_id = train_tokenizer(docs, vocab_size)
                kind, source = "byte-level-bpe", None
            else:
                (tok, eos_id), kind, source = given, "file", str(Path(tokenizer).expanduser().resolve())
        vocab = max(tok.get_vocab(with_added_tokens=True).values()) + 1  # ids need not be contiguous
        tok_json = Path(source).read_text() if source else tok.to_str()
        init = (tok.to_str(), eos_id, dtype_for(vocab), val_fraction)
        tokens = 0
        with DatasetWriter(out_dir, vocab_size=vocab, eos_id=eos_id, shard_tokens=shard_tokens) as writer:
            total = sum(map(len, docs))
            ui.phase("tokenizing", total=total)
            for chars, (flat, lengths, val) in _encoded(docs, workers, init):
                mask = np.repeat(val, lengths)
                writer.add("train", flat[~mask], lengths[~val])
                writer.add("val", flat[mask], lengths[val])
                tokens += len(flat)
                ui.advance(chars, tokens)
            seconds = time.perf_counter() - t0
            manifest = writer.finish(tokenizer_json=tok_json, tokenizer_kind=kind, tokenizer_source=source,
                                     inputs=[s.input for s in sources], text_field=text_field,
                                     val_fraction=val_fraction,
                                     prepare=Prepare(round(seconds, 3), round(tokens / max(seconds, 1e-9), 1),
                                                     workers))
    return manifest


def _read_all(files: List[Tuple[Path, bool]], text_field: str, ui: _Progress) -> List[Source]:
    ui.phase("reading", total=len(files))
    sources, empty = [], 0
    for path, named in files:
        s = read_source(path, text_field, named)
        if s is None:
            empty += 1
        else:
            sources.append(s)
        ui.advance(1)
    if not sources:
        raise DatasetError(f"the {len(files)} input file(s) are all empty: no documents to prepare")
    bad = [s.input.path for s in sources if s.undecodable]
    if bad:
        ui.note(f"{len(bad)} file(s) hold bytes that are not UTF-8, read as U+FFFD (e.g. {bad[0]})")
    if empty:
        ui.note(f"skipped {empty} empty file(s) found under the directories")
    return sources


class _Progress:
    """A rich progress bar on a terminal (stderr); silent otherwise or when turned off."""

    def __init__(self, enabled: bool):
        self.on = enabled and sys.stderr.isatty()
        self.bar = self.task = None
        self.since = time.perf_counter()

    def __enter__(self) -> _Progress:
        if self.on:
            from rich.console import Console
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

            self.bar = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[info]}"),
                                TimeElapsedColumn(), console=Console(stderr=True), transient=True)
            self.bar.start()
        return self

    def __exit__(self, *_) -> None:
        if self.bar is not None:
            self.bar.stop()

    def phase(self, what: str, total: Optional[float] = None) -> None:
        if self.bar is not None:
            if self.task is not None:
                self.bar.remove_task(self.task)
            self.task = self.bar.add_task(what, total=total, info="")
        self.since = time.perf_counter()

    def advance(self, n: float, tokens: int = 0) -> None:
        if self.bar is not None:
            seconds = time.perf_counter() - self.since
            info = f"{tokens:,} tokens, {tokens / seconds:,.0f}/s" if tokens and seconds > 0 else ""
            self.bar.update(self.task, advance=n, info=info)

    def note(self, line: str) -> None:
        if self.bar is not None:
            self.bar.console.print(f"launcher data prepare: {line}", highlight=False, markup=False)
        else:
            print(f"launcher data prepare: {line}", file=sys.stderr)
