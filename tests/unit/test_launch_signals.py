"""Signals and crashes during a launch (issue 27): SIGTERM/SIGHUP handled as SIGINT, held while an
array is submitted and recorded; what a killed launch left repaired by `launcher runs` (the decision,
and the repair on real dirs with a fake scheduler); temporary multirun.yaml dirs of dead launches
removed. All pure: no process started, no job submitted (the real drill: benchmarks/launch_sigterm_drill.py,
its short version tests/integration/test_launch_sigterm.py)."""
import os
import signal
import socket
from pathlib import Path
from types import SimpleNamespace

import pytest

from launcher.archive import atomic
from launcher.run.job_record import JobRecord
from launcher.run.rundir import SweepDir
from launcher.run.status import Status
from launcher.submit import interrupted, signals, submission


@pytest.fixture
def handlers():
    saved = {s: signal.getsignal(s) for s in signals.HANDLED}
    for s in signals.HANDLED:  # as a fresh `launch` process has them
        signal.signal(s, signal.default_int_handler if s == signal.SIGINT else signal.SIG_DFL)
    signals.install()
    yield
    for s, h in saved.items():
        signal.signal(s, h)


# ---- signals ---------------------------------------------------------------------------------------


def test_sigterm_and_sighup_raise_like_sigint(handlers):
    for sig in (signal.SIGTERM, signal.SIGHUP):
        with pytest.raises(signals.Terminated) as got:
            os.kill(os.getpid(), sig)
        assert isinstance(got.value, KeyboardInterrupt) and got.value.exit_code == 128 + sig
    with pytest.raises(KeyboardInterrupt) as got:
        os.kill(os.getpid(), signal.SIGINT)
    assert not isinstance(got.value, signals.Terminated)


def test_a_signal_inside_a_shielded_block_waits_for_its_end(handlers):
    steps = []
    with pytest.raises(signals.Terminated):
        with signals.shielded():
            os.kill(os.getpid(), signal.SIGTERM)
            steps.append("after the signal")  # the sbatch's record: still written
            with signals.shielded():  # nested: only the outermost raises
                steps.append("nested")
            steps.append("end")
    assert steps == ["after the signal", "nested", "end"]
    with signals.shielded():
        pass  # nothing held any more


def test_a_handler_someone_else_installed_is_kept():
    saved = signal.getsignal(signal.SIGTERM)
    mine = lambda *_: None  # noqa: E731
    try:
        signal.signal(signal.SIGTERM, mine)
        signals.install()
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, saved)


def test_handled_installs_for_the_block_only_and_sends_the_signal_again():
    """Inside someone else's process (a Hydra app's multirun): ours only while the block runs, theirs
    back after it, a SIGTERM that stopped the block sent again to the process's own disposition."""
    saved = {s: signal.getsignal(s) for s in signals.HANDLED}
    theirs = lambda *_: None  # noqa: E731
    sent = []
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGHUP, theirs)
        with signals.handled(resend=lambda pid, sig: sent.append(sig)):
            assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL  # ours now
            assert signal.getsignal(signal.SIGHUP) is theirs  # someone else's: kept
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL and sent == []
        with pytest.raises(signals.Terminated):
            with signals.handled(resend=lambda pid, sig: sent.append(sig)):
                os.kill(os.getpid(), signal.SIGTERM)
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL and sent == [signal.SIGTERM]
        assert signal.getsignal(signal.SIGHUP) is theirs
    finally:
        for s, h in saved.items():
            signal.signal(s, h)


def _runs(tmp_path, sd, indices):
    out = []
    for i in indices:
        rd = sd.staging(i)
        rd.path.mkdir(parents=True)
        rd.write_run({"run_id": sd.run_id(i), "index": i, "backend": "fake"})
        out.append(SimpleNamespace(run_id=sd.run_id(i), staged=rd, rundir=sd.run(i)))
    return out


