"""Synthetic, learnable token data and the rank-aware sampler.

The "bigram language": a fixed random transition table gives every token ``branching``
possible successors (drawn from a generator seeded by the data seed). A sample is a walk
through that table: a uniform first token, then at each position one of the current
token's successors, picked uniformly. A model that learns the table reaches a loss near
``log(branching)``, far below ``log(vocab_size)``.

Sample ``i`` is a function of ``(data_seed, i)`` only, and the sampler maps
``(step, data-parallel rank, micro batch)`` to global sample indices so that the samples a
step sees do not depend on the data-parallel layout:

    micro batch k of rank r at step s holds samples s*G + r*(a*mb) + k*mb + j, j < mb

with G the global batch, mb the micro batch and a the gradient accumulation steps, all three
read from the run's ``Layout`` (``launcher.config.layout``: G = dp * mb * a). Concatenating ranks in
order, then micro batches, gives samples s*G .. s*G + G - 1 for every dp.
"""
from __future__ import annotations

import functools
import hashlib
from typing import TYPE_CHECKING, Any, Callable, List, Optional, Sequence, Tuple

import torch

from launcher.config.schema import enum_value
from launcher.config.seeding import data_seed as run_data_seed, derive_seed

if TYPE_CHECKING:
    from launcher.config.layout import Layout
    from launcher.config.schema import RunConfig

try:  # the walk is ~8x faster in numpy; torch gives identical results without it
    import numpy as _np
except ImportError:  # pragma: no cover - numpy ships with every torch wheel we use
    _np = None

Batch = Tuple[torch.Tensor, torch.Tensor]
SYNTHETIC_VAL_START = 2**62  # the synthetic val split's first sample index: far past any training step's

__all__ = [
    "BigramDataset",
    "Prefetch",
    "SampleLog",
    "StepBatches",
    "eval_batches",
    "micro_batch_indices",
    "micro_batches",
    "sample_seed",
    "train_batches",
    "transition_table",
]


def sample_seed(data_seed: int, index: int) -> int:
    """The generator seed of sample ``index``: a 63-bit hash of (data_seed, index)."""
    digest = hashlib.blake2b(f"{int(data_seed)}:{int(index)}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") & 0x7FFFFFFFFFFFFFFF


@functools.lru_cache(maxsize=16)
def transition_table(data_seed: int, vocab_size: int, branching: int) -> torch.Tensor:
    """LongTensor [vocab_size, branching]: the possible successors of every token."""
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    if not 1 <= branching <= vocab_size:
        raise ValueError(f"data.branching must be in [1, vocab_size={vocab_size}], got {branching}")
    gen = torch.Generator().manual_seed(derive_seed(data_seed, "bigram-table"))
    table = torch.randint(0, vocab_size, (vocab_size, branching), generator=gen, dtype=torch.long)
    table.requires_grad_(False)
    return table


def _walk(table: torch.Tensor, starts: torch.Tensor, choices: torch.Tensor) -> torch.Tensor:
    """Walk the table: [n] starts, [seq_len, n] choices -> [n, seq_len + 1] tokens."""
    steps, n = choices.shape
    if _np is not None:
        tab = table.numpy()
        ch = choices.numpy()
        out = _np.empty((steps + 1, n), dtype=_np.int64)
        cur = starts.numpy()
        out[0] = cur
        for t in range(steps):
            cur = tab[cur, ch[t]]
            out[t + 1] = cur
        return torch.from_numpy(out).t().contiguous()
    flat = table.reshape(-1)
    branching = table.shape[1]
    out = torch.empty((steps + 1, n), dtype=torch.long)
    cur = starts
    out[0] = cur
    for t in range(steps):
        cur = flat[cur * branching + choices[t]]
        out[t + 1] = cur
    return out.t().contiguous()


