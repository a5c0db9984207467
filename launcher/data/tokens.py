"""Training samples from prepared token datasets (``launcher data prepare``), for any recipe.

A split of one dataset (``Windows``) is a list of windows of ``seq_len + 1`` tokens read from its
memory-mapped shards (never read whole):

- packing=true: the split's documents (each ending in EOS) as one stream; window ``w`` starts at
  token ``w * seq_len`` (consecutive windows share one token, so every token is a label once);
- packing=false: one window per document of at least ``seq_len + 1`` tokens (shorter ones are
  skipped), its first ``seq_len + 1`` tokens.

``TokenDataset`` samples one or several such splits (a blend, by weight). Sample ``i`` is a pure
function of ``(seed, i)``:

- the blend cuts the sample indices into blocks of ``block`` samples; the number of samples of
  dataset ``d`` among the first ``n = b * block`` is ``floor(n * S[d+1]) - floor(n * S[d])`` (S: the
  cumulative normalised weights), so every dataset's share is exact to one sample at every block
  boundary; inside a block the slots are a seeded shuffle of those counts. Sample ``i`` is then
  the ``j``-th sample of its dataset (computed from its block alone: O(block), cached);
- the ``j``-th sample of a dataset with ``N`` windows is in epoch ``j // N`` at position ``j % N``
  of that epoch's permutation of the windows: a seeded Feistel bijection of [0, N), evaluated for
  the ``block`` positions around it at once (cached: a step's reads cost one vectorised call; no
  table of N entries).

Nothing depends on the data-parallel size, the micro batch or the worker count: the data position
of a run is one integer (the samples consumed), and a resumed run (or one with another layout) sees
the same samples. numpy only; torch is imported where tensors are made (``batch``).
"""
from __future__ import annotations

import bisect
import functools
import hashlib
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

import numpy as np

from launcher.config.seeding import derive_seed
from launcher.data.manifest import BLOCK, DatasetError, Manifest

SPLITS = ("train", "val")

__all__ = ["BLOCK", "SampleId", "Source", "TokenDataset", "Windows", "permute", "verified"]


class SampleId(NamedTuple):
    """Where a sample came from: the blend's dataset index, the epoch over that dataset's windows and
    the window (what an audit compares, and what ``log_samples`` writes)."""

    dataset: int
    epoch: int
    window: int


@dataclass(frozen=True)
class Source:
    """One dataset of a blend: its directory and (relative) weight."""

    path: str
    weight: float = 1.0


# ---- a seeded bijection of [0, n): 4-round Feistel on the next even power of two, cycle-walked ----

