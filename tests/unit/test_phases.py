"""recipes/common/phases.py: a step's seconds per phase (summed over repeats) and what no phase covers."""
import time

import pytest
import torch

from recipes.common.phases import Phases, step_row


def test_phases_sum_their_spans_and_reset():
    ph = Phases(torch.device("cpu"))
    inner, outer = {"forward": 0.0, "optimizer": 0.0}, {"forward": 0.0, "optimizer": 0.0}
    for name, seconds in [("forward", 0.01)] * 3 + [("optimizer", 0.02)]:
        t0 = time.perf_counter()
        with ph(name):
            t1 = time.perf_counter()
            time.sleep(seconds)
            inner[name] += time.perf_counter() - t1
        outer[name] += time.perf_counter() - t0
    got = ph.take()
    assert set(got) == {"forward", "optimizer"}
    # each phase the sum of its spans: between the time measured inside them and around them, however
    # long a loaded machine made the sleeps
    assert all(inner[k] - 1e-9 <= got[k] <= outer[k] + 1e-9 for k in got), (got, inner, outer)
    assert got["forward"] >= 0.03 and got["optimizer"] >= 0.02
    assert ph.take() == {}  # taken: the next step starts from nothing


def test_a_phase_that_raises_is_still_timed():
    ph = Phases("cpu")
    with pytest.raises(ValueError):
        with ph("backward"):
            raise ValueError("boom")
    assert "backward" in ph.take()


def test_step_row_names_the_keys_and_the_rest():
    row = step_row({"data": 0.1, "forward": 0.25}, step_time=0.5)
    assert row == {"time_data_s": 0.1, "time_forward_s": 0.25, "time_other_s": pytest.approx(0.15)}
    assert step_row({"forward": 0.6}, step_time=0.5)["time_other_s"] == 0.0  # clock skew never goes negative


class FakeEvent:
    """A CUDA event the test completes by hand (``done``); waiting on one is an error here."""

    clock = 0.0
    made: list = []

    def __init__(self, enable_timing: bool = False) -> None:
        self.done, self.at = False, None
        FakeEvent.made.append(self)

    def record(self) -> None:
        FakeEvent.clock += 1.0
        self.at = FakeEvent.clock

    def query(self) -> bool:
        return self.done

    def elapsed_time(self, end: "FakeEvent") -> float:
        assert self.done and end.done, "elapsed_time on an event the device has not reached"
        return (end.at - self.at) * 1e3  # ms

    def synchronize(self) -> None:
        raise AssertionError("Phases waited on the device")


def test_on_cuda_an_unfinished_span_is_read_at_the_next_take_without_waiting(monkeypatch):
    """On CUDA take() reads the spans the device finished and keeps the rest for the next step's
    take (one step late), never waiting on an event nor synchronizing the device."""
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(FakeEvent, "made", [])
    monkeypatch.setattr(torch.cuda, "synchronize", FakeEvent.synchronize)
    ph = Phases(torch.device("cuda"))
    with ph("forward"):
        pass
    with ph("optimizer"):
        pass
    fa, fb, oa, ob = FakeEvent.made  # start, end of each span
    fa.done = fb.done = oa.done = True  # the device is still in the optimizer step
    assert ph.take() == {"forward": pytest.approx(1.0)}
    ob.done = True
    assert ph.take() == {"optimizer": pytest.approx(1.0)}
    assert ph.take() == {}
