"""Data-parallel gradient all-reduce overlapped with the backward, in buckets (as DDP does).

Parameters are grouped, in reverse order of registration (roughly the order their gradients become
final during the backward), into buckets of about ``bucket_bytes``. A parameter's gradient is final
after the step's last micro-batch has accumulated into it (a post-accumulate-grad hook counts them);
when every gradient of a bucket is final, the bucket is flattened and its all-reduce starts
(``async_op``) while the backward goes on. ``finish()`` waits for the buckets in order, averages and
writes the results back (``reduce_dtype``: the buckets travel in it, bf16 for half the bytes, and are
averaged in the gradients' dtype). At most ``in_flight`` buckets are outstanding (bounded extra memory: no
flat copy of all gradients at once).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

BUCKET_BYTES = 25 << 20  # DDP's default bucket_cap_mb


class GradBuckets:
    def __init__(self, params: List[nn.Parameter], group: Any, world: int, bucket_bytes: int = BUCKET_BYTES,
                 in_flight: int = 4, reduce_dtype: Optional[torch.dtype] = None) -> None:
        self.group, self.scale, self.in_flight = group, 1.0 / world, max(1, in_flight)
        self.reduce_dtype = reduce_dtype  # None: the gradients' own dtype; bf16: half the bytes on the wire
        self.buckets: List[List[nn.Parameter]] = []
        size = 0
        for p in reversed(params):
            if not self.buckets or size + p.numel() * p.element_size() > bucket_bytes:
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(p)
            size += p.numel() * p.element_size()
        self._bucket_of: Dict[int, int] = {id(p): i for i, b in enumerate(self.buckets) for p in b}
        self._expected = 0
        self._later = 1.0
        self._count: Dict[int, int] = {}
        self._ready: List[int] = [0] * len(self.buckets)
        self._work: List[Optional[tuple]] = [None] * len(self.buckets)
        self._order: List[int] = []
        self._handles = [p.register_post_accumulate_grad_hook(self._hook) for p in params]

    def start_step(self, micro_batches: int, later_scale: float = 1.0) -> None:
        """Before the step's backward passes: each gradient is final after ``micro_batches`` of them.
        ``later_scale``: what the caller multiplies the gradients by in place after the backward and
        before ``finish`` (a pipeline schedule's 1/micro-batches): a bucket sent during the backward
        carries the values before it, so it is applied to that bucket's result."""
        self._expected = int(micro_batches)
        self._later = float(later_scale)
        self._count = {}
        self._ready = [0] * len(self.buckets)
        self._work = [None] * len(self.buckets)
        self._order = []

    def _hook(self, p: nn.Parameter) -> None:
        if not self._expected:
            return
        n = self._count.get(id(p), 0) + 1
        self._count[id(p)] = n
        if n != self._expected:
            return
        b = self._bucket_of[id(p)]
        self._ready[b] += 1
        if self._ready[b] == len(self.buckets[b]):
            self._launch(b)

    def _launch(self, b: int) -> None:
        outstanding = [i for i in self._order if not self._work[i][2]]
        if len(outstanding) >= self.in_flight:
            self._complete(outstanding[0])
        grads = [p.grad for p in self.buckets[b]]
        flat = _flatten_dense_tensors(grads)
        if self.reduce_dtype is not None and flat.dtype != self.reduce_dtype:
            flat = flat.to(self.reduce_dtype)
        scale = self.scale * (self._later if self._expected else 1.0)  # sent during the backward, or after
        self._work[b] = (dist.all_reduce(flat, group=self.group, async_op=True), flat, False, scale)
        self._order.append(b)

    def _complete(self, b: int) -> None:
        work, flat, done, scale = self._work[b]
        if done:
            return
        work.wait()
        grads = [p.grad for p in self.buckets[b]]
        flat = flat.to(grads[0].dtype).mul_(scale) if flat.dtype != grads[0].dtype else flat.mul_(scale)
        for p, synced in zip(self.buckets[b], _unflatten_dense_tensors(flat, grads)):
            p.grad.copy_(synced)
        self._work[b] = (None, None, True, 1.0)

    def finish(self) -> None:
        """After the backward: every bucket reduced and averaged (a bucket some of whose gradients
        never became final, e.g. no gradient reached them, is reduced now, zeros filled in)."""
        self._expected = 0  # what is sent from here on carries the gradients as they are now
        for b, params in enumerate(self.buckets):
            if self._work[b] is None:
                for p in params:
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                self._launch(b)
        for b in list(self._order):
            self._complete(b)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
