"""`launcher runs` lists the newest 50 runs (read from the index alone, only they refreshed) and says how
many older ones it left out; --json lists every run unless --last; --all lists every run."""
import json
import os
import subprocess

import pytest

from launcher.archive import registry
from launcher.run.rundir import SweepDir
from launcher.run.status import Status
from tests.helpers import BIN


def _run(root, sweep, i, ts):
    rd = SweepDir(root / sweep).run(i)
    rd.write_config({"x": i})
    meta = rd.write_run({"run_id": f"{sweep}-{i}", "sweep_id": sweep, "index": i})
    meta["created_ts"] = ts  # a fixed order
    rd.write_run(meta)
    rd.finish(Status.completed, exit_code=0)
    return rd


@pytest.mark.timeout(300)
def test_launcher_runs_lists_the_newest_50_and_says_how_many_it_left_out(tmp_path):
    rds = [_run(tmp_path, f"S{s}", i, 1000.0 * s + i) for s in range(2) for i in range(40)]
    registry.record(tmp_path, [rd.path for rd in rds])
    cli = [str(BIN / "launcher"), "runs", "--root", str(tmp_path)]
    table = subprocess.run(cli, capture_output=True, text=True, timeout=120, env=dict(os.environ, COLUMNS="200"))
    assert table.returncode == 0, table.stderr
    assert "S1-39" in table.stdout and "S0-29" not in table.stdout and "S0-30" in table.stdout
    assert "30 older run(s) not listed" in table.stderr
    every = json.loads(subprocess.run(cli + ["--json"], capture_output=True, text=True, timeout=120).stdout)
    assert len(every) == 80  # --json: every run unless --last
    last = json.loads(subprocess.run(cli + ["--json", "--last", "3"], capture_output=True, text=True,
                                     timeout=120).stdout)
    assert [r["run_id"] for r in last] == ["S1-37", "S1-38", "S1-39"]
    whole = subprocess.run(cli + ["--all"], capture_output=True, text=True, timeout=120,
                           env=dict(os.environ, COLUMNS="200"))
    assert "S0-0" in whole.stdout and "not listed" not in whole.stderr
