"""A rank ends itself when another rank of its run has failed, instead of hanging in a collective."""
import time

import pytest

from launcher.rundir import RunDir


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
    assert exits == [1]
    assert rd.failed_ranks(except_rank=0, since=watch._born) == ["rank_2"]
