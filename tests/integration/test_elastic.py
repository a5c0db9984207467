"""cluster.elastic on the real Slurm cluster (launcher.features.elastic: rule, decide, node): a node set
DOWN mid-run (a cluster.elastic job is --no-requeue: Slurm brings nothing back), the run goes on by itself
on the 3 nodes left (the layout and accumulation printed by the job it queued for itself), grows back to 4 at a
checkpoint once the node returns, and every step's loss equals the uninterrupted run's within the layout
tests' tolerance; a failure after that is restarted by the same queued job (no Slurm requeue). The rule's
parts: tests/unit/test_elastic.py."""
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from test_fault_tolerance import cancel_jobs, stopped_rank, wait_for

from helpers import BIN, EQUIV_BASE, launch, read_metrics, run_cmd, runs_json, wait_final

LOSS_ATOL = 5e-6  # the layout tests' tolerance (tests/integration/test_reshard.py)
# 12 samples a step: dp4 x 3 micro-batches on 4 nodes, dp3 x 4 on 3
BASE = [*EQUIV_BASE, "train.global_batch_size=12", "train.micro_batch_size=1", "train.steps=24",
        # blocking saves: the lost node must find every due checkpoint committed
        "train.checkpoint.every=4", "train.checkpoint.async_save=false"]


def _lines(path: Path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _node_state(env, node: str) -> str:
    return subprocess.run(["sinfo", "-h", "-n", node, "-o", "%T"], capture_output=True, text=True, env=env,
                          timeout=60).stdout.strip()


def _scontrol(env, node: str, *words: str) -> None:
    subprocess.run(["scontrol", "update", f"nodename={node}", *words], check=True, env=env, timeout=60)


@pytest.mark.slurm_whole
@pytest.mark.timeout(900)
def test_a_node_lost_without_requeue_the_run_goes_on_on_3_and_grows_back_to_4(slurm, tmp_path):
    env = {**os.environ, **slurm}
    res = launch([*BASE, "cluster.gpus_per_node=1"], tmp_path / "ref", timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    (ref,) = runs_json(tmp_path / "ref")
    root = tmp_path / "runs"
    res = launch([*BASE, "cluster=local_slurm", "cluster.nodes=4", "cluster.gpus_per_node=1",
                  "parallelism.engine=ddp", "cluster.elastic.enabled=true",
                  # holds (rank 1 stopped), so that each event finds the run where the drill expects it however
                  # fast it trains: attempt 1 in step 6 until its node is lost, the 3-node attempt in step 7
                  # until the node is back (it grows at step 8's checkpoint)
                  "train.faults=[{at_step:6,rank:1,mode:stop,attempt:1},{at_step:7,rank:1,mode:stop,attempt:2}]",
                  # once grown back, a failure worth a restart: the job queued after it restarts the run
                  "train.fail_at_step=22", "train.fail_rank=1", "train.fail_attempt=3", "train.max_restarts=1"],
                 root, extra_env=slurm, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    (run,) = [Path(r["dir"]) for r in runs_json(root)]
    job = json.loads((run / "job.json").read_text())["job_id"]

    lost, back = "node4", False
    deadline = time.time() + 600
    try:
        # down while held in step 6 (the checkpoint of step 4 written, steps 1-5 logged)
        wait_for("rank 1 of the 4-node attempt held in step 6", lambda: stopped_rank(run) is not None,
                 max(10, deadline - time.time()), poll=0.2)
        first = stopped_rank(run)
        # drained first (so that it stays out when its slurmd registers again), then down: Slurm ends the
        # job NODE_FAIL, and --no-requeue (cluster.elastic's) leaves it ended
        _scontrol(env, lost, "state=drain", "reason=elastic-test")
        _scontrol(env, lost, "state=down", "reason=elastic-test")
        wait_for("the shrink to 3 nodes in restarts.jsonl",
                 lambda: any(r.get("reason") == "shrink" for r in _lines(run / "restarts.jsonl")),
                 max(10, deadline - time.time()))
        wait_for("rank 1 of the 3-node attempt held in step 7", lambda: stopped_rank(run) not in (None, first),
                 max(10, deadline - time.time()), poll=0.2)
        _scontrol(env, lost, "state=resume")  # the node returns while the run is held on 3
        back = True
        wait_for(f"{lost} idle again", lambda: _node_state(env, lost) == "idle", max(10, deadline - time.time()))
        os.kill(stopped_rank(run), signal.SIGCONT)  # step 7 ends; rank 0 sees the node before step 8's save
        (row,) = wait_final(root, 1, timeout=max(10, deadline - time.time()))
    except BaseException:  # a held rank is never left stopped in the queue: it would hold its node
        cancel_jobs([run], slurm)
        raise
    finally:
        if not back:
            subprocess.run(["scontrol", "update", f"nodename={lost}", "state=resume"], check=False, env=env)
    assert row["status"] == "completed", row

    sacct = subprocess.run(["sacct", "-X", "-n", "-P", "-j", str(job), "--format=State"], capture_output=True,
                           text=True, env=env).stdout
    assert "NODE_FAIL" in sacct, sacct
    rows = _lines(run / "restarts.jsonl")
    assert [r["reason"] for r in rows] == ["shrink", "grow", "failure"], rows
    shrink, grow, failure = rows
    assert shrink["layout"]["from"]["nodes"] == 4 and shrink["layout"]["to"]["nodes"] == 3, shrink
    assert (shrink["layout"]["to"]["dp"], shrink["layout"]["to"]["grad_accum"]) == (3, 4), shrink
    assert grow["layout"]["to"]["nodes"] == 4 and grow["layout"]["to"]["grad_accum"] == 3, grow
    # from step 4's checkpoint, or from step 6's that the ranks saved at the boundary when Slurm signalled
    # them (its kill continues the held rank before its TERM); grown at step 8's, the first after the hold
    assert shrink["from_step"] in (4, 6) and grow["from_step"] == 8, rows
    assert failure["from_step"] == 20 and "layout" not in failure and "injected" in failure["detail"], failure
    # the job the run queued for itself said where it goes on, and how
    logs = "".join(p.read_text() for p in sorted((run.parent / ".submitit").glob("elastic.*.out")))
    assert f"job {job} ended by the cluster (NODE_FAIL): now ddp dp3 x pp1 x tp1 on 3 node(s), micro batch 1 x " \
           "grad accum 4 x dp3 = global batch 12" in logs, logs
    assert "nodes back: growing toward 4 node(s): now ddp dp4 x pp1 x tp1 on 4 node(s)" in logs, logs
    assert "ended for a restart (failure: rank 1:" in logs, logs
    config = (run / "config.yaml").read_text()
    assert "target_nodes: 4" in config, config

    want, got = read_metrics(Path(ref["dir"])), read_metrics(run)
    assert [r["step"] for r in got] == list(range(1, 25))
    dev = max(abs(a["loss"] - b["loss"]) for a, b in zip(got, want))
    print(f"max |loss - uninterrupted| over 4 -> 3 -> 4 nodes: {dev:.2e}")
    assert dev <= LOSS_ATOL, ([r["loss"] for r in got], [r["loss"] for r in want])
    reshards = _lines(run / "reshard.jsonl")  # the failure's restart loads step 20's, written on 4 nodes
    assert [(r["step"], r["to"]["nodes"]) for r in reshards] == [(shrink["from_step"], 3), (8, 4)], reshards
    assert all(r["bitwise_equal"] for r in reshards), reshards
    res = run_cmd([str(BIN / "launcher"), "diff", str(run), ref["dir"]], root, timeout=120)
    assert "max |diff|" in res.stdout or dev == 0, res.stdout
