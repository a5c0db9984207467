"""Waiting on submitted runs asks the scheduler often enough: a job that leaves no result file (a killed
rank, a hang, a lost node) is seen ended within seconds, not after submitit's back-off (2 ... 128 s)."""
from __future__ import annotations

import io
import time
from types import SimpleNamespace

from omegaconf import OmegaConf

from launcher.status import Status
from launcher.submit import progress


class Job:
    """A job submitit would only see ended when it is asked (force_check): no result file."""

    def __init__(self, ends_at: float) -> None:
        self.ends_at, self.forced = ends_at, []

    def done(self, force_check: bool = False) -> bool:
        if force_check:
            self.forced.append(time.time())
        return force_check and time.time() >= self.ends_at


class RunDir:
    def __init__(self, final_at: float) -> None:
        self.final_at = final_at

    def metrics(self):
        return []

    def is_final(self) -> bool:
        return time.time() >= self.final_at

    def status(self):
        return SimpleNamespace(state=Status.failed if self.is_final() else Status.running, summary={}, error="x",
                               stop=None)


def test_a_job_with_no_result_file_is_seen_ended_soon_after_its_run_is(monkeypatch):
    monkeypatch.setattr(progress, "settle", lambda rd, ended=False: Status.failed)
    monkeypatch.setattr(progress, "log_of_failure", lambda r: "log")
    t0 = time.time()
    job = Job(ends_at=t0 + 0.6)
    run = SimpleNamespace(run_id="r", rundir=RunDir(final_at=t0 + 0.3), job=job, run_dir="d")
    point = SimpleNamespace(cfg=OmegaConf.create({"recipe": {"_target_": "my.fn"}}))
    ok = progress.wait_and_report(SimpleNamespace(runs=[run]), [point], io.StringIO(), poll_s=0.1)
    assert not ok
    assert time.time() - t0 < progress.ASK_FINAL_S + 1.5  # not the 10 s of a run still going
    assert job.forced and job.forced[0] - t0 >= progress.ASK_FINAL_S - 0.2  # asked once its run was final


def test_the_scheduler_is_asked_every_few_seconds_and_every_second_once_a_run_is_final():
    def going():
        return False

    def final():
        return True

    assert not progress._ask_scheduler(going, last=100.0, now=100.0 + progress.ASK_S - 1)
    assert progress._ask_scheduler(going, last=100.0, now=100.0 + progress.ASK_S)
    assert progress._ask_scheduler(final, last=100.0, now=100.0 + progress.ASK_FINAL_S)
    assert not progress._ask_scheduler(final, last=100.0, now=100.0 + progress.ASK_FINAL_S - 0.5)


def test_wait_done_asks_the_scheduler_once_the_run_is_final():
    """A Hydra point's job that left no result (its collect waits with this): ended within a second or
    two of its run's outcome, not after submitit's back-off."""
    t0 = time.time()
    job = Job(ends_at=t0 + 0.2)
    progress.wait_done(job, lambda: time.time() >= t0 + 0.3, poll_s=0.05)
    assert time.time() - t0 < progress.ASK_FINAL_S + 1.0 and job.forced