def test_sigterm_during_an_array_lands_between_arrays(handlers, tmp_path, monkeypatch):
    """The array being submitted when SIGTERM came is submitted and recorded whole; the later arrays'
    runs are cancelled "not submitted"; what was queued is published; then the launch stops."""
    sd = SweepDir(tmp_path / "s")
    runs = _runs(tmp_path, sd, range(4))
    planned = [submission.Array(runs[:2], 1), submission.Array(runs[2:], 1)]
    told = []

    def fake_submit_array(arr, known, job_name, queued):
        os.kill(os.getpid(), signal.SIGTERM)  # arrives while sbatch runs
        queued("100", arr.points)
        rec = JobRecord(backend="fake", job_id="100_0", array_job_id="100")
        for r in arr.points:
            r.staged.write_job(rec)
        return [submission.SubmittedRun(r.run_id, r.rundir, "100_0", record=rec) for r in arr.points]

    monkeypatch.setattr(submission, "_submit_array", fake_submit_array)
    published = []
    with pytest.raises(signals.Terminated):
        submission.submit(planned, {}, publish=lambda r, j: published.append(([x.run_id for x in r], j)),
                          queued=lambda job, pts: told.append((job, [p.run_id for p in pts])))
    assert told == [("100", [sd.run_id(0), sd.run_id(1)])]
    assert published == [([sd.run_id(0), sd.run_id(1)], ["100"])]
    assert all(r.staged.job() is not None and not r.staged.is_final() for r in runs[:2])
    for r in runs[2:]:
        st = r.staged.status()
        assert st.state == Status.cancelled and st.error.startswith("not submitted: the launch was interrupted"), st


# ---- the repair's decision ------------------------------------------------------------------------


def test_recorded_runs_are_published():
    plan = interrupted.decide({0: "7", 1: "7"}, {"7": [0, 1]}, {"7"})
    assert plan.publish == [0, 1] and not plan.cancel_jobs and not plan.cancelled and not plan.remove


def test_an_array_not_recorded_for_every_run_is_cancelled():
    plan = interrupted.decide({0: "7", 1: None}, {"7": [0, 1]}, {"7"})
    assert plan.cancel_jobs == ["7"] and sorted(plan.cancelled) == [0, 1] and not plan.publish
    assert "its array 7 was cancelled" in plan.cancelled[1]


def test_a_job_the_journal_never_heard_of_is_cancelled_and_its_runs_too():
    """Killed between sbatch's return and the journal: the job is found by its batch script."""
    plan = interrupted.decide({0: None, 1: None}, {}, {"9"})
    assert plan.cancel_jobs == ["9"] and sorted(plan.cancelled) == [0, 1] and not plan.remove
    assert plan.cancelled[0].startswith("not submitted")


def test_later_arrays_never_queued_are_published_cancelled():
    plan = interrupted.decide({0: "7", 1: "7", 2: None}, {"7": [0, 1]}, set())
    assert plan.publish == [0, 1] and list(plan.cancelled) == [2] and not plan.cancel_jobs


def test_nothing_queued_means_nothing_kept():
    plan = interrupted.decide({0: None, 1: None}, {}, set())
    assert plan.remove and not plan.publish and not plan.cancel_jobs


def test_a_launch_still_running_or_on_another_host_is_left_alone():
    here = socket.gethostname()
    assert interrupted.launch_alive({"host": here, "pid": 5}, here, alive=lambda pid: True)
    assert not interrupted.launch_alive({"host": here, "pid": 5}, here, alive=lambda pid: False)
    assert interrupted.launch_alive({"host": "elsewhere", "pid": 5}, here, alive=lambda pid: False)


# ---- the repair on real dirs (a fake scheduler) ---------------------------------------------------


class FakeBackend:
    name = "fake"

    def __init__(self, found=()):
        self.found, self.cancelled = list(found), []

    def jobs_in_folder(self, folder):
        return self.found

    def cancel(self, job):
        self.cancelled.append(job.job_id)

    def states(self, jobs):
        return {}


def _killed_launch(tmp_path, recorded, journal_arrays, dead=True):
    sd = SweepDir(tmp_path / "runs" / "20260101-000000-abcd")
    interrupted.begin(sd.path, "fake", list(recorded))
    journal = atomic.read_json(sd.path / interrupted.JOURNAL)
    journal["pid"] = 2 ** 22 + 12345 if dead else os.getpid()
    journal["arrays"] = [{"job_id": j, "runs": r} for j, r in journal_arrays.items()]
    atomic.write_json(sd.path / interrupted.JOURNAL, journal)
    for i, job in recorded.items():
        rd = sd.staging(i)
        rd.path.mkdir(parents=True)
        rd.write_config({"seed": i})
        rd.write_run({"run_id": sd.run_id(i), "sweep_id": sd.sweep_id, "index": i, "backend": "fake",
                      "argv": ["launch", "-m"]})
        if job:
            rd.write_job(JobRecord(backend="fake", job_id=f"{job}_{i}", array_job_id=job, array_task_id=i))
    return sd


