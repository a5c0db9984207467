"""Waiting on submitted runs asks the scheduler often enough: a job that leaves no result file (a killed
rank, a hang, a lost node) is seen ended within seconds, not after submitit's back-off (2 ... 128 s)."""
from __future__ import annotations

import io
import time
from types import SimpleNamespace

from omegaconf import OmegaConf

from launcher.run.status import Status
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

    def fallbacks(self):  # checkpoint_fallbacks.jsonl: none
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


def test_the_outcome_names_each_checkpoint_a_node_rejected_during_the_wait_and_the_step_it_loaded(monkeypatch):
    """checkpoint_fallbacks.jsonl rows written while the wait ran are said under the run's outcome line, one
    line per rejected checkpoint with the files and why; the rows of earlier attempts are not."""
    monkeypatch.setattr(progress, "settle", lambda rd, ended=False: Status.completed)
    earlier = {"attempt": 1, "resumed_from": "step_00000004", "from_step": 4,
               "rejected": {"step_00000006": ["checkpoints/step_00000006/meta.json missing"]}}
    now = {"attempt": 2, "resumed_from": "step_00000008", "from_step": 8,
           "rejected": {"step_00000012": ["checkpoints/step_00000012/model.pt changed (sha256 differs from "
                                          "checkpoint.json)"]}}

    class Resumed(RunDir):
        rows = [earlier]

        def fallbacks(self):
            return list(self.rows)

        def status(self):
            return SimpleNamespace(state=Status.completed, summary={}, error=None, stop=None)

    rd = Resumed(final_at=0)
    job = SimpleNamespace(done=lambda force_check=False: rd.rows.append(now) or True)  # the node wrote it meanwhile
    run = SimpleNamespace(run_id="r", rundir=rd, job=job, run_dir="d")
    point = SimpleNamespace(cfg=OmegaConf.create({"recipe": {"_target_": "my.fn"}}))
    out = io.StringIO()
    assert progress.wait_and_report(SimpleNamespace(runs=[run]), [point], out, poll_s=0.01)
    text = out.getvalue()
    assert ("  checkpoint step_00000012 rejected (model.pt changed (sha256 differs from checkpoint.json)): "
            "attempt 2 resumed from step 8 (step_00000008)\n") in text, text
    assert "step_00000006" not in text
    assert progress.fallback_lines([{"attempt": 3, "from_step": 0, "resumed_from": None,
                                     "rejected": {"step_00000002": []}}]) == [
        "checkpoint step_00000002 rejected (?): attempt 3 resumed from step 0 (None)"]