class BigramDataset:
    """Indexable synthetic dataset: ``ds[i] -> (tokens[seq_len], labels[seq_len])``."""

    def __init__(self, data_seed: int, vocab_size: int, seq_len: int, branching: int) -> None:
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        self.data_seed = int(data_seed)
        self.vocab_size = int(vocab_size)
        self.seq_len = int(seq_len)
        self.branching = int(branching)
        self.table = transition_table(self.data_seed, self.vocab_size, self.branching)

    def batch(self, indices: Sequence[int]) -> Batch:
        """Samples ``indices`` stacked: (tokens, labels) LongTensors [len(indices), seq_len]."""
        n = len(indices)
        starts = torch.empty(n, dtype=torch.long)
        choices = torch.empty((self.seq_len, n), dtype=torch.long)
        for row, index in enumerate(indices):
            if index < 0:
                raise IndexError(f"sample index must be >= 0, got {index}")
            gen = torch.Generator().manual_seed(sample_seed(self.data_seed, index))
            starts[row] = torch.randint(0, self.vocab_size, (1,), generator=gen)[0]
            choices[:, row] = torch.randint(0, self.branching, (self.seq_len,), generator=gen)
        seq = _walk(self.table, starts, choices)
        return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()

    def __getitem__(self, index: int) -> Batch:
        tokens, labels = self.batch([int(index)])
        return tokens[0], labels[0]


def micro_batch_indices(step: int, layout: Layout, dp_rank: int) -> List[List[int]]:
    """Global sample indices of each micro batch of ``dp_rank`` at 0-based ``step``: the layout's
    ``grad_accum`` lists of ``micro_batch_size`` indices."""
    dp, mb, accum = int(layout.dp), int(layout.micro_batch_size), int(layout.grad_accum)
    if not 0 <= dp_rank < dp:
        raise ValueError(f"dp_rank must be in [0, {dp}), got {dp_rank}")
    if step < 0:
        raise ValueError(f"step must be >= 0 (0-based), got {step}")
    base = step * int(layout.global_batch_size) + dp_rank * accum * mb
    return [[base + k * mb + j for j in range(mb)] for k in range(accum)]


def micro_batches(
    data_seed: int,
    step: int,
    layout: Layout,
    dp_rank: int,
    vocab_size: int,
    seq_len: int,
    branching: int,
) -> List[Batch]:
    """The micro batches of ``dp_rank`` at 0-based ``step``: a list (length ``layout.grad_accum``) of
    (tokens, labels) LongTensors [layout.micro_batch_size, seq_len] on the CPU."""
    groups = micro_batch_indices(step, layout, dp_rank)
    mb = int(layout.micro_batch_size)
    ds = BigramDataset(data_seed, vocab_size, seq_len, branching)
    tokens, labels = ds.batch([i for group in groups for i in group])  # one walk for all
    return [(tokens[k * mb:(k + 1) * mb], labels[k * mb:(k + 1) * mb]) for k in range(len(groups))]


class StepBatches:
    """The data of a run as the step loop reads it: ``batches(step)`` (1-based) -> the micro batches of
    one dp rank (``layout.grad_accum`` (tokens, labels) pairs [micro_batch_size, seq_len], CPU), and
    ``sample_ids(step)`` -> [dataset, epoch, window] of each sample it loads (what ``log_samples`` writes)."""

    def __init__(self, layout: Layout, dp_rank: int, batch: Callable[[List[int]], Batch],
                 ids: Callable[[List[int]], List[List[int]]]) -> None:
        self.layout, self.dp_rank, self._batch, self._ids = layout, int(dp_rank), batch, ids

    def __call__(self, step: int) -> List[Batch]:
        groups = micro_batch_indices(step - 1, self.layout, self.dp_rank)
        mb = int(self.layout.micro_batch_size)
        tokens, labels = self._batch([i for group in groups for i in group])  # one read for all
        return [(tokens[k * mb:(k + 1) * mb], labels[k * mb:(k + 1) * mb]) for k in range(len(groups))]

    def sample_ids(self, step: int) -> List[List[int]]:
        return self._ids([i for group in micro_batch_indices(step - 1, self.layout, self.dp_rank) for i in group])


