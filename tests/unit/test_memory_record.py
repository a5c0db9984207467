"""recipes/common/memory.py: this process's resident memory, its peak, and what a construction used."""
import time

import torch

from recipes.common import memory
from recipes.common.memory import BuildMeter, StepPeak, host_peak_bytes, host_rss_bytes

MB = 1 << 20


def _touch(nbytes: int) -> torch.Tensor:
    return torch.ones(nbytes // 4, dtype=torch.float32)  # every page written: resident


def test_values_are_sane_and_the_peak_is_never_below_the_current():
    rss, peak = host_rss_bytes(), host_peak_bytes()
    assert 10 * MB < rss < 1 << 40  # an interpreter with torch holds tens of MB at least
    assert peak >= rss
    assert memory.device_bytes("cpu") is None and memory.device_peak_bytes("cpu") is None


def test_an_allocation_shows_up_in_the_current_and_the_peak():
    before = host_rss_bytes()
    held = _touch(200 * MB)
    assert host_rss_bytes() - before >= 180 * MB
    assert host_peak_bytes() >= host_rss_bytes()
    del held


def test_the_build_meter_sees_a_transient_peak_and_what_stays():
    with BuildMeter("cpu") as meter:
        kept = _touch(64 * MB)
        transient = _touch(160 * MB)
        del transient
    rec = meter.record()
    assert rec["host_peak_build_bytes"] >= (64 + 160 - 16) * MB, rec  # both were resident at once
    assert rec["host_peak_build_bytes"] < (64 + 160 + 64) * MB, rec
    assert rec["host_rss_after_build_bytes"] - rec["host_rss_before_build_bytes"] >= 56 * MB, rec
    assert rec["host_peak_source"] in ("hwm", "sampled")
    assert "device_after_build_bytes" not in rec  # CPU: the device memory is the host's
    del kept


def test_the_peak_is_measured_from_the_start_of_the_window_not_the_process():
    big = _touch(300 * MB)
    del big  # an earlier, larger peak of the process
    with BuildMeter("cpu") as meter:
        small = _touch(16 * MB)
    rec = meter.record()
    if rec["host_peak_source"] == "hwm":
        assert rec["host_peak_build_bytes"] < 100 * MB, rec
    del small


def test_without_a_resettable_high_water_mark_the_peak_is_sampled(monkeypatch):
    monkeypatch.setattr(memory, "reset_host_peak", lambda: False)
    with BuildMeter("cpu") as meter:
        t = _touch(128 * MB)
        deadline = time.time() + 30  # resident until a sample saw it (the sampler looks every 2 ms)
        while meter._sampler.peak - meter._before < 110 * MB:
            assert time.time() < deadline, "no sample of the sampler saw the 128 MB resident in 30 s"
            time.sleep(0.002)
        del t
    rec = meter.record()
    assert rec["host_peak_source"] == "sampled"
    assert rec["host_peak_build_bytes"] >= 110 * MB, rec


def test_the_step_peak_covers_what_came_after_its_start():
    peak = StepPeak("cpu").start()
    t = _touch(96 * MB)
    del t
    rec = peak.record()
    assert rec["host_peak_step_bytes"] >= host_rss_bytes() + 80 * MB, rec
    assert "device_peak_step_bytes" not in rec
