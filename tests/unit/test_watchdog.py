"""A rank ends itself when another rank of its run has failed, instead of hanging in a collective."""
import time

import pytest

from launcher.run.rundir import RunDir


@pytest.mark.timeout(60)
def test_the_peer_watch_ignores_errors_older_than_itself(tmp_path, monkeypatch):
    """In this process (the watch's exit replaced): an error file from before the watch was born (an
    earlier attempt's) ends nothing; one written after it does."""
    import os

    from launcher.runtime import watchdog

    rd = RunDir(tmp_path)
    watch = watchdog.Watch(rd, rank=0, world=4, interval_s=0.02)
    rd.write_rank_error(1, "an earlier attempt's error")
    old = watch._born - 30
    os.utime(rd.rank_error_path(1), (old, old))
    assert rd.failed_ranks(except_rank=0, since=watch._born) == []
    assert rd.failed_ranks(except_rank=0) == ["rank_1"]  # (without `since` it counts)

    exits = []

    def exit_(code):  # what os._exit would end the rank with
        exits.append(code)
        watch.stop_event.set()

    monkeypatch.setattr(watchdog.os, "_exit", exit_)
    watch.start()
    time.sleep(0.5)  # 25 polls
    assert exits == []
    rd.write_rank_error(2, "Traceback ...")
    deadline = time.time() + 10
    while not exits and time.time() < deadline:
        time.sleep(0.02)
    assert exits == [1], f"the watch did not end the rank within 10 s of rank 2's error: {exits}"
    assert rd.failed_ranks(except_rank=0, since=watch._born) == ["rank_2"]


@pytest.mark.timeout(60)
def test_a_cancel_and_a_peers_error_are_found_in_one_small_listing(tmp_path):
    """errors/ holds only what ends a watch (the ranks that failed, the cancel mark): a look finds a
    cancel without reading status.json, and a peer's error, never the rank's own."""
    from launcher.run.status import Status
    from launcher.runtime import watchdog

    rd = RunDir(tmp_path)
    rd.write_run({"run_id": "x-0"})
    rd.set_status(Status.running)
    watch = watchdog.Watch(rd, rank=1, world=4096)
    watch._born -= 5
    assert watch.look() is None and not (tmp_path / "errors").exists()
    rd.write_rank_error(1, "its own error")
    assert watch.look() is None
    rd.finish(Status.cancelled, seal=False, error="cancelled by the user")
    assert sorted(p.name for p in (tmp_path / "errors").iterdir()) == ["cancelled", "rank_1.error"]
    assert watch.look() == "the run was cancelled; ending this rank"
    rd.write_rank_error(7, "Traceback ...")
    assert watch.look() == "rank_7 failed; ending this rank too"
    assert rd.failed_ranks() == ["rank_1", "rank_7"]


@pytest.mark.timeout(60)
def test_one_rank_gathers_the_hang_the_others_only_dump(tmp_path):
    from launcher.runtime import watchdog

    rd = RunDir(tmp_path)
    rd.write_run({"run_id": "x-0"})
    watches = [watchdog.Watch(rd, rank=r, world=3, hang_timeout_s=3) for r in range(3)]
    claimed = [w.dump_stack() for w in watches]
    assert claimed == [True, False, False] and rd.stack_count() == 3
    assert rd.hang() is None
    finding = watches[0].gather()
    assert finding["no_stack"] == [] and sorted(finding["frames"]) == [0, 1, 2]
    assert rd.hang()["stuck_ranks"] == finding["stuck_ranks"]
    assert watches[2].await_finding() == rd.hang()
    rd.move_aside(1)  # the next attempt starts without the claim, the stacks or the finding
    assert rd.hang() is None and rd.stack_count() == 0 and watches[1].dump_stack()


def test_the_start_up_watch_counts_from_the_last_progress_until_the_first_beat(tmp_path):
    """Before the first beat: no start-up progress for startup_timeout_s fires "startup" (progress()
    counts again); from the first beat on only the hang watch counts, and a slow first step is not a
    start-up hang (the hang watch is armed by that beat, as before)."""
    from launcher.runtime import watchdog

    w = watchdog.Watch(RunDir(tmp_path), rank=0, world=2, hang_timeout_s=0, startup_timeout_s=10)
    t0 = w._progress
    assert w.overdue(t0 + 9) is None and w.overdue(t0 + 11) == "startup"
    w._progress = t0 + 8  # progress(): the process group came up at t0 + 8
    assert w.overdue(t0 + 11) is None and w.overdue(t0 + 19) == "startup"
    w.beat()  # the resume's load finished: the start-up watch is done
    assert w.overdue(w._last + 10_000) is None  # hang_timeout_s 0: no watch at all
    w.hang_timeout_s = 30
    assert w.overdue(w._last + 29) is None and w.overdue(w._last + 31) == "hang"
    off = watchdog.Watch(RunDir(tmp_path), rank=0, world=2, startup_timeout_s=0)
    assert off.overdue(off._progress + 10_000) is None


@pytest.mark.timeout(60)
def test_a_peer_that_failed_before_this_ranks_watch_started_still_ends_it(tmp_path, monkeypatch):
    """A peer that fails in its first second (a rendezvous port in use) fails before a rank slower to
    start reaches its watch: the watch counts from the attempt's start its starter exported, not from
    its own, or that rank waits in the rendezvous for ever. An earlier attempt's error still counts not."""
    import os

    from launcher.backends.base import STEP_START_ENV
    from launcher.runtime import watchdog

    rd = RunDir(tmp_path)
    started = time.time() - 20  # the attempt's processes, 20 s before this rank's watch
    rd.write_rank_error(2, "an earlier attempt's error")
    os.utime(rd.rank_error_path(2), (started - 1, started - 1))
    rd.write_rank_error(0, "EADDRINUSE")
    os.utime(rd.rank_error_path(0), (started + 1, started + 1))
    monkeypatch.setenv(STEP_START_ENV, repr(started))
    assert watchdog.Watch(rd, rank=1, world=4).look() == "rank_0 failed; ending this rank too"
    monkeypatch.delenv(STEP_START_ENV)  # nothing said when: the watch's own start, as before
    assert watchdog.Watch(rd, rank=1, world=4).look() is None


def test_the_slurm_batch_script_exports_its_attempts_start():
    """Before its step, as the local controller and a pack's runner do before theirs."""
    from pathlib import Path

    from launcher.backends.base import STEP_START_ENV
    from launcher.backends.slurm.text import requeue_lines

    setup = requeue_lines(Path("/runs/x/.submitit"))["setup"]
    assert f"export {STEP_START_ENV}=$(date +%s.%N)" in setup
