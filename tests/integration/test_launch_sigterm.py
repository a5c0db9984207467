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


@pytest.mark.timeout(300)
def test_sigterm_to_a_local_preflight_settles_every_rung(tmp_path):
    """SIGTERM to `launcher preflight` while a rung trains: the rung and every rung not ended are recorded
    cancelled and sealed, their processes end, and the command exits 128 + SIGTERM naming --show."""
    import json
    import os
    import signal
    import time
    from pathlib import Path

    from launcher.backends.local import pid_alive
    from launcher.run.rundir import RunDir

    root = tmp_path / "runs"
    proc = subprocess.Popen([str(Path(sys.executable).parent / "launcher"), "preflight", "model=gpt_tiny",
                             "train.steps=100000", "optim.warmup_steps=0", "--steps", "100000"],
                            cwd=tmp_path, env=dict(os.environ, LAUNCHER_RUNS=str(root)), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 180
    entry = None
    while time.time() < deadline and entry is None:  # the first rung's run has a rank that wrote its record
        for record in (root / "preflight").glob("*.json") if (root / "preflight").is_dir() else []:
            rungs = [e for e in json.loads(record.read_text())["rungs"] if e.get("run_dir")]
            if rungs and list(Path(rungs[0]["run_dir"]).glob("ranks/rank_*.json")):
                entry = rungs[0]
        time.sleep(0.2)
    assert entry is not None, "no rung started"
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, out + err
    assert "launcher preflight: stopped (SIGTERM received)" in err and "--show" in err, err
    rd = RunDir(entry["run_dir"])
    assert rd.status().state == "cancelled" and rd.verify() == [], rd.status()
    assert not pid_alive(int(rd.job().job_id)), "the rung's job still runs"
