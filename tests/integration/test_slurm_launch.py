"""Real Slurm (scripts/slurm-local.sh): multi-node training, one array per sweep, failures."""
import json
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from helpers import BIN, launch, read_metrics, run_cmd, runs_json, wait_final

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(420)]


ACTIVE = ("PENDING", "RUNNING", "COMPLETING", "CONFIGURING")


def sacct(job_id: str, n: int = 1) -> list:
    """(JobID, State, ExitCode) rows of the job's allocations once n of them have ended.
    Polls: a run records its outcome just before its task exits, and accounting lags a little."""
    rows = []
    for _ in range(60):
        out = subprocess.run(["sacct", "-X", "-n", "-P", "--format=JobID,State,ExitCode", "-j", job_id],
                             capture_output=True, text=True, timeout=60).stdout
        rows = [line.split("|") for line in out.splitlines() if line.strip()]
        if len(rows) >= n and not any(r[1].split()[0] in ACTIVE for r in rows):
            return rows
        time.sleep(1)
    raise AssertionError(f"sacct never listed {n} ended allocation(s) of job {job_id} (60 tries): {rows}")


def test_two_node_training(slurm, runs_root):
    t0 = time.time()
    res = launch(["cluster=local_slurm", "cluster.nodes=2", "cluster.gpus_per_node=1", "train.steps=20",
                  "optim.lr=2e-3"], runs_root, extra_env=slurm)
    returned_after = time.time() - t0
    assert res.returncode == 0, res.stdout + res.stderr
    assert "submitted (slurm)" in res.stdout and "watch: launcher runs --sweep" in res.stdout
    (run,) = wait_final(runs_root, 1, timeout=300)
    assert run["status"] == "completed", run
    rdir = Path(run["dir"])
    ranks = [json.loads((rdir / "ranks" / f"rank_{r}.json").read_text()) for r in range(2)]
    # both ranks of one job, on two different Slurm nodes
    assert ranks[0]["job_id"] == ranks[1]["job_id"] == run["job_id"]
    assert {r["slurmd_nodename"] for r in ranks} == {"node1", "node2"} or \
        len({r["slurmd_nodename"] for r in ranks}) == 2
    assert ranks[0]["master_port"] == ranks[1]["master_port"] != 29500
    rows = read_metrics(rdir)
    assert len(rows) == 20
    assert sum(r["loss"] for r in rows[-5:]) / 5 < sum(r["loss"] for r in rows[:5]) / 5 - 0.1
    assert "#SBATCH --nodes=2" in (rdir / "sbatch.sh").read_text()
    assert returned_after < 30  # launch queues and returns; it does not wait for training


def test_sweep_is_one_array_job(slurm, runs_root):
    lrs = ["1e-3", "2e-3", "3e-3", "4e-3"]
    res = launch(["-m", "cluster=local_slurm", "cluster.nodes=1", "train.steps=8", f"optim.lr={','.join(lrs)}"],
                 runs_root, extra_env=slurm)
    assert res.returncode == 0, res.stdout + res.stderr
    right_after = runs_json(runs_root)
    assert len(right_after) == 4
    runs = wait_final(runs_root, 4, timeout=360)
    assert [r["status"] for r in runs] == ["completed"] * 4, runs
    array_ids = {r["job_id"].split("_")[0] for r in runs}
    assert len(array_ids) == 1, array_ids
    (array_id,) = array_ids
    assert sorted(r["job_id"] for r in runs) == [f"{array_id}_{i}" for i in range(4)]
    rows = sacct(array_id, n=4)
    tasks = sorted(row[0] for row in rows)
    assert tasks == [f"{array_id}_{i}" for i in range(4)], rows
    assert all(row[1] == "COMPLETED" for row in rows), rows
    seen = []
    for r in runs:
        cfg = yaml.safe_load((Path(r["dir"]) / "config.yaml").read_text())
        seen.append(cfg["optim"]["lr"])
        assert (Path(r["dir"]) / "metrics.jsonl").exists()
    assert sorted(seen) == sorted(float(x) for x in lrs)


def test_failing_task_is_failed_with_traceback(slurm, runs_root):
    res = launch(["cluster=local_slurm", "cluster.nodes=1", "train.steps=10", "train.fail_at_step=2",
                  "train.max_restarts=0"], runs_root, extra_env=slurm)  # no restart: the failure is the outcome
    assert res.returncode == 0, res.stderr
    (run,) = wait_final(runs_root, 1, timeout=300)
    assert run["status"] == "failed", run
    assert "injected failure at step 2 on rank 0" in run["error"]
    rows = sacct(run["job_id"])
    assert rows and rows[0][1] == "FAILED" and rows[0][2] != "0:0", rows
    log = run_cmd([str(BIN / "launcher"), "logs", run["run_id"], "--err", "--root", str(runs_root)], runs_root,
                  extra_env=slurm)
    assert "Traceback" in log.stdout and "RuntimeError: injected failure at step 2" in log.stdout
