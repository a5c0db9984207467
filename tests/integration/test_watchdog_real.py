"""A rank ends itself when another rank of its run has failed, instead of hanging in a collective
(a real watched process; the pure peer-watch test: tests/unit/test_watchdog.py)."""
import subprocess
import sys
import time

import pytest

from launcher.rundir import RunDir


@pytest.mark.timeout(60)
def test_rank_exits_when_a_peer_fails(tmp_path):
    code = ("import time; from pathlib import Path; from launcher.runtime import watchdog; "
            f"watchdog.start(Path({str(tmp_path)!r}), rank=0, interval_s=0.1); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, text=True)
    time.sleep(1.0)
    rd = RunDir(tmp_path)
    rd.write_rank_error(0, "its own error does not count")
    time.sleep(0.5)
    assert proc.poll() is None
    t0 = time.time()
    rd.write_rank_error(3, "Traceback ...")
    assert proc.wait(timeout=10) == 1 and time.time() - t0 < 5
    assert "rank_3 failed" in proc.stderr.read()
