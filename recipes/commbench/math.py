"""Bandwidth arithmetic of the benchmark, the conventions of nccl-tests (its PERFORMANCE.md).

Kept free of torch so it can be checked on its own (tests/unit/test_commbench_math.py).

algbw is the message size over the time of one operation. busbw rescales it by how many bytes each
rank's busiest link must carry for that operation on n ranks, so that numbers of different
operations (and rank counts) compare with each other and with the hardware's link speed.
"""
from __future__ import annotations

from typing import Dict, List, Sequence

ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, SENDRECV = "all_reduce", "all_gather", "reduce_scatter", "sendrecv"
OPS = (ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, SENDRECV)
# the buffer of all_gather (output) and reduce_scatter (input) is cut in one piece per rank
SPLIT_OPS = (ALL_GATHER, REDUCE_SCATTER)

GB = 1e9  # bandwidths are reported in GB/s (decimal), as nccl-tests does


def bus_factor(op: str, n: int) -> float:
    """busbw / algbw for ``op`` on ``n`` ranks.

    all_reduce: every rank must send (and receive) (n-1)/n of the data twice, once while the
    reduced pieces are formed and once while they are spread back: 2(n-1)/n.
    all_gather, reduce_scatter: one of those two halves: (n-1)/n.
    sendrecv: the message crosses one link once: 1.
    """
    if n < 1:
        raise ValueError(f"world size must be >= 1, got {n}")
    if op == ALL_REDUCE:
        return 2.0 * (n - 1) / n
    if op in SPLIT_OPS:
        return (n - 1) / n
    if op == SENDRECV:
        return 1.0
    raise ValueError(f"unknown op {op!r} (one of {', '.join(OPS)})")


def algbw(nbytes: int, seconds: float) -> float:
    """Algorithm bandwidth in GB/s: the message size over the time of one operation."""
    if seconds <= 0:
        raise ValueError(f"time must be > 0, got {seconds}")
    return nbytes / seconds / GB


def busbw(op: str, nbytes: int, seconds: float, n: int) -> float:
    """Bus bandwidth in GB/s: algbw times the op's factor (``bus_factor``)."""
    return algbw(nbytes, seconds) * bus_factor(op, n)


def message_sizes(min_bytes: int, max_bytes: int, factor: int) -> List[int]:
    """min_bytes, min_bytes*factor, ... up to max_bytes (included only when the series reaches it)."""
    if min_bytes < 1 or max_bytes < min_bytes:
        raise ValueError(f"need 1 <= min_bytes <= max_bytes, got {min_bytes}, {max_bytes}")
    if factor < 2:
        raise ValueError(f"factor must be an integer >= 2, got {factor}")
    sizes, size = [], int(min_bytes)
    while size <= max_bytes:
        sizes.append(size)
        size *= int(factor)
    return sizes


def element_count(op: str, nbytes: int, elem_size: int, n: int) -> int:
    """Elements of the op's full buffer for a message of about ``nbytes``: whole elements, and for
    all_gather / reduce_scatter a whole number of elements per rank (at least one each). The row
    reports ``count * elem_size``, the bytes actually moved, which can be a little below nbytes."""
    count = max(1, nbytes // elem_size)
    if op in SPLIT_OPS:
        count = max(n, count - count % n)
    return count


def scope(nodes: Sequence[str], op: str) -> str:
    """"inter" when the ranks taking part sit on more than one node, else "intra". ``nodes``: the
    node of every rank, in rank order; sendrecv involves only the first and the last rank."""
    taking_part = [nodes[0], nodes[-1]] if op == SENDRECV else list(nodes)
    return "inter" if len(set(taking_part)) > 1 else "intra"


def peaks(rows: Sequence[Dict], key: str = "busbw_gbs") -> Dict[str, float]:
    """The highest ``key`` of every op in ``rows``."""
    out: Dict[str, float] = {}
    for r in rows:
        out[r["op"]] = max(out.get(r["op"], 0.0), float(r[key]))
    return out
