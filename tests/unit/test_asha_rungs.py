"""sweep=asha's node side on real run dirs (no job): reports under the sweep's lock, the rung decided by
the point that completes it, paused points resumed or pruned, a failed point deciding on its end, and
the local controller's wait for the decision."""
from __future__ import annotations

import json

from launcher.features.asha import rungs
from launcher.run.rundir import RunDir, SweepDir
from launcher.run.status import Status
from launcher.runtime import local_controller

CFG = {"cluster": {"backend": "local"}, "train": {"steps": 6},
       "sweep": {"scheduler": "asha", "rungs": [2, 4], "reduction": 2, "mode": "min", "objective": "loss"}}


def sweep(tmp_path, n=4) -> SweepDir:
    sd = SweepDir(tmp_path / "sweep")
    for i in range(n):
        rd = sd.run(i)
        rd.path.mkdir(parents=True)
        rd.write_config(CFG)
        rd.write_run({"run_id": sd.run_id(i), "index": i})
        rd.set_status(Status.running, attempt=1, job_id=str(1000 + i))
    return sd


class JobsActedOn:
    """A backend that records what a decision does to the points' jobs; ``refuse``: its release raises."""

    pause_ends_job = True

    def __init__(self, refuse=None):
        self.acted, self.refuse = [], refuse

    def pause(self, job_id):
        self.acted.append(("pause", job_id))

    def resume_paused(self, job_id):
        if self.refuse:
            raise RuntimeError(self.refuse)
        self.acted.append(("release", job_id))

    def drop_paused(self, job_id):
        self.acted.append(("drop", job_id))

    def seal_after_job(self, *a):
        self.acted.append(("seal", a[1]))


def report(sd, p, step, value):
    rd = sd.run(p)
    return rungs.report(rd, rungs.rule_of(rd), step, value, attempt=int(rd.status().attempt or 1), seconds=1.0,
                        from_step=0, world=1, job_id=rd.status().job_id, startup_s=2.0)


def states(sd, n=4):
    return [sd.run(i).status().state.value for i in range(n)]


def test_the_point_that_completes_a_rung_decides_it(tmp_path):
    sd = sweep(tmp_path)
    assert [report(sd, p, 2, v) for p, v in [(0, 3.0), (1, 1.0), (2, 2.0)]] == ["wait"] * 3
    assert states(sd) == ["paused"] * 3 + ["running"]
    assert report(sd, 3, 2, 0.5) == "promoted"  # the best two: 3 (goes on) and 1 (resumed)
    assert states(sd) == ["pruned", "requeued", "pruned", "running"]
    st = sd.run(1).status()
    assert st.stop["reason"] == "promoted" and st.stop["step"] == 2
    assert sd.run(0).status().stop == {"rung": 0, "step": 2} and sd.run(0).seal_due()
    summ = rungs.summary(sd)
    assert summ["rungs"][0]["promoted"] == [1, 3] and summ["rungs"][0]["reported"] == 4
    assert summ["steps"] == 8 and summ["starts"] == 4


def test_a_point_that_fails_before_its_rung_is_decided_on_its_end(tmp_path):
    sd = sweep(tmp_path)
    for p, v in [(0, 3.0), (1, 1.0), (2, 2.0), (3, 0.5)]:
        report(sd, p, 2, v)
    sd.run(1).set_status(Status.running, attempt=2)  # resumed
    assert report(sd, 1, 4, 0.9) == "wait"  # 3 has not reported at step 4 yet
    sd.run(3).finish(Status.failed, seal=False, exit_code=1, error="boom")
    rungs.on_end(sd.run(3))
    assert states(sd) == ["pruned", "requeued", "pruned", "failed"]  # 1 goes on to train.steps
    assert rungs.summary(sd)["rungs"][1]["promoted"] == [1]


def test_a_promotion_is_not_a_restart_train_max_restarts_counts(tmp_path):
    rd = RunDir(tmp_path / "0")
    rd.path.mkdir()
    rd.record_restart({"attempt": 2, "reason": "promoted"})
    rd.record_restart({"attempt": 3, "reason": "failure"})
    rd.record_restart({"attempt": 4, "reason": "promoted"})
    assert rd.restarts_since_launch() == 1


