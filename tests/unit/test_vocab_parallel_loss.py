"""recipes/gpt/parallel/tensor_parallel.py's vocab-parallel cross entropy on two tp ranks played by two
threads (the all-reduces met at a barrier, no process): the loss and gradient of 16-bit shards against
F.cross_entropy on the full fp32 logits, and the fp32 memory the 16-bit loss makes."""
from __future__ import annotations

import threading
from typing import Any, Dict, List

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from launcher.training.engines import contract
from recipes.gpt.parallel import tensor_parallel
from recipes.gpt.parallel.tensor_parallel import TPContext, vocab_parallel_cross_entropy

TP, ROWS, VOCAB, CHUNK = 2, 10, 32, 3  # 10 rows in chunks of 3 (4 chunks); 16 vocab entries a shard
SHARD = VOCAB // TP


class ThreadGroup:
    """all_reduce across threads, each a rank: every rank posts its tensor, all take the reduction."""

    def __init__(self, size: int) -> None:
        self.barrier = threading.Barrier(size, timeout=60)
        self.posted: List[Any] = [None] * size

    def all_reduce(self, tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM, group: Any = None) -> None:
        _, rank = group
        self.posted[rank] = tensor.clone()
        self.barrier.wait()
        stacked = torch.stack(self.posted)
        out = stacked.amax(0) if op == dist.ReduceOp.MAX else stacked.sum(0)
        self.barrier.wait()  # everyone has read the posts before the next collective overwrites them
        tensor.copy_(out)


class LargestFloat32(TorchDispatchMode):
    """The most elements of any fp32 tensor an op makes (forward and backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if torch.is_tensor(t) and t.dtype == torch.float32:
                self.largest = max(self.largest, t.numel())
        return out


def _run_ranks(logits: torch.Tensor, labels: torch.Tensor, monkeypatch) -> List[Dict[str, Any]]:
    """Each thread: its vocab shard of ``logits`` [b, s, V] through the loss and its backward."""
    group = ThreadGroup(TP)
    monkeypatch.setattr(tensor_parallel.dist, "all_reduce", group.all_reduce)
    results: List[Dict[str, Any]] = [{} for _ in range(TP)]

    def rank_main(rank: int) -> None:
        try:
            tp = TPContext(group=(group, rank), rank=rank, size=TP)
            shard = logits[..., rank * SHARD:(rank + 1) * SHARD].clone().requires_grad_()
            with LargestFloat32() as seen:
                loss = vocab_parallel_cross_entropy(shard, labels, tp, vocab_start=rank * SHARD)
                loss.backward()
            results[rank].update(loss=loss.detach(), grad=shard.grad, largest=seen.largest)
        except BaseException as e:  # surfaced in the test's thread
            group.barrier.abort()
            results[rank]["error"] = e

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(TP)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for r in results:
        if "error" in r:
            raise r["error"]
    return results


def _inputs(dtype: torch.dtype):
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(2, ROWS // 2, VOCAB, generator=g) * 3).to(dtype)
    labels = torch.randint(0, VOCAB, (2, ROWS // 2), generator=g)
    labels[0, :2] = torch.tensor([0, VOCAB - 1])  # a target on each shard's edge
    return logits, labels


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_shards_match_the_fp32_loss_without_an_fp32_copy(dtype, monkeypatch):
    """16-bit logits: each tp rank's loss is the full-vocabulary loss of the fp32 copy (to fp32
    rounding), its gradient that loss's gradient on its shard (to the logits' rounding, in their
    dtype), and no op makes an fp32 tensor bigger than one chunk of rows (the shard is 10 rows)."""
    monkeypatch.setattr(contract, "CHUNK_BYTES", 4 * SHARD * CHUNK)
    logits, labels = _inputs(dtype)
    ref_in = logits.float().requires_grad_()
    ref = F.cross_entropy(ref_in.reshape(-1, VOCAB), labels.reshape(-1))
    ref.backward()
    for rank, got in enumerate(_run_ranks(logits, labels, monkeypatch)):
        assert got["loss"].dtype == torch.float32 and got["grad"].dtype == dtype
        torch.testing.assert_close(got["loss"], ref.detach(), rtol=1e-6, atol=1e-6)
        want = ref_in.grad[..., rank * SHARD:(rank + 1) * SHARD]
        torch.testing.assert_close(got["grad"].float(), want, rtol=1e-2, atol=1e-4)
        assert got["largest"] <= CHUNK * SHARD < ROWS * SHARD, got["largest"]


def test_fp32_shards_keep_the_whole_shard_loss(monkeypatch):
    """fp32 logits take the unchunked path (the layouts compared bitwise stay as they were): the same
    loss and gradient as F.cross_entropy on the full logits, to fp32 rounding."""
    monkeypatch.setattr(contract, "CHUNK_BYTES", 4 * SHARD * CHUNK)
    logits, labels = _inputs(torch.float32)
    ref_in = logits.clone().requires_grad_()
    ref = F.cross_entropy(ref_in.reshape(-1, VOCAB), labels.reshape(-1))
    ref.backward()
    for rank, got in enumerate(_run_ranks(logits, labels, monkeypatch)):
        torch.testing.assert_close(got["loss"], ref.detach(), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(got["grad"], ref_in.grad[..., rank * SHARD:(rank + 1) * SHARD], rtol=1e-5,
                                   atol=1e-7)
        assert got["largest"] >= ROWS * SHARD  # the whole shard in one piece


def test_one_tp_rank_is_the_models_own_loss():
    """tp == 1: contract.cross_entropy (F.cross_entropy itself for fp32 logits, bitwise)."""
    logits, labels = _inputs(torch.float32)
    got = vocab_parallel_cross_entropy(logits, labels, TPContext.single(), 0)
    assert torch.equal(got, F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1)))
    half = logits.to(torch.bfloat16)
    assert torch.equal(vocab_parallel_cross_entropy(half, labels, TPContext.single(), 0),
                       contract.cross_entropy(half, labels))
