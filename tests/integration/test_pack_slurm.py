"""cluster.pack=true on the real local Slurm cluster: six points in ONE 2-node allocation, each a job
step with its own sealed run dir; a point whose rank is SIGKILLed ends failed (train.max_restarts=0)
while the others complete; `launcher retry SWEEP --failed` completes it in a new pack."""
import json
import subprocess
from pathlib import Path

import pytest

from helpers import BIN, launch, run_cmd, wait_final
from launcher.rundir import RunDir

pytestmark = [pytest.mark.slurm]

# one point of six has its rank killed at step 2 of its first attempt (the others' fault is for an
# attempt 2 they never reach)
PACK = ["cluster=local_slurm", "cluster.nodes=1", "cluster.gpus_per_node=1", "model=gpt_tiny", "train.steps=3",
        "wandb.enabled=false", "train.log_interval=0", "cluster.pack=true", "cluster.pack_nodes=2",
        "train.max_restarts=0", "train.fail_at_step=2", "train.fail_mode=kill", "train.fail_attempt=1,2,2,2,2,2",
        "cluster.time_min=10"]


def launcher(args, runs_root, slurm, timeout=300):
    return run_cmd([str(BIN / "launcher"), *args, "--root", str(runs_root)], runs_root, timeout=timeout,
                   extra_env=slurm)


def allocations(job_id: str, slurm) -> list:
    """sacct's rows of the job: the allocation and its steps."""
    out = subprocess.run(["sacct", "-n", "-P", "-j", job_id, "--format=JobID,State"], capture_output=True, text=True,
                         timeout=60, env={**__import__("os").environ, **slurm}).stdout
    return [line.split("|") for line in out.splitlines() if line.strip()]


@pytest.mark.timeout(600)
def test_six_points_in_one_allocation_one_killed_then_retried(slurm, runs_root):
    res = launch(["-m", *PACK], runs_root, extra_env=slurm)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "pack job" in res.stdout
    runs = wait_final(runs_root, 6, timeout=420)
    jobs = {json.loads((Path(r["dir"]) / "job.json").read_text())["job_id"] for r in runs}
    assert len(jobs) == 1, jobs  # ONE scheduler job for the six points
    (pack,) = jobs
    killed = {r["run_id"] for r in runs if r["config"]["train"]["fail_attempt"] == 1}
    assert len(killed) == 1
    by_id = {r["run_id"]: r for r in runs}
    for rid, r in by_id.items():
        rd = RunDir(Path(r["dir"]))
        st = rd.status()
        assert rd.is_sealed(), rid
        assert (st.job_id or "").startswith(f"{pack}."), st.job_id  # <pack>.<step>
        job = json.loads((rd.path / "job.json").read_text())
        assert job["pack_index"] in range(6) and Path(job["stdout"]).exists()
        if rid in killed:
            assert r["status"] == "failed" and "died without a word" in (st.error or ""), st
        else:
            assert r["status"] == "completed", (rid, st)
            assert st.summary["final_loss"] > 0
    steps = {s[0] for s in allocations(pack, slurm)}
    assert {f"{pack}.{i}" for i in range(6)} <= steps, steps  # each point a step of the one job
    assert not any(s.partition(".")[0] != pack for s in steps)
    queue = json.loads((Path(runs[0]["dir"]).parent / f"pack-{pack}.json").read_text())
    assert [p["state"] for p in queue["points"]] == ["done"] * 6

    sweep = runs[0]["sweep_id"]
    st = json.loads(launcher(["status", sweep, "--json"], runs_root, slurm).stdout)
    assert st["counts"] == {"completed": 5, "failed": 1}

    res = launcher(["retry", sweep, "--failed"], runs_root, slurm)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "1 run(s) retried" in res.stdout
    runs = wait_final(runs_root, 6, timeout=300)
    assert all(r["status"] == "completed" for r in runs), [(r["run_id"], r["status"]) for r in runs]
    (rid,) = killed
    rd = RunDir(Path(by_id[rid]["dir"]))
    job = json.loads((rd.path / "job.json").read_text())
    assert job["job_id"] != pack and job["earlier_job_ids"] == [pack] and job["pack_index"] == 0  # a new pack
    assert rd.is_sealed() and rd.status().attempt == 2
    res = launcher(["results", sweep, "--csv"], runs_root, slurm)
    assert res.returncode == 0 and len(res.stdout.splitlines()) == 7 and res.stdout.count(",completed,") == 6
