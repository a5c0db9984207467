"""universal.module_state names a plain module's state (or the one DDP wraps) without DCP's per-name
walk: the same names, in the same order, holding the very tensors DCP's get_state_dict returns; where
DCP would rename or shard (activation checkpointing, torch.compile, FSDP2) or create the optimizer's
state, DCP's own is used."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict

from launcher.training import universal
from launcher.training.plain_state import plain_state


class Tied(torch.nn.Module):
    """A shared parameter (two names), a frozen layer, buffers (BatchNorm's)."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(10, 4)
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight
        self.norm = torch.nn.BatchNorm1d(4)
        self.frozen = torch.nn.Linear(4, 4)
        self.frozen.requires_grad_(False)


def _gpt():
    from omegaconf import OmegaConf

    from recipes.gpt.model import GPT

    return GPT(OmegaConf.create({"num_layers": 2, "hidden_size": 32, "num_heads": 2, "ffn_hidden_size": 64,
                                 "vocab_size": 64, "seq_len": 16}))


def _stepped(model, make=torch.optim.AdamW):
    opt = make([p for p in model.parameters() if p.requires_grad], lr=0.1)
    for p in model.parameters():
        p.grad = torch.ones_like(p) if p.requires_grad else None
    opt.step()
    return opt


def _same_as_dcp(model, opt):
    fast = plain_state(model, opt)
    assert fast is not None
    msd, osd = get_state_dict(model, opt)
    assert list(fast[0]) == list(msd)
    assert all(torch.equal(fast[0][k], msd[k]) and fast[0][k].data_ptr() == msd[k].data_ptr() for k in msd)
    assert list(fast[1]["state"]) == list(osd["state"])
    for name, moments in osd["state"].items():
        assert set(fast[1]["state"][name]) == set(moments)
        assert all(fast[1]["state"][name][k] is t for k, t in moments.items())


def test_a_gpt_and_a_module_with_a_shared_frozen_and_buffered_state_are_named_as_dcp_names_them():
    gpt = _gpt()
    _same_as_dcp(gpt, _stepped(gpt))
    tied = Tied()
    _same_as_dcp(tied, _stepped(tied, lambda ps, lr: torch.optim.SGD(ps, lr=lr, momentum=0.9)))
    assert universal.module_state(tied, _stepped(tied))["model"].keys() == tied.state_dict().keys()


def test_ddp_wrapping_is_dropped_as_dcp_drops_it(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(Tied())
        _same_as_dcp(ddp, _stepped(ddp))
        assert "emb.weight" in universal.module_state(ddp, _stepped(ddp))["model"]
    finally:
        dist.destroy_process_group()


def test_an_fsdp2_module_is_left_to_dcp(tmp_path):
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
        fully_shard(model)
        assert plain_state(model, _stepped(model)) is None  # its parameters are DTensors: DCP names them
    finally:
        dist.destroy_process_group()


def test_what_dcp_renames_or_would_initialise_is_left_to_dcp():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    wrapped = Tied()
    wrapped.frozen = checkpoint_wrapper(wrapped.frozen)
    assert plain_state(wrapped, _stepped(wrapped)) is None
    compiled = torch.compile(Tied())  # (wrapping only: nothing is compiled until it runs)
    assert plain_state(compiled, _stepped(compiled)) is None
    fresh = Tied()
    opt = torch.optim.AdamW(fresh.parameters())
    assert plain_state(fresh, opt) is None  # no state yet: DCP creates it (zeros)
    state = universal.module_state(fresh, opt)
    assert set(state["optim"]["emb.weight"]) == {"step", "exp_avg", "exp_avg_sq"}


def test_the_first_save_names_the_state_without_dcps_walk(monkeypatch):
    """The checkpointer's own path (module_state) takes the plain naming: DCP's get_state_dict is not
    called for a plain module whose optimizer has stepped."""
    import torch.distributed.checkpoint.state_dict as dsd

    gpt = _gpt()
    opt = _stepped(gpt)
    monkeypatch.setattr(dsd, "get_state_dict", lambda *a, **k: pytest.fail("DCP's walk on a plain module"))
    state = universal.module_state(gpt, opt)
    assert state["model"].keys() == gpt.state_dict().keys()