def test_the_local_controller_waits_for_the_decision_and_acts_once(tmp_path):
    sd = sweep(tmp_path, 1)
    rd = sd.run(0)
    note = tmp_path / "note.json"
    note.write_text(json.dumps({"run": str(rd.path)}))
    assert local_controller.wait_if_paused(note, set()) is False  # running: not paused
    seen: set = set()
    # promoted before the controller saw its processes end: started again, once per attempt
    rd.set_status(Status.requeued, stop={"reason": "promoted"})
    assert local_controller.wait_if_paused(note, seen) is True
    assert local_controller.wait_if_paused(note, seen) is False
    rd.set_status(Status.running, attempt=2)
    rd.finish(Status.pruned, seal=False, exit_code=0)
    assert local_controller.wait_if_paused(note, seen) is False


def test_a_hydra_apps_point_pauses_through_the_backend_it_was_submitted_to(tmp_path, monkeypatch):
    """A Hydra app's run has no cluster group: its backend is run.json's (Slurm: the job is held, not
    left to a local controller that is not there)."""
    from launcher import backends

    paused = []

    class Held:
        pause_ends_job = True

        def pause(self, job_id):
            paused.append(job_id)

    monkeypatch.setattr(backends, "get", lambda name: paused.append(name) or Held())
    sd = SweepDir(tmp_path / "sweep")
    for i in range(2):
        rd = sd.run(i)
        rd.path.mkdir(parents=True)
        rd.write_config({"lr": 0.1})  # the app's own config
        rd.write_run({"run_id": sd.run_id(i), "index": i, "kind": "hydra_app", "backend": "slurm",
                      "sweep": {"scheduler": "asha", "rungs": [2, 4], "reduction": 2}})
        rd.set_status(Status.running, attempt=1, job_id=f"9_{i}")
    assert sd.run(0).backend_name() == "slurm"
    assert report(sd, 0, 2, 1.0) == "wait" and paused == ["slurm", "9_0"]


def test_a_rung_decided_on_a_full_disk_still_releases_and_drops_the_held_jobs(tmp_path, monkeypatch, capsys):
    """The order of effects: the decision's records (rungs.jsonl, the points' status) cannot be written,
    the point deciding still releases the promoted point's held job and drops the pruned ones' (a held job
    nobody releases waits in the queue for ever), says what was not recorded; `launcher status` settles."""
    import errno

    from launcher import backends

    fake = JobsActedOn()
    acted = fake.acted
    monkeypatch.setattr(backends, "get", lambda name: fake)
    sd = sweep(tmp_path)
    for p, v in [(0, 3.0), (1, 1.0), (2, 2.0)]:
        assert report(sd, p, 2, v) == "wait"
    full = OSError(errno.ENOSPC, "No space left on device")

    def no_room(*a, **k):
        raise full

    real_add = SweepDir.add_rung_rows
    monkeypatch.setattr(SweepDir, "add_rung_rows", lambda self, rows: no_room() if rows[0]["kind"] == "decision"
                        else real_add(self, rows))
    monkeypatch.setattr(RunDir, "finish_in_job", no_room)
    real_set = RunDir.set_status
    monkeypatch.setattr(RunDir, "set_status", lambda self, st, **kw: no_room() if st is Status.requeued
                        else real_set(self, st, **kw))
    # the report itself is written (the lock's file, add_report); the decision's records are not
    assert report(sd, 3, 2, 0.5) == "promoted"
    assert ("release", "1001") in acted and ("drop", "1000") in acted and ("drop", "1002") in acted, acted
    err = capsys.readouterr().err
    assert "the rung decisions was not recorded (No space left on device)" in err
    assert "point 1's promotion was not recorded" in err and "point 0 pruned was not recorded" in err
    assert not any(a == "seal" for a, _ in acted)  # nothing final recorded, nothing to seal yet


def test_a_point_whose_promotion_fails_ends_failed_and_its_held_job_is_dropped(tmp_path, monkeypatch):
    """`scontrol release` refused (the job purged, an admin's hold): the point cannot go on, so it ends
    `failed` saying why, and its held job leaves the queue instead of waiting there for ever."""
    from launcher import backends

    fake = JobsActedOn(refuse="scontrol release 1001: Job is no longer held")
    acted = fake.acted
    monkeypatch.setattr(backends, "get", lambda name: fake)
    sd = sweep(tmp_path)
    for p, v in [(0, 3.0), (1, 1.0), (2, 2.0)]:
        assert report(sd, p, 2, v) == "wait"
    assert report(sd, 3, 2, 0.5) == "promoted"  # 1 promoted, its release refused
    st = sd.run(1).status()
    assert st.state is Status.failed and "promoted at rung 0 but not resumed" in st.error
    assert "Job is no longer held" in st.error
    assert ("drop", "1001") in acted and ("drop", "1000") in acted and ("drop", "1002") in acted, acted
