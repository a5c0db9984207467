"""A full disk on the real local Slurm cluster: a runs root on an 80 MB tmpfs holding a held sweep, then
filled to the last byte. `launcher cancel SWEEP` must stop the jobs first (one scancel) and record
after: the queue is empty even though no record can be written, the command says what it could not
record, and once space is freed the next `launcher status` settles every run cancelled."""
import json
import os
import subprocess
import sys
import time

import pytest

from tests.helpers import BIN, REPO, launch, run_cmd

sys.path.insert(0, str(REPO))  # benchmarks/ is not an installed package
from benchmarks.probes import fill  # noqa: E402 (the probe list's H1 fills its disk alike)

pytestmark = [pytest.mark.slurm]

HELD = ["cluster=local_slurm", "cluster.nodes=1", "cluster.gpus_per_node=1", "train.steps=2",
        "+cluster.sbatch_extra.begin=now+10hours"]  # queued, never started: the test is about the cancel


def queued(name):
    out = subprocess.run(["squeue", "-h", "-r", "-n", name, "-o", "%i"], capture_output=True, text=True,
                         timeout=60).stdout
    return [line for line in out.splitlines() if line.strip()]


@pytest.fixture
def small_disk(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "small"
    mnt.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=80m", "tmpfs", str(mnt)], capture_output=True,
                         text=True, timeout=30)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {res.stderr.strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=60)


@pytest.mark.timeout(300)
def test_cancel_on_a_full_disk_stops_every_job_then_settles_once_space_is_freed(slurm, small_disk):
    root = small_disk / "runs"
    name = f"fulldisk{os.getpid()}"
    res = launch(["-m", *HELD, f"submit.job_name={name}", "seed=range(12)"], root, timeout=240)
    try:
        assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
        assert len(queued(name)) == 12
        sweep = json.loads((next(root.glob("*/0")) / "run.json").read_text())["sweep_id"]
        fill(small_disk / "filler")
        cancel = run_cmd([str(BIN / "launcher"), "cancel", sweep, "--root", str(root)], root, timeout=120)
        assert "Traceback" not in cancel.stderr, cancel.stderr
        deadline = time.time() + 60
        while queued(name) and time.time() < deadline:
            time.sleep(0.5)
        assert not queued(name), f"still queued after cancel on a full disk: {cancel.stdout}{cancel.stderr}"
        assert "could not be recorded" in cancel.stdout + cancel.stderr, cancel.stdout + cancel.stderr
    finally:
        subprocess.run(["scancel", "-n", name], capture_output=True, timeout=60)
        (small_disk / "filler").unlink(missing_ok=True)
    status = run_cmd([str(BIN / "launcher"), "status", sweep, "--json", "--root", str(root)], root, timeout=120)
    assert status.returncode == 0, status.stdout + status.stderr
    assert json.loads(status.stdout)["counts"] == {"cancelled": 12}, status.stdout
