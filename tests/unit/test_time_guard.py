"""The time limit's margin from the saves measured (launcher/runtime/time_guard.py): when rank 0 stops
the run before its time limit, and what the scheduler says of the job's end."""
from __future__ import annotations

import io
import time
import types

from launcher.backends.slurm.limits import job_end_of
from launcher.runtime import time_guard


def test_the_margin_is_asked_only_where_the_warning_would_not_hold_the_last_save():
    assert time_guard.stop_margin_s(120, None) is None  # no save measured yet
    assert time_guard.stop_margin_s(120, 10) is None  # 10 x 1.5 + 15 = 30 s fit in the 120 s warning
    assert time_guard.stop_margin_s(120, 80) == 80 * time_guard.SAFETY + time_guard.SLACK_S  # 135 s > 120
    assert time_guard.stop_margin_s(5, 0.5) == 0.5 * time_guard.SAFETY + time_guard.SLACK_S


def test_the_guard_stops_the_run_once_the_margin_is_reached_and_says_what_to_set():
    flag, out = types.SimpleNamespace(reason=None), io.StringIO()
    guard = time_guard.TimeGuard(time.time() + 60, 30, flag, out=out).start()
    guard.saved(2.0)  # 18 s needed: the 30 s warning holds it
    time.sleep(0.2)
    assert flag.reason is None and not guard.fired and guard.due_in() is None
    guard.saved(40.0)  # 75 s needed, 60 s left: stop now
    guard._thread.join(timeout=10)
    assert flag.reason == "time_limit" and guard.fired
    text = out.getvalue()
    assert "the last checkpoint took 40 s" in text and "set cluster.signal_delay_s=76 or more" in text


def test_a_stop_already_asked_for_is_left_alone():
    flag = types.SimpleNamespace(reason="preempted")
    guard = time_guard.TimeGuard(time.time() + 10, 5, flag, out=io.StringIO()).start()
    guard.saved(30.0)
    guard._thread.join(timeout=10)
    assert flag.reason == "preempted" and not guard.fired


def test_the_guard_waits_for_the_margin_and_closes_without_firing():
    flag = types.SimpleNamespace(reason=None)
    guard = time_guard.TimeGuard(time.time() + 3600, 5, flag, out=io.StringIO()).start()
    guard.saved(1.0)
    assert 3500 < guard.due_in() < 3600
    guard.close()
    guard._thread.join(timeout=10)
    assert not guard._thread.is_alive() and flag.reason is None


def test_the_jobs_end_as_scontrol_shows_it():
    line = ("JobId=12 JobName=x UserId=u(1) JobState=RUNNING RunTime=00:00:10 TimeLimit=00:02:00 "
            "StartTime=2026-12-07T06:00:00 EndTime=2026-12-07T06:02:00 Deadline=N/A")
    assert job_end_of(line) == time.mktime(time.strptime("2026-12-07T06:02:00", "%Y-%m-%dT%H:%M:%S"))
    assert job_end_of("JobId=12 TimeLimit=UNLIMITED EndTime=Unknown") is None
    assert job_end_of("") is None
