"""recipes/common/phases.py: a step's seconds per phase (summed over repeats) and what no phase covers."""
import time

import pytest
import torch

from recipes.common.phases import Phases, step_row


def test_phases_sum_their_spans_and_reset():
    ph = Phases(torch.device("cpu"))
    for _ in range(3):
        with ph("forward"):
            time.sleep(0.01)
    with ph("optimizer"):
        time.sleep(0.02)
    got = ph.take()
    assert set(got) == {"forward", "optimizer"}
    assert got["forward"] == pytest.approx(0.03, abs=0.02) and got["optimizer"] == pytest.approx(0.02, abs=0.015)
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