def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser (uint64 arrays wrap around)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def permute(positions: Any, n: int, key: int) -> np.ndarray:
    """The images of ``positions`` (ints in [0, n)) under the permutation of [0, n) seeded by ``key``."""
    p = np.asarray(positions, dtype=np.int64)
    if n < 1:
        raise ValueError(f"cannot permute an empty range (n={n})")
    if p.size and (p.min() < 0 or p.max() >= n):
        raise IndexError(f"positions must be in [0, {n})")
    half = max(1, ((n - 1).bit_length() + 1) // 2)  # 4**half >= n: at most 4 walks per value expected
    mask = np.uint64((1 << half) - 1)
    shift = np.uint64(half)
    base = (int(key) * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF  # python ints: no numpy scalar overflow
    keys = _mix(np.arange(4, dtype=np.uint64) + np.uint64(base))
    x = p.astype(np.uint64).reshape(-1)
    todo = np.ones(x.shape, dtype=bool)
    while todo.any():  # cycle walking: re-encrypt the values that left [0, n) until they come back
        v = x[todo]
        left, right = v >> shift, v & mask
        for k in keys:
            left, right = right, left ^ (_mix(right ^ k) & mask)
        v = (left << shift) | right
        x[todo] = v
        todo[todo] = v >= np.uint64(n)
    return x.astype(np.int64).reshape(p.shape)


# ---- one split of one dataset as windows -----------------------------------------------------------

_VERIFIED: Dict[Tuple[str, int, int, int], str] = {}  # (path, size, mtime_ns, inode) -> sha256, this process


def verified(path: Path, size: int, sha256: str) -> Path:
    """``path`` once its size and sha256 match the manifest's (hashed on first open, streaming, once a
    process per file as it is); DatasetError naming the file otherwise: nothing trains on a shard changed
    after `launcher data prepare` (a flipped byte keeps the size: the hash finds it)."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise DatasetError(f"{path}: {e.strerror or 'unreadable'} (the manifest lists it)") from None
    if st.st_size != size:
        raise DatasetError(f"{path}: {st.st_size:,} bytes, the manifest says {size:,}: the shard changed after "
                           "`launcher data prepare`; not trained on (launcher data verify names every change)")
    key = (str(path), st.st_size, st.st_mtime_ns, st.st_ino)
    if key not in _VERIFIED:
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(8 << 20), b""):
                digest.update(chunk)
        _VERIFIED[key] = digest.hexdigest()
    if _VERIFIED[key] != sha256:
        raise DatasetError(f"{path}: sha256 {_VERIFIED[key][:16]}... differs from the manifest's {sha256[:16]}...: "
                           "the shard changed after `launcher data prepare`; not trained on (launcher data verify "
                           "names every change)")
    return path


class Windows:
    """The windows of ``seq_len + 1`` tokens of one split of the prepared dataset at ``path``."""

    def __init__(self, path: Union[str, Path], split: str = "train", *, seq_len: int, packing: bool = True,
                 manifest: Optional[Manifest] = None) -> None:
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        self.path, self.split, self.seq_len, self.packing = Path(path), split, int(seq_len), bool(packing)
        self.manifest = manifest if manifest is not None else Manifest.load(self.path)
        shards = list(self.manifest.split(split).shards)
        dtype = np.dtype(self.manifest.dtype).newbyteorder("<")
        # plain ndarray views of the mappings (np.asarray: no copy; slicing skips memmap's per-slice overhead)
        # each shard verified against the manifest before it is mapped: nothing trains on what was not
        self._bins = [np.asarray(np.memmap(verified(self.path / s.bin, s.bin_size, s.bin_sha256), dtype=dtype,
                                           mode="r")) for s in shards if s.tokens]
        self._offsets = [0]
        for b in self._bins:
            self._offsets.append(self._offsets[-1] + len(b))
        self.total_tokens = self._offsets[-1]
        width = self.seq_len + 1
        if self.packing:
            self._doc_starts: Optional[np.ndarray] = None
            self.num_windows = max(0, (self.total_tokens - 1) // self.seq_len)
        else:  # global start offsets of the documents long enough for a window
            starts: List[np.ndarray] = []
            for s, base in zip((s for s in shards if s.tokens), self._offsets[:-1]):
                idx = np.fromfile(verified(self.path / s.idx, s.idx_size, s.idx_sha256), dtype="<i8")
                keep = np.diff(idx) >= width
                starts.append(idx[:-1][keep] + base)
            self._doc_starts = np.concatenate(starts) if starts else np.zeros(0, dtype=np.int64)
            self.num_windows = int(len(self._doc_starts))

    def __len__(self) -> int:
        return self.num_windows

    def start(self, window: int) -> int:
        """The stream offset (in tokens) where ``window`` begins."""
        if not 0 <= window < self.num_windows:
            raise IndexError(f"window {window} outside [0, {self.num_windows}) of {self.path} ({self.split})")
        return int(self._doc_starts[window]) if self._doc_starts is not None else window * self.seq_len

    def window(self, window: int) -> np.ndarray:
        """Tokens [seq_len + 1] of ``window`` (a view of the mapped shard when it lies inside one)."""
        a = self.start(window)
        b = a + self.seq_len + 1
        s = bisect.bisect_right(self._offsets, a) - 1
        lo = a - self._offsets[s]
        if b <= self._offsets[s + 1]:
            return self._bins[s][lo:lo + self.seq_len + 1]
        parts, need = [], self.seq_len + 1
        while need:  # a packed window across shard ends
            piece = self._bins[s][lo:lo + need]
            parts.append(piece)
            need -= len(piece)
            s, lo = s + 1, 0
        return np.concatenate(parts)


# ---- the blend --------------------------------------------------------------------------------------

def _sources(data: Any) -> List[Source]:
    """The datasets of ``cfg.data``: its ``blend`` when non-empty, else its ``path``."""
    blend = list(getattr(data, "blend", None) or [])
    if blend:
        return [Source(str(b["path"] if isinstance(b, dict) else b.path),
                       float(b.get("weight", 1.0) if isinstance(b, dict) else b.weight)) for b in blend]
    path = getattr(data, "path", None)
    if not path or path == "???":
        raise DatasetError("data=tokens needs data.path=DIR (a `launcher data prepare` output) or data.blend")
    return [Source(str(path))]


class TokenDataset:
    """Samples of a blend of prepared datasets (one split): ``tokens(i)`` -> [seq_len + 1] tokens,
    ``batch(indices)`` -> (tokens, labels) LongTensors [n, seq_len] (labels shifted by one inside the
    window), ``sample_ids(i)`` -> SampleId. Infinite: indices past a dataset's windows are later epochs."""

    def __init__(self, sources: Sequence[Union[Source, str]], *, seq_len: int, split: str = "train",
                 packing: bool = True, seed: int = 0, block: int = BLOCK) -> None:
        srcs = [s if isinstance(s, Source) else Source(str(s)) for s in sources]
        if not srcs:
            raise ValueError("a TokenDataset needs at least one dataset")
        for s in srcs:
            if not (math.isfinite(s.weight) and s.weight > 0):
                raise DatasetError(f"blend weight of {s.path} must be > 0, got {s.weight}")
        self.sources, self.split, self.seq_len, self.packing = srcs, split, int(seq_len), bool(packing)
        self.seed, self.block = int(seed), int(block)
        self.windows = [Windows(s.path, split, seq_len=seq_len, packing=packing) for s in srcs]
        for s, w in zip(srcs, self.windows):
            if not len(w):
                width = self.seq_len + 1
                why = (f"no document has seq_len+1 = {width} tokens (packing=false)" if not packing
                       else f"fewer than seq_len+1 = {width} tokens")
                hint = ("; data.eval_every needs one: prepare with a larger --val-fraction, or set data.eval_every=0"
                        if split == "val" else "")
                raise DatasetError(f"{s.path}: the {split} split has no sample: {why}{hint}")
        self.vocab_size = max(int(w.manifest.vocab_size) for w in self.windows)
        total = sum(s.weight for s in srcs)
        # cumulative weights as exact fractions of 2**53: the counts are the same on every machine
        self._cum = [0] + [round(sum(s.weight for s in srcs[:d + 1]) / total * 2**53) for d in range(len(srcs))]
        self._cum[-1] = 2**53
        if len(srcs) > 1 and min(b - a for a, b in zip(self._cum, self._cum[1:])) * self.block < 2**53:
            raise DatasetError(f"every blend weight must be at least 1/{self.block} of the total")
        self._block_ids = functools.lru_cache(maxsize=4)(self._block)
        self._order = functools.lru_cache(maxsize=16)(self._permuted)  # a step reads one or two blocks

    @classmethod
    def from_config(cls, data: Any, *, seq_len: int, seed: int, split: str = "train") -> TokenDataset:
        """The dataset ``cfg.data`` names (``path`` or ``blend``, ``packing``)."""
        return cls(_sources(data), seq_len=seq_len, split=split, packing=bool(getattr(data, "packing", True)),
                   seed=seed)

    # ---- which dataset and which of its samples ----
    def _counts_before(self, n: int) -> List[int]:
        """Samples of each dataset among the first ``n`` (exact integer arithmetic)."""
        floors = [n * c >> 53 for c in self._cum]
        return [b - a for a, b in zip(floors, floors[1:])]

    def _block(self, b: int) -> Tuple[np.ndarray, np.ndarray]:
        """(dataset, index within it) of every sample of block ``b``."""
        before = self._counts_before(b * self.block)
        here = [x - y for x, y in zip(self._counts_before((b + 1) * self.block), before)]
        slots = np.repeat(np.arange(len(here), dtype=np.int64), here)
        rng = np.random.Generator(np.random.PCG64(derive_seed(self.seed, "blend", self.split, b)))
        slots = slots[rng.permutation(len(slots))]
        index = np.empty_like(slots)
        for d, n in enumerate(here):
            mine = slots == d
            index[mine] = before[d] + np.arange(n, dtype=np.int64)
        return slots, index

    def _permuted(self, d: int, epoch: int, b: int) -> np.ndarray:
        """The windows at positions [b*block, (b+1)*block) of dataset ``d``'s epoch ``epoch``."""
        n = self.windows[d].num_windows
        positions = np.arange(b * self.block, min(n, (b + 1) * self.block), dtype=np.int64)
        return permute(positions, n, derive_seed(self.seed, "epoch", self.split, d, epoch))

    def locate(self, indices: Sequence[int]) -> Tuple[np.ndarray, np.ndarray]:
        """(dataset, index within that dataset) of each sample of ``indices``: int64 arrays."""
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if idx.size and idx.min() < 0:
            raise IndexError(f"sample indices must be >= 0, got {int(idx.min())}")
        if len(self.windows) == 1:
            return np.zeros_like(idx), idx
        ds, js = np.empty_like(idx), np.empty_like(idx)
        blocks = idx // self.block
        for b in np.unique(blocks):
            mine = blocks == b
            slots, index = self._block_ids(int(b))
            k = idx[mine] % self.block
            ds[mine], js[mine] = slots[k], index[k]
        return ds, js

    def ids(self, indices: Sequence[int]) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(dataset, epoch, window) int64 arrays of the samples ``indices`` (vectorised ``sample_ids``)."""
        ds, js = self.locate(indices)
        epochs, windows = np.empty_like(js), np.empty_like(js)
        for d, w in enumerate(self.windows):
            mine = ds == d
            if not mine.any():
                continue
            e, pos = np.divmod(js[mine], w.num_windows)
            out = np.empty_like(pos)
            blocks = e * (-(-w.num_windows // self.block)) + pos // self.block  # (epoch, block of positions)
            for key in np.unique(blocks):
                at = blocks == key
                epoch = int(e[at][0])
                out[at] = self._order(d, epoch, int(pos[at][0]) // self.block)[pos[at] % self.block]
            epochs[mine], windows[mine] = e, out
        return ds, epochs, windows

    def sample_ids(self, i: int) -> SampleId:
        """Where sample ``i`` comes from: (dataset, epoch, window)."""
        d, e, w = self.ids([int(i)])
        return SampleId(int(d[0]), int(e[0]), int(w[0]))

    def tokens(self, i: int) -> np.ndarray:
        """Tokens [seq_len + 1] of sample ``i``."""
        sid = self.sample_ids(i)
        return self.windows[sid.dataset].window(sid.window)

    def array(self, indices: Sequence[int]) -> np.ndarray:
        """int64 [len(indices), seq_len + 1]: the windows of samples ``indices``."""
        ds, _, windows = self.ids(indices)
        out = np.empty((len(ds), self.seq_len + 1), dtype=np.int64)
        for row, (d, w) in enumerate(zip(ds.tolist(), windows.tolist())):
            out[row] = self.windows[d].window(w)
        return out

    def batch(self, indices: Sequence[int]) -> Tuple[Any, Any]:
        """(tokens, labels) LongTensors [len(indices), seq_len]: labels = tokens shifted by one."""
        import torch

        seq = torch.from_numpy(self.array(indices))
        return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()
