"""An asynchronous save with the universal form on (train.checkpoint.universal, the default) stays
asynchronous: the universal files are written from the host copy in the writer thread, not on the
training path; a tensor named by both forms is copied to host memory once."""
from __future__ import annotations

import threading

import torch
from omegaconf import OmegaConf
from test_fault_tolerance_parts import Ctx, make_run

from launcher.training import async_save, universal
from launcher.training.checkpoint import Checkpointer


class Engine:
    """A module and its optimizer, saved natively and by parameter name (as the DDP engine does)."""

    def __init__(self):
        torch.manual_seed(0)
        self.model = torch.nn.Linear(4, 3)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=0.1)

    def train_step(self):
        self.model(torch.ones(2, 4)).square().sum().backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def optimizers(self):
        return [self.optimizer]

    def save_native(self, path):
        return None

    def checkpoint_files(self):
        return {"model.pt": {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}}

    def universal_state(self):
        return universal.module_state(self.model, self.optimizer)


class Unlinked(Engine):
    """Whose native files do not hold every tensor of its universal form (an engine of DTensors, FSDP2's
    or tensor parallel's, writes its own shards): universal/ is written beside them (a DDP engine's is
    only named: launcher.training.universal_links, tests/unit/test_universal_links.py)."""

    def checkpoint_files(self):
        return {"model.pt": {"model": self.model.state_dict()}}


def _checkpointer(rd, engine):
    cfg = OmegaConf.create({"train": {"steps": 9, "fail_at_step": None, "fail_rank": 0, "fail_mode": "exception",
                                      "fail_attempt": None,
                                      "checkpoint": {"every": 2, "keep": 2, "async_save": True, "universal": True}}})
    return Checkpointer(cfg, Ctx(rd), engine)


def test_the_universal_form_is_written_by_the_writer_thread_from_the_state_at_the_save(tmp_path, monkeypatch):
    rd = make_run(tmp_path)
    engine = Unlinked()
    ck = _checkpointer(rd, engine)
    engine.train_step()
    at_save = {k: v.detach().clone() for k, v in engine.model.state_dict().items()}
    gate, writers = threading.Event(), []
    real = universal.save

    def held(state, path, rank, group=None):
        writers.append(threading.current_thread().name)
        assert gate.wait(20), "the test never released the universal write"
        return real(state, path, rank, group)

    monkeypatch.setattr(universal, "save", held)
    ck.save(2, [{"step": 1}, {"step": 2}])  # returns while the universal form waits on the gate
    assert not universal.present(rd.checkpoint_partial(2))
    engine.train_step()  # the copy is done: the next optimizer step changes the live state meanwhile
    gate.set()
    ck.finish()
    assert writers == ["checkpoint-writer"]
    final = rd.checkpoint_dir(2)
    assert universal.present(final)
    fresh = Engine()
    with torch.no_grad():
        for p in fresh.model.parameters():
            p.zero_()
    universal.load_module_state(fresh.model, fresh.optimizer, final / universal.DIR)
    for name, value in fresh.model.state_dict().items():
        assert torch.equal(value, at_save[name]), name  # the state of step 2, not the one trained after
    assert not torch.equal(engine.model.weight.detach(), at_save["weight"])


def test_a_tensor_named_twice_is_copied_once_and_reused_buffers_never_alias():
    w, m = torch.arange(6.0), torch.ones(3)
    state = {"native": {"w": w, "m": m}, "universal": {"model.w": w, "optim.m": m}}
    first = async_save.host_copy(state)
    assert first["native"]["w"] is first["universal"]["model.w"]
    assert first["native"]["m"] is first["universal"]["optim.m"]
    assert torch.equal(first["native"]["w"], w) and first["native"]["w"].data_ptr() != w.data_ptr()
    # the next save's state no longer shares a tensor: the reused buffers must not make them one
    w2 = torch.arange(6.0) * 2
    second = async_save.host_copy({"native": {"w": w2, "m": m}, "universal": {"model.w": w2.clone() + 1,
                                                                              "optim.m": m}}, first)
    assert second["native"]["w"] is first["native"]["w"]  # (its buffer reused)
    assert torch.equal(second["native"]["w"], w2)
    assert torch.equal(second["universal"]["model.w"], w2 + 1)
    assert second["universal"]["model.w"] is not second["native"]["w"]


def test_a_rank_that_failed_settles_its_save_in_flight_before_it_ends(tmp_path, monkeypatch):
    """The step raised while a save's write was in flight: settle_in_flight (what the failing rank calls
    before it records its failure) returns once that save is committed; bounded where it never is."""
    rd = make_run(tmp_path)
    engine = Unlinked()
    ck = _checkpointer(rd, engine)
    engine.train_step()
    gate = threading.Event()
    real = universal.save

    def held(state, path, rank, group=None):
        assert gate.wait(20), "the test never released the write"
        return real(state, path, rank, group)

    monkeypatch.setattr(universal, "save", held)
    ck.save(2, [{"step": 1}, {"step": 2}])
    assert ck.settle(timeout_s=0.3) is False  # bounded: the write still held
    threading.Timer(0.3, gate.set).start()
    async_save.settle_in_flight(timeout_s=20)
    assert rd.checkpoint_dir(2).exists() and universal.present(rd.checkpoint_dir(2))
    assert ck.settle(timeout_s=0) is True
