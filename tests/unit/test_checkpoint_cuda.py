"""The checkpointer's CUDA calls, against a fake CUDA module (no GPU needed, one process): CUDA's
current device is per host thread (a new thread starts on device 0), so every wait must name the
rank's device or an event recorded on it. The rank here is bound to device 3; float32 tensors play
its GPU tensors, int64 ones host tensors (an optimizer's step counter)."""
import threading
from typing import Any, List, Optional, Tuple

import pytest
import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from launcher.run.rundir import RunDir
from launcher.training import async_save, checkpoint

DEVICE = 3


class FakeStream:
    def __init__(self, cuda: "FakeCuda", device: int, kind: str) -> None:
        self.cuda, self.device, self.kind = cuda, device, kind

    def __repr__(self) -> str:
        return f"{self.kind}{self.device}"

    def wait_stream(self, other: "FakeStream") -> None:
        self.cuda.rec("wait_stream", self, other)

    def wait_event(self, event: "FakeEvent") -> None:
        self.cuda.rec("wait_event", self, event)


class FakeEvent:
    def __init__(self, cuda: "FakeCuda") -> None:
        self.cuda, self.stream = cuda, None

    def record(self, stream: FakeStream) -> None:
        self.stream = stream
        self.cuda.rec("record", self, stream)

    def synchronize(self) -> None:
        assert self.stream is not None, "an event waited on before it was recorded"
        self.cuda.rec("event_synchronize", self)


class FakeCuda:
    """What the checkpointer uses of torch.cuda; every call logged as (thread, thread's device, call, args)."""

    def __init__(self) -> None:
        self.log: List[Tuple[Any, ...]] = []
        self.tls = threading.local()
        self.compute = {}  # device -> its default (compute) stream

    def rec(self, *call: Any) -> None:
        self.log.append((threading.current_thread().name, getattr(self.tls, "device", 0), *call))

    def is_available(self) -> bool:
        self.rec("is_available")
        return True

    def current_device(self) -> int:
        self.rec("current_device")
        return getattr(self.tls, "device", 0)

    def set_device(self, device: int) -> None:
        self.rec("set_device", int(device))
        self.tls.device = int(device)

    def current_stream(self, device: Optional[int] = None) -> FakeStream:
        dev = getattr(self.tls, "device", 0) if device is None else int(device)
        self.rec("current_stream", dev)
        active = getattr(self.tls, "stream", None)
        if active is not None and active.device == dev:
            return active
        return self.compute.setdefault(dev, FakeStream(self, dev, "compute"))

    def Stream(self, device: Optional[int] = None) -> FakeStream:  # noqa: N802 (torch.cuda's name)
        dev = getattr(self.tls, "device", 0) if device is None else int(device)
        self.rec("Stream", dev)
        return FakeStream(self, dev, "side")

    def Event(self) -> FakeEvent:  # noqa: N802
        self.rec("Event")
        return FakeEvent(self)

    def stream(self, s: FakeStream):
        cuda = self

        class Guard:
            def __enter__(self):
                cuda.rec("stream_enter", s)
                self.prev = getattr(cuda.tls, "stream", None)
                cuda.tls.stream = s

            def __exit__(self, *exc):
                cuda.tls.stream = self.prev
                cuda.rec("stream_exit", s)

        return Guard()

    def synchronize(self, device: Optional[int] = None) -> None:
        self.rec("synchronize", device)

    def calls(self, name: str) -> List[Tuple[Any, ...]]:
        return [c for c in self.log if c[2] == name]


class Engine:
    """A rank's part: a 'GPU' parameter (float32) and its optimizer, whose state holds a 'host' step
    counter (int64); ``empty``: a rank that writes nothing (ddp's data-parallel ranks but the first)."""

    def __init__(self, empty: bool = False) -> None:
        self.p = torch.nn.Parameter(torch.arange(4.0))
        self.optimizer = torch.optim.SGD([self.p], lr=1.0)
        self.steps = torch.zeros((), dtype=torch.int64)
        self.empty = empty

    def train_step(self) -> None:
        self.p.grad = -torch.ones(4)
        self.optimizer.step()  # the checkpointer's pre-hook runs first
        self.steps += 1

    def optimizers(self):
        return [self.optimizer]

    def save_native(self, path):
        pass

    def checkpoint_files(self):
        return {} if self.empty else {"model.pt": {"w": self.p, "steps": self.steps}}

    def load_checkpoint(self, path):
        pass


class Ctx:
    attempt = 1

    def __init__(self, rd, rank=0, world=1):
        self.rundir, self.rank, self.world_size = rd, rank, world

    def heartbeat(self, step=None):
        pass


@pytest.fixture
def fake(monkeypatch):
    cuda = FakeCuda()
    monkeypatch.setattr(async_save, "cuda", cuda)
    monkeypatch.setattr(async_save, "_device_index", lambda t: DEVICE if t.dtype == torch.float32 else None)

    def host_buffer(src, pinned):
        cuda.rec("host_buffer", pinned, getattr(cuda.tls, "stream", None))
        return torch.empty(src.shape, dtype=src.dtype)

    monkeypatch.setattr(async_save, "_host_buffer", host_buffer)
    cuda.tls.device = DEVICE  # the runtime bound the main thread (torch.cuda.set_device(local rank))
    return cuda


def make(tmp_path, empty=False, rank=0, world=1):
    rd = RunDir(tmp_path / "run")
    rd.path.mkdir(parents=True)
    cfg = OmegaConf.create({"train": {"steps": 9, "fail_at_step": None, "fail_rank": 0, "fail_mode": "exception",
                                      "fail_attempt": None,
                                      "checkpoint": {"every": 1, "keep": 3, "async_save": True}}})
    engine = Engine(empty)
    store = dist.HashStore()  # (the other ranks' counts: none here)
    return checkpoint.Checkpointer(cfg, Ctx(rd, rank, world), engine, store=store), engine, rd


