"""One iteration of each benchmarked operation, on buffers made once per (op, size).

``make(op, count, ...)`` returns an ``Op``: ``run()`` does one operation and returns when this
rank's part is done (``sync`` then waits for the device). Backends differ in what they implement
(gloo has had no reduce_scatter in some torch versions; the tensor forms of all_gather and
reduce_scatter are newer than the list forms): the first call tries each form in turn, newest
first, and keeps the first the backend accepts; ``Unsupported`` says why none did. Such a refusal
is raised on the calling rank before anything is sent, so every rank reaches the same verdict.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, List, Optional, Tuple

import torch
import torch.distributed as dist

from recipes.commbench.math import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER, SENDRECV

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# what a backend raises for an operation or form it does not implement
REFUSALS = (RuntimeError, NotImplementedError, AttributeError, TypeError, ValueError)


class Unsupported(Exception):
    """No form of the operation runs on this backend; the message is the recorded reason."""


@dataclass
class Op:
    forms: List[Tuple[str, Callable[[], None]]]  # (name, one iteration), preferred first
    impl: Optional[str] = None  # the form in use, once the first call found one
    _run: Optional[Callable[[], None]] = field(default=None, repr=False)

    def run(self) -> None:
        if self._run is not None:
            self._run()
            return
        refused = []
        for name, fn in self.forms:
            try:
                fn()
            except REFUSALS as e:
                refused.append(f"{name}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
                continue
            self.impl, self._run = name, fn
            return
        raise Unsupported("; ".join(refused) or "no implementation")


def _collective(name: str, *args) -> Optional[Tuple[str, Callable[[], None]]]:
    fn = getattr(dist, name, None)  # absent from older torch
    return None if fn is None else (name, lambda: fn(*args))


def make(op: str, count: int, dtype: str, device: str, rank: int, world: int) -> Op:
    """The op on a full buffer of ``count`` elements (math.element_count made it divisible by the
    world size where the buffer is split per rank)."""
    dt = DTYPES[dtype]
    if op == ALL_REDUCE:
        buf = torch.ones(count, dtype=dt, device=device)
        return Op([("all_reduce", lambda: dist.all_reduce(buf))])
    if op == ALL_GATHER:
        out = torch.empty(count, dtype=dt, device=device)
        part = torch.ones(count // world, dtype=dt, device=device)
        parts = list(out.chunk(world))
        forms = [_collective("all_gather_single", out, part), _collective("all_gather_into_tensor", out, part),
                 ("all_gather", lambda: dist.all_gather(parts, part))]
        return Op([f for f in forms if f is not None])
    if op == REDUCE_SCATTER:
        full = torch.ones(count, dtype=dt, device=device)
        part = torch.empty(count // world, dtype=dt, device=device)
        pieces = list(full.chunk(world))
        forms = [_collective("reduce_scatter_single", part, full), _collective("reduce_scatter_tensor", part, full),
                 ("reduce_scatter", lambda: dist.reduce_scatter(part, pieces))]
        return Op([f for f in forms if f is not None])
    if op == SENDRECV:
        if world < 2:
            raise Unsupported("sendrecv needs at least 2 ranks (rank 0 and the last rank)")
        peer = {0: world - 1, world - 1: 0}.get(rank)
        if peer is None:  # a rank between the two pair ends takes no part
            return Op([("idle", lambda: None)])
        send = torch.ones(count, dtype=dt, device=device)
        recv = torch.empty(count, dtype=dt, device=device)

        def exchange() -> None:  # both directions at once, each carrying the whole message
            for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, send, peer),
                                                dist.P2POp(dist.irecv, recv, peer)]):
                work.wait()

        return Op([("batch_isend_irecv", exchange)])
    raise ValueError(f"unknown op {op!r}")


def element_size(dtype: str) -> int:
    return torch.empty((), dtype=DTYPES[dtype]).element_size()
