"""Waves (launcher.submit.waves): a sweep past the scheduler's room is queued in parts by its own jobs.
The pure parts: how many points go now (one slot kept for the wave job), the plan's record, arrays()
leaving the rest in order, the wave job's sbatch line, a dry run that previews the waves, and
submit.waves=false refusing such a sweep as before. The queueing itself is drilled on the real Slurm
cluster (tests/integration/test_waves.py)."""
import io
import math
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from launcher.app import CONF_DIR, normalize_overrides
from launcher.backends import slurm
from launcher.run.status import FINAL, STATUSES, Status
from launcher.run.waves_record import Wave, WavePlan
from launcher.submit import submission
from launcher.sweeps import ArrayLimits, TooManyJobs, first_points, wave_cut


def _cfg(*overrides):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=normalize_overrides(["cluster=local_slurm", "model=gpt_tiny",
                                                                            *overrides]))


def test_the_points_queued_now_leave_one_slot_for_the_wave_job():
    assert wave_cut(3, 4) == 3 and wave_cut(4, 4) == 4  # they fit: every one, no wave job
    assert wave_cut(9, 4) == 3  # 3 points + the wave job = the 4 jobs the user may queue
    assert wave_cut(1000, 200) == 199
    assert wave_cut(5, 1) == 0 and wave_cut(5, 0) == 0  # only the wave job fits, or nothing
    assert wave_cut(10, math.inf) == 10


def test_the_first_points_are_taken_group_by_group_in_order():
    assert first_points([["a", "b"], ["c", "d", "e"]], 3) == [["a", "b"], ["c"]]
    assert first_points([["a", "b"], ["c"]], 2) == [["a", "b"]]
    assert first_points([["a"]], 0) == [] and first_points([["a"]], -1) == []


def test_the_plan_round_trips_and_says_where_it_stands():
    plan = WavePlan(waiting=tuple(range(3, 9)), backend="slurm").queued(
        Wave(("101", "102"), (0, 1, 2), "2026-12-06T13:00:00", "launch"), list(range(3, 9)), "103")
    assert WavePlan.from_json(plan.to_json()) == plan
    assert plan.describe() == "waves: 1 queued (3 run(s)), 6 run(s) waiting for wave job 103"
    nxt = plan.queued(Wave(("104",), (3, 4, 5), "t", "wave job 103"), [6, 7, 8], "105")
    assert [w.runs for w in nxt.waves] == [(0, 1, 2), (3, 4, 5)] and nxt.waiting == (6, 7, 8) and nxt.job_id == "105"
    done = nxt.queued(Wave(("106",), (6, 7, 8), "t", "wave job 105"), [], None)
    assert not done.waiting and done.describe() == "waves: 3 queued (9 run(s)), 0 run(s) waiting"
    assert WavePlan.from_json(None) is None and WavePlan.from_json({"waiting": "3"}) is None


def test_waiting_is_a_status_of_its_own_and_not_an_outcome():
    assert Status.waiting.value in STATUSES and Status.waiting.value not in FINAL


def _limits(monkeypatch, room_of: ArrayLimits):
    monkeypatch.setattr(slurm.SlurmBackend, "array_limits", lambda self, cfg=None: room_of)
    monkeypatch.setattr(slurm.SlurmBackend, "request_problems", lambda self, cfg: [])


def test_arrays_queue_what_fits_and_leave_the_rest_in_order(monkeypatch):
    points = [_cfg(f"seed={s}") for s in range(9)]
    _limits(monkeypatch, ArrayLimits(2, 5, 1))  # room 4: 3 points and the wave job
    left = []
    planned = submission.arrays(points, cfg=lambda c: c, left=left)
    assert [len(a.points) for a in planned] == [2, 1]  # MaxArraySize 2 still splits them
    assert [p for a in planned for p in a.points] == points[:3] and left == points[3:]
    with pytest.raises(TooManyJobs, match="MaxSubmitJobs"):  # without waves: refused as before
        submission.arrays(points, cfg=lambda c: c)

    _limits(monkeypatch, ArrayLimits(None, 5, 4))  # room 1: only the wave job; every point waits
    left = []
    assert submission.arrays(points, cfg=lambda c: c, left=left) == [] and left == points
    _limits(monkeypatch, ArrayLimits(None, 5, 5))  # no room at all, not even for the wave job: refused
    with pytest.raises(TooManyJobs):
        submission.arrays(points, cfg=lambda c: c, left=[])
    _limits(monkeypatch, ArrayLimits(None, 50, 0))  # they fit: nothing left
    left = []
    assert len(submission.arrays(points, cfg=lambda c: c, left=left)) == 1 and left == []


def test_a_dry_run_previews_the_first_wave_and_counts_the_rest(tmp_path, capsys, monkeypatch):
    from launcher.submit import pipeline

    monkeypatch.setattr(slurm.SlurmBackend, "request_problems", lambda self, cfg: [])
    points = [pipeline.Point(_cfg(f"seed={s}", "cluster.max_submit_jobs=3", f"submit.runs_root={tmp_path}",
                                  "submit.dry_run=true"), [f"seed={s}"]) for s in range(5)]
    monkeypatch.setattr(slurm.limits, "run", lambda cmd: "")  # nothing queued now; no controller asked
    out = io.StringIO()
    pipeline.launch(points, argv=["launch"], out=out)
    assert "points [0, 1] (2 array task(s))" in out.getvalue()  # room 3: 2 points and the wave job
    assert "3 of the 5 points would wait for room" in capsys.readouterr().err
    assert not any(Path(tmp_path).iterdir())  # a dry run writes nothing


def test_the_wave_job_is_queued_after_the_wave_or_at_a_time():
    cmd = slurm.after_job_command("waves", slurm.WAVES_MODULE, Path("/r/sweep"), "afterany:1:2", Path("/r/sweep/.s"),
                                  "/py", {"account": "a"}, slurm.WAVES_TIME_MIN)
    assert "--dependency=afterany:1:2" in cmd and "--account=a" in cmd and "--no-requeue" in cmd
    assert cmd[-1].endswith("/py -m launcher.submit.waves /r/sweep")
    cmd = slurm.after_job_command("waves", slurm.WAVES_MODULE, Path("/r/sweep"), "", Path("/r/s"), "/py", {},
                                  slurm.WAVES_TIME_MIN, begin="now+60")
    assert not any(c.startswith("--dependency") for c in cmd) and "--begin=now+60" in cmd