def _source(cfg: RunConfig, split: str, *, seq_len: int, vocab_size: int) -> Tuple[Callable, Callable]:
    """(batch(indices), ids(indices)) of the ``split`` samples of ``cfg.data``."""
    data_seed = run_data_seed(int(cfg.seed), cfg.data.seed)
    name = enum_value(cfg.data.name)
    if name == "synthetic":  # the val split: the same language (table), walks no training step reaches
        ds = BigramDataset(data_seed, vocab_size, seq_len, int(cfg.data.branching))
        first = 0 if split == "train" else SYNTHETIC_VAL_START
        return (lambda indices: ds.batch([first + i for i in indices]),
                lambda indices: [[0, 0, first + int(i)] for i in indices])
    if name == "tokens":
        from launcher.data.tokens import TokenDataset

        tds = TokenDataset.from_config(cfg.data, seq_len=seq_len, seed=data_seed, split=split)
        if tds.vocab_size > vocab_size:
            raise ValueError(f"the dataset's vocabulary ({tds.vocab_size} tokens) does not fit "
                             f"model.vocab_size={vocab_size}: raise model.vocab_size to >= {tds.vocab_size}")

        def ids(indices: List[int]) -> List[List[int]]:
            return [list(row) for row in zip(*(a.tolist() for a in tds.ids(indices)))]

        return tds.batch, ids
    raise ValueError(f"data.name={name!r} is not a dataset this recipe reads (synthetic, tokens)")


def train_batches(cfg: RunConfig, layout: Layout, dp_rank: int, *, seq_len: int, vocab_size: int) -> StepBatches:
    """The training data of a run (``cfg.data``) for ``dp_rank``: called with a 1-based step, the micro
    batches of that step (see ``StepBatches``). Every recipe of this package reads its data through this
    one function, whatever the model: data=synthetic (the bigram language) or data=tokens (a prepared
    dataset or blend, ``launcher.data.tokens``); sample i is a function of (data seed, i) only."""
    batch, ids = _source(cfg, "train", seq_len=seq_len, vocab_size=vocab_size)
    return StepBatches(layout, dp_rank, batch, ids)


def eval_batches(cfg: RunConfig, layout: Layout, dp_rank: int, *, seq_len: int, vocab_size: int) -> List[Batch]:
    """The validation micro batches of ``dp_rank``: ``data.eval_batches`` global batches of the val split
    (the same samples at every evaluation), split over the dp ranks as training steps are, so the mean
    over every rank's micro batches is the same whatever the layout."""
    batches = StepBatches(layout, dp_rank, *_source(cfg, "val", seq_len=seq_len, vocab_size=vocab_size))
    return [mb for b in range(int(cfg.data.eval_batches)) for mb in batches(b + 1)]


class SampleLog:
    """``data.log_samples``: this rank's sample ids, one JSON line per step ({"step", "samples":
    [[dataset, epoch, window], ...]}) in the run dir's ``samples/rank_<r>.jsonl``. Opened at the resumed
    step ``start``: the lines of the steps after it (which this attempt redoes) are dropped first, as
    the checkpointer rewinds metrics.jsonl."""

    def __init__(self, ctx: Any, start: int, enabled: bool) -> None:
        self.path = ctx.rundir.samples_path(int(ctx.rank)) if enabled else None
        if self.path is None:
            return
        import json

        from launcher.archive import atomic

        self._json = json
        kept = []
        if self.path.exists():
            kept = [line for line in self.path.read_text().splitlines()
                    if line.strip() and json.loads(line)["step"] <= start]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        atomic.write_text(self.path, "".join(line + "\n" for line in kept))

    def write(self, step: int, samples: Callable[[int], List[List[int]]]) -> None:
        if self.path is None:
            return
        with open(self.path, "a") as f:
            f.write(self._json.dumps({"step": int(step), "samples": samples(step)}) + "\n")


class Prefetch:
    """The next step's micro batches, made in a background thread while this step trains (and pinned
    for an asynchronous host-to-GPU copy), so the step waits for data only when making it is slower
    than the step. ``get(step)`` returns ``make(step)`` (the same values as made inline) and starts
    making ``step + 1`` (up to ``last``)."""

    def __init__(self, make: Any, last: int, pin: bool = False) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.make, self.last, self.pin = make, int(last), bool(pin)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefetch")
        self._next: Optional[Tuple[int, Any]] = None

    def _made(self, step: int) -> List[Batch]:
        batches = self.make(step)
        return [(t.pin_memory(), lab.pin_memory()) for t, lab in batches] if self.pin else batches

    def get(self, step: int) -> List[Batch]:
        if self._next is not None and self._next[0] == step:
            batches = self._next[1].result()
        else:
            batches = self._made(step)
        self._next = (step + 1, self._pool.submit(self._made, step + 1)) if step < self.last else None
        return batches

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
