"""The seal off the allocation: inside a job nobody seals (RunDir.finish_in_job leaves it due); after
the job the backend's seal job (Slurm: one node, one task, afterany), the local controller or the
login side's next refresh seals it. Nothing here starts a process: sbatch is a fake."""
import json
import time
import types
from pathlib import Path
from types import SimpleNamespace

import pytest

from launcher.backends import JobState, slurm
from launcher.run import outcome
from launcher.run.job_record import JobRecord
from launcher.run.rundir import RunDir, SweepDir
from launcher.run.status import RunStatus, Status
from launcher.runtime import after_step, local_controller, seal


def ended_in_job(root: Path, index: int = 0, status: Status = Status.completed) -> RunDir:
    """A run whose rank recorded its outcome inside the job: the seal left due."""
    rd = SweepDir(root / "s1").run(index)
    rd.path.mkdir(parents=True)
    rd.write_run({"run_id": f"s1-{index}"})
    rd.write_job(JobRecord(backend="slurm", job_id=f"7{index}", submitit_folder=str(root / "sub")))
    rd.set_status(Status.running)
    rd.rewrite_metrics([{"step": 1, "loss": 1.0}])
    assert rd.finish_in_job(status, exit_code=0)
    return rd


def test_a_run_ended_in_its_job_is_due_not_sealed_and_reads_intact_until_the_seal_job(tmp_path, capsys):
    rd = ended_in_job(tmp_path / "runs")
    assert rd.is_final() and not rd.is_sealed() and rd.seal_due()
    assert rd.verify() == [] and rd.seal_mark() is None and rd.lost_seal() is None
    assert (rd.path / "metrics.jsonl").stat().st_mode & 0o200  # nothing made read-only yet
    assert seal.main([str(rd.path)]) == 0 and "sealed" in capsys.readouterr().out
    assert rd.is_sealed() and not rd.seal_due() and rd.verify() == []
    assert rd.seal_mark()["manifest_sha256"] and not (rd.path / "metrics.jsonl").stat().st_mode & 0o222
    assert not seal.seal_if_due(rd)  # once


def test_a_config_changed_between_the_runs_end_and_its_seal_is_never_sealed_in(tmp_path, capsys):
    """The seal job (or the login side) seals seconds after the run reads final: a change to what launch
    wrote in that window is found against the digests the job's end held, named, and not sealed over."""
    rd = ended_in_job(tmp_path / "runs")  # launch wrote run.json; the job read it and ended
    mark = json.loads(rd._seal_mark().read_text())
    assert set(mark["held"]) == {"run.json"} and mark["held"] == rd.held_at_end()
    # the same records, untouched: nothing changed, the seal goes ahead as before
    assert rd.changed_since_end() == [] and rd.lost_seal() is None
    (rd.path / "run.json").write_text(json.dumps({"run_id": "s1-0", "seed": 99}))  # changed in the window
    assert rd.changed_since_end() == ["run.json"]
    assert "run.json changed after the run ended and before its seal" in rd.lost_seal()
    assert seal.main([str(rd.path)]) == 0
    assert not rd.is_sealed() and rd.seal() == {}  # never sealed over the change
    assert rd.verify() == [rd.lost_seal()]  # show, diff and reproduce report it


def test_the_seal_job_leaves_alone_what_is_not_due(tmp_path):
    running = SweepDir(tmp_path / "s").run(0)
    running.path.mkdir(parents=True)
    running.set_status(Status.running)
    assert not seal.seal_if_due(running) and not running.is_sealed()
    # finished without a due mark and without a manifest: reported, never sealed over
    bare = SweepDir(tmp_path / "s").run(1)
    bare.path.mkdir(parents=True)
    bare.finish(Status.failed, seal=False, error="x")
    assert bare.verify() == ["manifest.json missing for a finished run"] and not seal.seal_if_due(bare)
    # reopened by launcher resume before the seal job ran: the mark goes, nothing is sealed
    rd = ended_in_job(tmp_path / "runs")
    rd.seal()
    rd.reopen(1)
    assert not rd.seal_due() and not seal.seal_if_due(rd) and not rd.is_sealed()


@pytest.mark.parametrize("due,state,ended,age_s,expect", [
    (False, JobState(Status.completed, "COMPLETED"), True, 9999, False),  # nothing due
    (True, JobState(Status.running, "RUNNING"), False, 9999, False),  # its ranks may still be writing
    (True, JobState(Status.running, "COMPLETING"), True, 0, True),  # the caller saw it end
    (True, JobState(Status.failed, "FAILED"), False, 0, True),  # the scheduler says it ended
    (True, None, False, 30, False),  # unknown, outcome fresh: wait
    (True, None, False, 601, True),  # unknown and old: gone
])
def test_when_the_login_side_seals(due, state, ended, age_s, expect):
    now = time.time()
    ended_at = time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(now - age_s))
    ended_at = ended_at[:-2] + ":" + ended_at[-2:]
    st = RunStatus(state=Status.completed, ended=ended_at)
    assert outcome.seal_now(due, st, state, ended, now) is expect


