"""SIGTERM to `launch -m` on the real local Slurm cluster: the short version of
benchmarks/launch_sigterm_drill.py (20 tries there, its output in docs/sweeps.md). The first try
signals the moment squeue lists the array (the probe's window: sbatch returned, nothing published
yet); the second at a random moment. After each, `launcher runs` lists every queued point, or nothing
is queued; no staged dir, journal or temporary multirun.yaml is left. Jobs are held and cancelled."""
import subprocess
import sys

import pytest

from tests.helpers import REPO


@pytest.mark.timeout(240)
def test_sigterm_during_launch_leaves_no_orphan(slurm):
    import os

    res = subprocess.run([sys.executable, str(REPO / "benchmarks" / "launch_sigterm_drill.py"), "--tries", "2",
                          "--points", "6", "--seed", "1"], capture_output=True, text=True, timeout=220,
                         env=dict(os.environ, **slurm), cwd=str(REPO))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "2 tries, 0 with an orphan or a leftover" in res.stdout, res.stdout
    assert "(array in squeue)" in res.stdout, res.stdout
