"""Token statistics of a prepared split, from its memory-mapped shards (pure: numpy, no torch).

The unigram entropy is the loss (nats per token) of the best model that ignores context, one fixed
distribution over the vocabulary: a trained language model's loss well below it shows it learned
from context (docs/data.md, "A corpus from the standard library").
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional, Union

import numpy as np

from launcher.data.manifest import Manifest

_CHUNK = 1 << 24  # tokens counted at a time (a bounded copy however large the shard)


def _manifest(dataset: Union[str, Path, Manifest]) -> Manifest:
    return dataset if isinstance(dataset, Manifest) else Manifest.load(dataset)


def token_counts(dataset: Union[str, Path, Manifest], split: str = "train") -> np.ndarray:
    """How often each token id occurs in ``split`` (EOS included): int64, one entry per id of the
    vocabulary. Reads every shard of the split once."""
    m = _manifest(dataset)
    counts = np.zeros(m.vocab_size, dtype=np.int64)
    for shard in m.split(split).shards:
        if not shard.tokens:
            continue
        tokens = np.memmap(m.dir / shard.bin, dtype=np.dtype(m.dtype).newbyteorder("<"), mode="r")
        for start in range(0, len(tokens), _CHUNK):
            counts += np.bincount(tokens[start:start + _CHUNK], minlength=m.vocab_size)[:m.vocab_size]
    return counts


def entropy(counts: np.ndarray) -> Optional[float]:
    """The entropy (nats) of the distribution ``counts`` is proportional to; None when it is all zero."""
    counts = np.asarray(counts, dtype=np.float64)
    total = counts.sum()
    if total <= 0:
        return None
    p = counts[counts > 0] / total
    return float(-(p * np.log(p)).sum())


def unigram_entropy(dataset: Union[str, Path, Manifest], split: str = "train") -> Optional[float]:
    """The unigram entropy of ``split`` in nats per token (its token frequencies, EOS included);
    None for a split without tokens."""
    return entropy(token_counts(dataset, split))
