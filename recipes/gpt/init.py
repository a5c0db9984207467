"""Shard-stable initialisation: every element of every weight gets the same value whatever the layout.

A weight's row r is drawn from its own generator, keyed by (run seed, parameter name, r); a rank
that holds a shard draws only the rows its shard touches (all of a row's columns, then keeps its
columns: a row-parallel shard draws tp times its share, never more memory than one row). So a
tensor-parallel slice, a pipeline stage or a ZeRO-3 partition is built directly, without the whole
model, and holds exactly the values the single-process model holds.

The rule (GPT-2 / Megatron): weights N(0, 0.02), the output projections of each block (attn.proj,
mlp.fc2) N(0, 0.02 / sqrt(2 L)), biases 0, layer-norm weights 1. Values are drawn on the CPU with
numpy's Philox (the same on every machine and device type) in fp32.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple, Union

import numpy as np
import torch

from launcher.seeding import derive_seed

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
    out = torch.empty(out_shape)
    base = derive_seed(int(seed), "init", name)
    for i, r in enumerate(idx.tolist()):
        row = torch.from_numpy(_draw(base, r, shape[1]))
        out[i] = row if cols is None else row[cols]
    return out.mul_(std)


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