@pytest.fixture
def fake(monkeypatch):
    from launcher import backends
    from launcher.archive import registry

    backend = FakeBackend()
    monkeypatch.setattr(backends, "get", lambda name: backend)
    monkeypatch.setattr(registry, "job_states", lambda jobs: {})
    return backend


def test_runs_repairs_a_launch_killed_after_it_recorded_its_array(tmp_path, fake):
    sd = _killed_launch(tmp_path, {0: "7", 1: "7"}, {"7": [0, 1]})
    lines = interrupted.repair(sd.path.parent)
    assert lines == [f"sweep {sd.sweep_id}: repaired an interrupted launch: published 2 run(s) whose job is recorded"]
    assert [rd.path.name for rd in sd.runs()] == ["0", "1"] and not list(sd.path.glob(".*.partial"))
    assert sd.read()["job_ids"] == ["7"] and sd.read()["runs"] == [sd.run_id(0), sd.run_id(1)]
    assert not (sd.path / interrupted.JOURNAL).exists() and fake.cancelled == []
    from launcher.archive import registry

    listed = registry.list_runs(sd.path.parent, refresh=False)
    assert sorted(r["run_id"] for r in listed) == [sd.run_id(0), sd.run_id(1)]
    assert interrupted.repair(sd.path.parent) == []  # once


def test_runs_cancels_an_array_the_killed_launch_had_not_recorded(tmp_path, fake):
    fake.found = ["8"]  # squeue: a job whose batch script is in the sweep's submitit folder
    sd = _killed_launch(tmp_path, {0: None, 1: None}, {})
    lines = interrupted.repair(sd.path.parent)
    assert fake.cancelled == ["8"] and "cancelled job(s) 8" in lines[0], lines
    assert [d.status().state for d in sd.runs()] == [Status.cancelled] * 2
    assert all(d.is_sealed() for d in sd.runs())


def test_runs_removes_a_launch_killed_before_anything_was_queued(tmp_path, fake):
    sd = _killed_launch(tmp_path, {0: None, 1: None}, {})
    lines = interrupted.repair(sd.path.parent)
    assert "nothing was queued" in lines[0] and not sd.path.exists()


def test_runs_leaves_a_launch_in_progress_alone(tmp_path, fake):
    sd = _killed_launch(tmp_path, {0: "7", 1: None}, {"7": [0, 1]}, dead=False)
    assert interrupted.repair(sd.path.parent) == []
    assert len(list(sd.path.glob(".*.partial"))) == 2 and fake.cancelled == []


# ---- the temporary hydra.sweep.dir (multirun.yaml, secrets in it) ---------------------------------


def test_a_killed_launchs_multirun_yaml_is_removed_by_the_next(tmp_path):
    from hydra_plugins.launcher_plugin.plugin import TMP_PREFIX, remove_stale_sweep_dirs

    dead, live, old = (tmp_path / f"{TMP_PREFIX}{n}" for n in ("4000001-x1", "4000002-x2", "abcdefgh"))
    for d in (dead, live, old):
        d.mkdir()
        (d / "multirun.yaml").write_text("HF_TOKEN: hf_secret\n")
    gone = remove_stale_sweep_dirs(tmp_path, alive=lambda pid: pid == 4000002)
    assert gone == [dead] and live.exists() and old.exists()  # an older launcher's: only once an hour old
    os.utime(old, (1, 1))
    assert remove_stale_sweep_dirs(tmp_path, alive=lambda pid: True) == [old]


def test_the_journal_is_written_before_staging_and_gone_after_publish(tmp_path):
    sd = SweepDir(tmp_path / "s")
    interrupted.begin(sd.path, "slurm", [0, 1])
    interrupted.queued(sd.path, "55", [0, 1])
    j = atomic.read_json(sd.path / interrupted.JOURNAL)
    assert j["pid"] == os.getpid() and j["arrays"] == [{"job_id": "55", "runs": [0, 1]}]
    interrupted.end(sd.path)
    assert not Path(sd.path / interrupted.JOURNAL).exists()
