"""The megatron engine's data-parallel gradient buckets: the all-reduce of a bucket starts during
the backward, once the step's last micro-batch has accumulated into every gradient of it, and the
averaged result equals the plain all-reduce of every gradient."""
import tempfile

import pytest
import torch
import torch.distributed as dist
from torch import nn

from recipes.gpt.parallel.grad_buckets import GradBuckets


@pytest.fixture
def group():
    """A real (gloo) process group of one rank, in this process."""
    with tempfile.NamedTemporaryFile() as f:
        dist.init_process_group("gloo", init_method=f"file://{f.name}", rank=0, world_size=1)
        try:
            yield dist.group.WORLD
        finally:
            dist.destroy_process_group()


def _model():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)])


def test_buckets_start_during_the_backward_after_the_last_micro_batch(group):
    model = _model()
    params = list(model.parameters())
    sync = GradBuckets(params, group, world=1, bucket_bytes=2 * 64 * 65 * 4)  # two layers a bucket
    assert len(sync.buckets) == 3
    assert sync.buckets[0][0] is params[-1]  # the last layer's gradients are final first
    started = []
    sync.start_step(micro_batches=2)
    x = torch.randn(4, 64, requires_grad=True)
    model(x).sum().backward()
    assert all(w is None for w in sync._work)  # one micro-batch of two: nothing is final yet
    hook = model[0].register_full_backward_hook(lambda *a: started.append([w is not None for w in sync._work]))
    model(x).sum().backward()
    hook.remove()
    # when the backward reached the first layer, the buckets of the later layers were already sent
    assert started and started[0][0] and started[0][1]
    sync.finish()
    assert all(w is not None and w[2] for w in sync._work)


def test_the_average_equals_the_plain_all_reduce(group):
    ref, got = _model(), _model()
    x = torch.randn(4, 64)
    for m in (ref, got):
        for _ in range(3):
            m(x).pow(2).mean().backward()
    sync = GradBuckets(list(got.parameters()), group, world=1, bucket_bytes=10_000)
    # the hooks count from the next step on: redo it under them
    got.zero_grad(set_to_none=True)
    sync.start_step(3)
    for _ in range(3):
        got(x).pow(2).mean().backward()
    sync.finish()
    for a, b in zip(ref.parameters(), got.parameters()):
        assert torch.equal(a.grad, b.grad)  # world 1: the average is the gradient itself


def test_a_parameter_without_gradient_joins_with_zeros(group):
    model = _model()
    frozen_out = nn.Linear(64, 64)  # never used: no gradient reaches it
    params = list(model.parameters()) + list(frozen_out.parameters())
    sync = GradBuckets(params, group, world=1, bucket_bytes=64 * 65 * 4)
    sync.start_step(1)
    model(torch.randn(2, 64)).sum().backward()
    sync.finish()
    assert frozen_out.weight.grad is not None and not frozen_out.weight.grad.any()


def test_bf16_buckets_travel_in_bf16_and_come_back_in_the_gradients_dtype(group, monkeypatch):
    """reduce_dtype=bf16 (precision.grad_reduce_dtype): each bucket is all-reduced as a bf16 tensor
    (half the bytes); the gradients stay fp32, each the fp32 gradient rounded to bf16 (world 1)."""
    ref, got = _model(), _model()
    x = torch.randn(4, 64)
    ref(x).pow(2).mean().backward()
    sync = GradBuckets(list(got.parameters()), group, world=1, bucket_bytes=10_000, reduce_dtype=torch.bfloat16)
    sent = []
    real = dist.all_reduce
    monkeypatch.setattr(dist, "all_reduce", lambda t, *a, **k: sent.append(t.dtype) or real(t, *a, **k))
    sync.start_step(1)
    got(x).pow(2).mean().backward()
    sync.finish()
    assert sent and set(sent) == {torch.bfloat16}
    for a, b in zip(ref.parameters(), got.parameters()):
        assert b.grad.dtype == torch.float32
        assert torch.equal(b.grad, a.grad.to(torch.bfloat16).float())