def _index(log, pred) -> int:
    return next(i for i, c in enumerate(log) if pred(c))


def test_the_writer_waits_on_an_event_recorded_on_the_ranks_device(tmp_path, fake, capsys):
    ck, engine, rd = make(tmp_path)
    engine.train_step()
    ck.save(1, [{"step": 1}])
    # the pinned host memory the copies hold for the whole run, said when first allocated (the simulated
    # buffers are not pinned: 0.00 GiB)
    assert capsys.readouterr().out.count("GiB of pinned host memory hold this rank's async-save copies") == 1
    engine.train_step()  # the next optimizer step: its stream waits for the copies (on the device)
    ck.finish()
    log = fake.log
    assert fake.calls("synchronize") == []  # never a device-wide wait (the thread's device could be 0)

    # main thread: a side stream of device 3 waits for device 3's compute stream, then the GPU tensor's
    # copy goes to a pinned buffer on that side stream, then an event is recorded there
    side_waits = _index(log, lambda c: c[2] == "wait_stream")
    _, dev, _, side, compute = log[side_waits]
    assert (log[side_waits][0], dev, repr(side), repr(compute)) == ("MainThread", 3, "side3", "compute3")
    buffers = fake.calls("host_buffer")
    # the GPU tensor's buffer pinned, the host one not (the writer thread copies that one)
    assert sorted((c[0], c[3], c[4]) for c in buffers) == [("MainThread", False, side), ("MainThread", True, side)]
    assert side_waits < log.index(buffers[0])
    (rec,) = fake.calls("record")
    _, _, _, event, on = rec
    assert on is side and log.index(buffers[0]) < log.index(rec)

    # the writer thread binds the rank's device first, then waits on that event (not on device 0)
    writer = [c for c in log if c[0] == "checkpoint-writer"]
    assert writer[0][2:] == ("set_device", DEVICE)
    waits = fake.calls("event_synchronize")
    assert [(c[0], c[1], c[3]) for c in waits] == [("checkpoint-writer", DEVICE, event)]
    assert event.stream.device == DEVICE

    # the optimizer's pre-hook made the compute stream of device 3 wait for the event: no host block
    assert [(c[0], repr(c[3]), c[4]) for c in fake.calls("wait_event")] == [("MainThread", "compute3", event)]
    assert not any(c[0] == "checkpoint-pruner" for c in log)  # the pruner makes no CUDA call

    saved = torch.load(rd.checkpoint_dir(1) / "model.pt", weights_only=True)
    assert saved["w"].tolist() == [1.0, 2.0, 3.0, 4.0] and int(saved["steps"]) == 1  # the state after step 1


def test_the_next_save_reuses_the_buffers_and_the_side_stream(tmp_path, fake):
    ck, engine, rd = make(tmp_path)
    for step in (1, 2):
        engine.train_step()
        ck.save(step, [{"step": s} for s in range(1, step + 1)])
    ck.finish()
    assert len(fake.calls("Stream")) == 1 and len(fake.calls("host_buffer")) == 2  # the first save's only
    assert [c[0] for c in fake.calls("event_synchronize")] == ["checkpoint-writer"] * 2
    assert fake.calls("synchronize") == []
    saved = torch.load(rd.checkpoint_dir(2) / "model.pt", weights_only=True)
    assert saved["w"].tolist() == [2.0, 3.0, 4.0, 5.0] and int(saved["steps"]) == 2


def test_a_synchronous_save_waits_on_its_own_event_in_the_main_thread(tmp_path, fake):
    ck, engine, rd = make(tmp_path)
    engine.train_step()
    ck.save(1, [{"step": 1}], block=True)
    assert fake.calls("synchronize") == []
    (wait,) = fake.calls("event_synchronize")
    (rec,) = fake.calls("record")
    assert wait[:2] == ("MainThread", DEVICE) and wait[3] is rec[3] and rec[4].device == DEVICE
    assert rd.latest_checkpoint() == rd.checkpoint_dir(1)


@pytest.mark.parametrize("block", [False, True])
def test_an_empty_part_makes_no_cuda_call(tmp_path, fake, block):
    """A rank with nothing of its own to write (ddp: data-parallel ranks but the first) writes its RNG
    states and its mark, in a thread that never touches CUDA (no context on GPU 0)."""
    ck, engine, rd = make(tmp_path, empty=True, rank=1, world=2)
    engine.train_step()
    ck.save(1, [], block=block)
    engine.train_step()
    ck.finish()
    assert fake.log == []
    assert (rd.checkpoint_partial(1) / checkpoint.DONE_FILE.format(rank=1)).exists()


def test_a_host_only_state_copies_in_the_writer_thread_without_cuda(tmp_path, fake, monkeypatch):
    """No GPU tensor (a CPU run): the writer thread copies and writes it; no CUDA call anywhere."""
    monkeypatch.setattr(async_save, "_device_index", lambda t: None)
    ck, engine, rd = make(tmp_path)
    engine.train_step()
    ck.save(1, [{"step": 1}])
    engine.train_step()
    ck.finish()
    # (host_buffer is this test's own log line: the buffers are made and filled in the writer thread)
    assert [c[:3] for c in fake.log] == [("checkpoint-writer", 0, "host_buffer")] * 2
    saved = torch.load(rd.checkpoint_dir(1) / "model.pt", weights_only=True)
    assert saved["w"].tolist() == [1.0, 2.0, 3.0, 4.0]
