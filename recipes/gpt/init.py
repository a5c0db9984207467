"""Shard-stable initialisation: every element of every weight gets the same value whatever the layout.

A weight's row r is drawn from its own generator, keyed by (run seed, parameter name, r); a rank
that holds a shard draws only the rows its shard touches (all of a row's columns, then keeps its
columns: a row-parallel shard draws tp times its share, never more memory than one row). So a
tensor-parallel slice, a pipeline stage or a ZeRO-3 partition is built directly, without the whole
model, and holds exactly the values the single-process model holds.

The rule (GPT-2 / Megatron): weights N(0, 0.02), the output projections of each block (attn.proj,
mlp.fc2) N(0, 0.02 / sqrt(2 L)), biases 0, layer-norm weights 1. Values are drawn on the CPU with
numpy's Philox (the same on every machine and device type) in fp32, each row straight into place,
a large parameter's rows spread over threads (the values do not depend on which thread drew them).
"""
from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Optional, Sequence, Tuple, Union

import numpy as np
import torch

from launcher.config.seeding import derive_seed

INIT_STD = 0.02
Rows = Union[None, slice, torch.Tensor, Sequence[int]]


def rule(name: str, num_layers: int) -> Tuple[str, float]:
    """("normal", std), ("zeros", 0) or ("ones", 0) for the GPT parameter ``name``
    (``recipes.gpt.model.GPT.named_parameters()`` names)."""
    parts = name.split(".")
    leaf, module = parts[-1], (parts[-2] if len(parts) > 1 else "")
    if leaf == "bias":
        return "zeros", 0.0
    if module in ("ln1", "ln2", "final_norm"):
        return "ones", 0.0
    if name.endswith("attn.proj.weight") or name.endswith("mlp.fc2.weight"):
        return "normal", INIT_STD / math.sqrt(2.0 * num_layers)
    return "normal", INIT_STD


def _row_seed(base: int, row: int) -> int:
    return (base << 32) | row  # base < 2**31, row < 2**32: distinct for every (name, row)


def _rows(sel: Rows, n: int) -> torch.Tensor:
    if sel is None:
        return torch.arange(n)
    if isinstance(sel, slice):
        return torch.arange(n)[sel]
    return torch.as_tensor(sel, dtype=torch.long)


def init_values(seed: int, name: str, shape: Sequence[int], num_layers: int, rows: Rows = None,
                cols: Optional[slice] = None) -> torch.Tensor:
    """The initial values of ``name`` (full shape ``shape``) at the rows ``rows`` (dim 0: None, a
    slice or indices) and columns ``cols`` (dim 1 of a matrix), fp32 on the CPU."""
    shape = tuple(int(s) for s in shape)
    kind, std = rule(name, num_layers)
    idx = _rows(rows, shape[0])
    width = len(range(*cols.indices(shape[1]))) if (cols is not None and len(shape) > 1) else None
    out_shape = (len(idx),) + ((width,) if width is not None else shape[1:])
    if kind == "zeros":
        return torch.zeros(out_shape)
    if kind == "ones":
        return torch.ones(out_shape)
    if len(shape) == 1:  # a normal vector: one generator for the whole vector
        return _row(seed, name, 0, shape[0], std)[idx]
    out = np.empty(out_shape, dtype=np.float32)
    _fill_rows(out, derive_seed(int(seed), "init", name), idx.tolist(), shape[1], cols)
    return torch.from_numpy(out).mul_(std)


def _fill_rows(out: np.ndarray, base: int, rows: Sequence[int], n: int, cols: Optional[slice]) -> None:
    """``out[i]`` = row ``rows[i]``'s n standard normals (its ``cols`` only), each drawn straight into
    place from its own generator; large parameters' rows in parallel threads (numpy draws without the
    GIL), every value as the single-threaded draw makes it."""
    def fill(lo: int, hi: int) -> None:
        full = np.empty(n, dtype=np.float32) if cols is not None else None
        bits = np.random.Philox(key=0)  # re-keyed per row: the state Philox(key=row seed) starts in,
        gen = np.random.Generator(bits)  # without building a generator per row (~10x the cost)
        for i in range(lo, hi):
            bits.state = _fresh_state(_row_seed(base, rows[i]))
            if full is None:
                gen.standard_normal(dtype=np.float32, out=out[i])
            else:
                gen.standard_normal(dtype=np.float32, out=full)
                out[i] = full[cols]

    threads = _threads()
    if threads == 1 or len(rows) * n < PARALLEL_VALUES:
        fill(0, len(rows))
        return
    step = -(-len(rows) // (threads * 4))  # a few chunks per thread: even when rows differ in cost
    list(_pool(threads).map(lambda lo: fill(lo, min(lo + step, len(rows))), range(0, len(rows), step)))


PARALLEL_VALUES = 1 << 20  # values below which one thread draws a parameter's rows
_POOL: Optional[ThreadPoolExecutor] = None


def _threads() -> int:
    return max(1, min(16, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))


def _pool(threads: int) -> ThreadPoolExecutor:
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="gpt-init")
    return _POOL


def _fresh_state(key: int) -> dict:
    """The state of ``np.random.Philox(key=key)`` (key < 2**64) as constructed, nothing drawn yet."""
    zeros = np.zeros(4, dtype=np.uint64)
    return {"bit_generator": "Philox", "state": {"counter": zeros, "key": np.array([key, 0], dtype=np.uint64)},
            "buffer": zeros.copy(), "buffer_pos": 4, "has_uint32": 0, "uinteger": 0}


def _draw(base: int, row: int, n: int) -> np.ndarray:
    """n standard normals of one row: numpy's counter-based Philox keyed by (name, row), 128 bits
    wide, so no two rows of any parameter share a stream (torch's CPU generator keeps 32 bits of a
    seed: rows would repeat)."""
    return np.random.Generator(np.random.Philox(key=_row_seed(base, row))).standard_normal(n, dtype=np.float32)


def _row(seed: int, name: str, row: int, n: int, std: float) -> torch.Tensor:
    return torch.from_numpy(_draw(derive_seed(int(seed), "init", name), row, n)).mul_(std)


def init_flat(seed: int, name: str, shape: Sequence[int], num_layers: int, start: int, end: int) -> torch.Tensor:
    """Elements [start, end) of the row-major flattened initial ``name`` (a ZeRO-3 partition),
    fp32 on the CPU; positions at or past the parameter's end (partition padding) are 0."""
    shape = tuple(int(s) for s in shape)
    numel = math.prod(shape)
    out = torch.zeros(max(0, end - start))
    stop = min(end, numel)
    if stop <= start:
        return out
    width = shape[1] if len(shape) > 1 else numel
    if len(shape) > 2:
        width = math.prod(shape[1:])
    first, last = start // width, (stop - 1) // width
    if len(shape) == 1:
        vals = init_values(seed, name, shape, num_layers).reshape(-1)
        out[: stop - start] = vals[start:stop]
        return out
    block = init_values(seed, name, (shape[0], width), num_layers, rows=slice(first, last + 1)).reshape(-1)
    off = start - first * width
    out[: stop - start] = block[off: off + stop - start]
    return out