def test_the_login_refresh_seals_a_due_run_whose_job_ended_and_no_other(tmp_path, monkeypatch):
    root = tmp_path / "runs"
    done, live = ended_in_job(root, 0), ended_in_job(root, 1, Status.failed)
    states = {"70": JobState(Status.completed, "COMPLETED"), "71": JobState(Status.running, "COMPLETING")}
    monkeypatch.setattr(outcome, "job_states", lambda jobs: {j["job_id"]: states[j["job_id"]] for j in jobs})
    assert outcome.settle_all([done, live]) == [Status.completed, Status.failed]
    assert done.is_sealed() and done.verify() == [] and not live.is_sealed() and live.seal_due()
    assert outcome.settle(live, ended=True) is Status.failed and live.is_sealed()


class FakeBackend:
    name = "fake"

    def __init__(self, answer="555", fail=False, nodes=2):
        self.calls, self.answer, self.fail, self.nodes = [], answer, fail, nodes

    def place(self, environ):
        return SimpleNamespace(num_nodes=self.nodes)

    def seal_after_job(self, run_dir, job_id, folder):
        self.calls.append((Path(run_dir), job_id, Path(folder)))
        if self.fail:
            raise RuntimeError("sbatch: error: QOSMaxSubmitJobPerUserLimit")
        return self.answer


def test_the_teardown_hands_a_due_seal_to_the_backend(tmp_path, monkeypatch, capsys):
    rd = ended_in_job(tmp_path / "runs")
    fake = FakeBackend()
    monkeypatch.setattr(after_step.backends, "get", lambda name: fake)
    note = tmp_path / "sub" / "requeue.70.json"
    note.parent.mkdir()
    note.write_text(json.dumps({"run": str(rd.path), "attempt": 1, "job_id": "70", "backend": "slurm"}))
    monkeypatch.setenv(after_step.ENV, str(note))
    assert after_step.main(["0"]) == 0
    assert fake.calls == [(rd.path, "70", note.parent)] and "sealed by job 555" in capsys.readouterr().err
    assert not rd.is_sealed() and rd.seal_due()  # the seal job seals it, not the teardown
    # nothing due (sealed already): nothing asked; a refused submission leaves it to the login side
    rd.seal()
    assert after_step.arrange_seal(rd, fake, "70", note.parent) is None and len(fake.calls) == 1
    other = ended_in_job(tmp_path / "runs", 1)
    assert after_step.arrange_seal(other, FakeBackend(fail=True), "71", note.parent) is None
    assert "next `launcher status` seals it" in capsys.readouterr().err and other.seal_due()


def test_a_one_node_job_seals_in_its_own_teardown(tmp_path, monkeypatch, capsys):
    """One node held: the teardown hashes it after the step, no job submitted (an array's tasks)."""
    rd = ended_in_job(tmp_path / "runs")
    fake = FakeBackend(nodes=1)
    assert after_step.arrange_seal(rd, fake, "72", tmp_path) == "this job's teardown"
    assert fake.calls == [] and rd.is_sealed() and rd.verify() == [] and not rd.seal_due()


def test_the_local_controller_seals_once_the_processes_ended(tmp_path):
    rd = ended_in_job(tmp_path / "runs")
    note = tmp_path / "requeue.1.json"
    assert not local_controller.seal_after(note)  # no note: the login side seals
    note.write_text(json.dumps({"run": str(rd.path), "attempt": 1, "job_id": "1"}))
    assert local_controller.seal_after(note) and rd.is_sealed() and rd.verify() == []


def test_slurms_seal_job_is_one_task_after_the_job_in_its_partition(tmp_path, monkeypatch):
    run = tmp_path / "runs dir" / "s1" / "3"
    env = {"SLURM_JOB_PARTITION": "gpu", "SLURM_JOB_ACCOUNT": "proj", "SLURM_JOB_ID": "9",
           "SLURM_CONF": "/etc/slurm.conf", "SBATCH_TIMELIMIT": "5", "PATH": "/bin"}
    cmd = slurm.seal_job_command(run, "9100_3", tmp_path / "sub", "/py/bin/python", env)
    assert cmd[0] == "sbatch" and "--dependency=afterany:9100_3" in cmd
    assert {"--nodes=1", "--ntasks=1", "--cpus-per-task=1", "--partition=gpu", "--account=proj"} <= set(cmd)
    assert not any(c.startswith("--qos") for c in cmd) and f"--output={tmp_path / 'sub' / 'seal.%j.out'}" in cmd
    assert cmd[-2:] == ["--wrap", f"/py/bin/python -m launcher.runtime.seal '{run}'"]
    assert slurm.submit_environment(env) == {"SLURM_CONF": "/etc/slurm.conf", "PATH": "/bin"}
    ran = []
    monkeypatch.setattr(slurm.jobs.subprocess, "run", lambda argv, **kw: ran.append((argv, kw["env"])) or
                        types.SimpleNamespace(returncode=0, stdout="777;cluster\n", stderr=""))
    monkeypatch.setenv("SLURM_JOB_PARTITION", "gpu")
    assert slurm.BACKEND.seal_after_job(run, "9", tmp_path / "sub") == "777"
    assert "--partition=gpu" in ran[0][0] and not any(k.startswith("SLURM_J") for k in ran[0][1])
    monkeypatch.setattr(slurm.jobs.subprocess, "run", lambda argv, **kw: types.SimpleNamespace(
        returncode=1, stdout="", stderr="sbatch: error: Batch job submission failed"))
    assert slurm.BACKEND.seal_after_job(run, "9", tmp_path / "sub") is None
    assert slurm.BACKEND.seal_after_job(run, None, tmp_path / "sub") is None
