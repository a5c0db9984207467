"""A rank ends itself when another rank of its run has failed, instead of hanging in a collective
(a real watched process; the pure peer-watch test: tests/unit/test_watchdog.py)."""
import select
import subprocess
import sys
import time

import pytest

from launcher.run.rundir import RunDir


@pytest.mark.timeout(60)
def test_rank_exits_when_a_peer_fails(tmp_path):
    # the watch ignores errors older than itself (an earlier attempt's): it says when it is watching
    code = ("import time; from pathlib import Path; from launcher.runtime import watchdog; "
            f"watchdog.start(Path({str(tmp_path)!r}), rank=0, interval_s=0.1); print('watching', flush=True); "
            "time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    assert select.select([proc.stdout], [], [], 30)[0], "the watch never said it was watching (30 s)"
    assert proc.stdout.readline().strip() == "watching", proc.stderr.read()
    rd = RunDir(tmp_path)
    rd.write_rank_error(0, "its own error does not count")
    time.sleep(0.5)  # an absence (5 of its looks): a slower machine looks fewer times, never fails a good watch
    assert proc.poll() is None
    t0 = time.time()
    rd.write_rank_error(3, "Traceback ...")
    assert proc.wait(timeout=10) == 1 and time.time() - t0 < 5
    assert "rank_3 failed" in proc.stderr.read()
