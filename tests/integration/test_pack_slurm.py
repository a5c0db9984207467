"""cluster.pack=true on the real local Slurm cluster: six points in ONE 2-node allocation, each a job
step with its own sealed run dir; a point whose rank is SIGKILLed ends failed (train.max_restarts=0)
while the others complete; `launcher retry SWEEP --failed` completes it in a new pack."""
import json
import subprocess
from pathlib import Path

import pytest

from helpers import BIN, launch, run_cmd, wait_final
from launcher.run.rundir import RunDir

pytestmark = [pytest.mark.slurm]

# one point of six has its rank killed at step 2 of its first attempt (the others' fault is for an
# attempt 2 they never reach)
PACK = ["cluster=local_slurm", "cluster.nodes=1", "cluster.gpus_per_node=1", "model=gpt_tiny", "train.steps=3",
        "train.log_interval=0", "cluster.pack=true", "cluster.pack_nodes=2",
        # no restart: retry_points, not the budget, restarts the points
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


def _status(rdir: Path) -> dict:
    p = rdir / "status.json"
    return json.loads(p.read_text()) if p.exists() else {}


def _last_step(rdir: Path) -> int:
    p = rdir / "metrics.jsonl"
    rows = [json.loads(line) for line in p.read_text().splitlines() if line.strip()] if p.exists() else []
    return max((int(r.get("step", 0)) for r in rows), default=0)


def _wait(what, cond, timeout):
    import time

    deadline = time.time() + timeout
    while time.time() < deadline:
        if cond():
            return
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def _restarts(rdir: Path) -> list:
    p = rdir / "restarts.jsonl"
    return [json.loads(line) for line in p.read_text().splitlines()] if p.exists() else []


@pytest.mark.timeout(900)
def test_a_requeued_pack_then_its_time_limit_run_only_the_unfinished_points_from_their_checkpoints(slurm, runs_root):
    """`scontrol requeue` of the pack once its short point completed and its long ones saved: the pack
    starts again (same job id) and runs only the long points, each from its own checkpoint. Then USR2 to
    the pack's steps (Slurm's time-limit signal): each point saves and stops, the runner requeues the pack
    once they have, and its next start resumes both from those checkpoints. (One pack for both: each
    started its own.)"""
    over = [*(o for o in PACK[:7] if not o.startswith("train.steps=")), "cluster.pack=true", "cluster.pack_nodes=1",
            # a budget of 2: a requeue and a time limit
            "cluster.time_min=10", "train.max_restarts=2", "train.checkpoint.every=5", "train.steps=3,150,150"]
    res = launch(["-m", *over], runs_root, extra_env=slurm)
    assert res.returncode == 0, res.stdout + res.stderr
    sweep = next(p for p in runs_root.iterdir() if (p / "sweep.json").exists())
    short, long1, long2 = (sweep / str(i) for i in range(3))
    longs = (long1, long2)
    pack = json.loads((short / "job.json").read_text())["job_id"]
    env = {**__import__("os").environ, **slurm}
    _wait("the short point", lambda: _status(short).get("status") == "completed", 300)
    _wait("a checkpoint of each long point",
          lambda: all(_last_step(d) >= 8 and _status(d).get("status") == "running" for d in longs), 300)
    subprocess.run(["scontrol", "requeue", pack], check=True, timeout=60, env=env)
    # the second start: each long point past a checkpoint of its own again (3 steps after its resume)
    _wait("the long points' second start, 3 steps in",
          lambda: all(_status(d).get("attempt") == 2 and _status(d).get("status") == "running" and _restarts(d)
                      and _last_step(d) >= _restarts(d)[0]["from_step"] + 3 for d in longs), 400)
    subprocess.run(["scancel", "--signal=USR2", pack], check=True, timeout=60, env=env)
    runs = wait_final(runs_root, 3, timeout=400)
    assert all(r["status"] == "completed" for r in runs), [(r["run_id"], r["status"]) for r in runs]
    assert _status(short)["attempt"] == 1 and not (short / "restarts.jsonl").exists()  # not run again
    for d in longs:
        st = _status(d)
        assert st["attempt"] == 3 and st["job_id"].startswith(f"{pack}."), st
        requeued, timed_out = _restarts(d)
        assert requeued["reason"] in ("preempted", "scheduler") and requeued["from_step"] >= 5, requeued
        assert timed_out["reason"] == "time_limit" and timed_out["from_step"] >= requeued["from_step"] + 3, timed_out
        assert _last_step(d) == 150 and RunDir(d).is_sealed()
    assert json.loads((long1 / "job.json").read_text())["job_id"] == pack  # the same job, requeued twice
    out = (Path(json.loads((long1 / "job.json").read_text())["submitit_folder"]) / f"{pack}_0_log.out").read_text()
    assert "time limit: 2 point(s) left; requeueing the pack" in out


@pytest.mark.timeout(600)
def test_launcher_cancel_of_a_packed_point_ends_it_alone(slurm, runs_root):
    """Two points run (2 CPUs each on the pack's one 4-CPU node), one waits in the queue: `launcher
    cancel` of the waiting one never starts it, of a running one ends its step; the other completes.
    The cancelled points are long (100,000 steps), so a fast machine cannot finish one before its cancel."""
    over = [*(o for o in PACK[:7] if not o.startswith("train.steps=")), "cluster.pack=true", "cluster.pack_nodes=1",
            "cluster.cpus_per_task=2", "cluster.time_min=10", "train.steps=100000,150,100000"]
    res = launch(["-m", *over], runs_root, extra_env=slurm)
    assert res.returncode == 0, res.stdout + res.stderr
    sweep = next(p for p in runs_root.iterdir() if (p / "sweep.json").exists())
    first, second, third = (sweep / str(i) for i in range(3))
    _wait("two points running", lambda: all(_last_step(d) >= 3 for d in (first, second)), 300)
    assert not (third / "status.json").exists() or _status(third)["status"] == "pending"  # queued in the pack
    for d in (third, first):
        res = launcher(["cancel", f"{sweep.name}-{d.name}"], runs_root, slurm)
        assert res.returncode == 0 and "cancelled 1 run(s)" in res.stdout, res.stdout + res.stderr
    runs = wait_final(runs_root, 3, timeout=400)
    got = {r["run_id"]: r["status"] for r in runs}
    assert got == {f"{sweep.name}-0": "cancelled", f"{sweep.name}-1": "completed", f"{sweep.name}-2": "cancelled"}
    assert _last_step(second) == 150 and _last_step(first) < 100000 and _last_step(third) == 0  # never started
    assert all(RunDir(d).is_sealed() for d in (first, second, third))


@pytest.mark.timeout(600)
def test_two_node_points_share_the_packs_nodes_with_their_own_ports(slurm, runs_root):
    """Two points of 2 nodes each in a 2-node pack run at once on the same two nodes: each forms its own
    process group (its port from <job>.<step>), both complete."""
    over = ["cluster=local_slurm", "cluster.nodes=2", "cluster.gpus_per_node=1", "model=gpt_tiny", "train.steps=20",
            "train.log_interval=0", "cluster.pack=true", "cluster.pack_nodes=2",
            "cluster.time_min=10", "seed=1,2"]
    res = launch(["-m", *over], runs_root, extra_env=slurm)
    assert res.returncode == 0, res.stdout + res.stderr
    runs = wait_final(runs_root, 2, timeout=400)
    assert all(r["status"] == "completed" for r in runs), [(r["run_id"], r["status"]) for r in runs]
    sts = [RunDir(Path(r["dir"])).status() for r in runs]
    assert all(sorted(st.hosts) == sorted(sts[0].hosts) and len(st.hosts) == 2 for st in sts), [s.hosts for s in sts]
    assert len({st.job_id for st in sts}) == 2 and len({st.job_id.split(".")[0] for st in sts}) == 1
    started = [(st.started, st.ended) for st in sts]
    assert max(s for s, _ in started) < min(e for _, e in started)  # side by side, not one after the other
