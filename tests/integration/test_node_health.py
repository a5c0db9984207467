"""Bad nodes found, named and left out, on the real local Slurm cluster (4 nodes, nothing else running:
a 1-node job starts on node1 while it is free), with the shipped defaults (the ledger under the runs
root or a team's directory, 2 events within 24 h exclude a node for 24 h):

- a run whose rank raises a CUDA-shaped error (an uncorrectable ECC error, ``train.faults`` mode
  ``cuda_error``) on its first node: the ledger names the node, the requeue leaves it out, the run
  completes elsewhere bitwise equal to an uninterrupted run;
- a second run on that node runs out of GPU memory that another process holds (``gpu_held``: torch's
  out-of-memory error as CUDA words it; the node's fault, not the model's): the node is excluded, the run's
  requeue leaves it out and completes, `launcher doctor` names the node, what held the GPU, and says it is
  excluded;
- a 2-point sweep of another runs root sharing the ledger says it leaves the node out and none of its points
  runs there; after the expiry (cluster.health.expire_h) the node is used again.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_fault_tolerance import assert_identical

from helpers import BIN, launch, run_cmd, wait_final

BASE = ["cluster=local_slurm", "cluster.nodes=1", "cluster.gpus_per_node=1", "model=gpt_tiny", "train.steps=6",
        "train.checkpoint.every=2", "optim.warmup_steps=0", "train.log_interval=0"]
ECC = "CUDA error: uncorrectable ECC error encountered"


def hosts_by_attempt(run_dir: Path) -> list:
    """The node(s) of each attempt: restarts.jsonl's (the attempt before each restart), then the last."""
    rows = [json.loads(line) for line in (run_dir / "restarts.jsonl").read_text().splitlines() if line.strip()]
    last = json.loads((run_dir / "status.json").read_text()).get("hosts")
    return [r.get("nodes") for r in rows] + [last]


def events(ledger: Path) -> list:
    return [json.loads(p.read_text()) for p in sorted((ledger / "events").glob("*.json"))]


@pytest.mark.slurm
@pytest.mark.slurm_whole
@pytest.mark.timeout(900)
def test_a_node_raising_cuda_errors_is_left_out_by_requeues_and_later_submissions(slurm, tmp_path):
    root, team = tmp_path / "runs", tmp_path / "team-ledger"
    root.mkdir()
    shared = [f"cluster.health.ledger={team}"]

    ref = launch([*BASE, *shared, "submit.job_name=nh-ref"], root / "ref", extra_env=slurm)
    assert ref.returncode == 0, ref.stdout[-3000:] + ref.stderr[-3000:]
    (reference,) = wait_final(root / "ref", 1, timeout=300)
    assert reference["status"] == "completed", reference

    # 1. a CUDA error on the first attempt's node, whichever it is
    res = launch([*BASE, *shared, "train.faults=[{at_step: 3, mode: cuda_error, attempt: 1}]"], root / "a",
                 extra_env=slurm)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    (a,) = wait_final(root / "a", 1, timeout=300)
    assert a["status"] == "completed", a
    first, second = hosts_by_attempt(Path(a["dir"]))
    (bad,) = first
    assert second and bad not in second, (first, second)  # the requeue left the failing node out
    (ev,) = events(team)
    assert (ev["node"], ev["kind"], ev["attempt"], ev["step"]) == (bad, "cuda_error", 1, 2) and ECC in ev["detail"], ev
    restart = json.loads((Path(a["dir"]) / "restarts.jsonl").read_text().splitlines()[0])
    assert restart["excluded"] == [bad] and restart["failure"]["kind"] == "node_fault", restart
    assert_identical(Path(a["dir"]), Path(reference["dir"]))

    # 2. the same node fails a second run (its GPU's memory held by another process): excluded now, and this
    # run's requeue leaves it out too
    res = launch([*BASE, *shared, f"train.faults=[{{at_step: 3, mode: gpu_held, node: {bad}}}]"], root / "b",
                 extra_env=slurm)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    (b,) = wait_final(root / "b", 1, timeout=300)
    assert b["status"] == "completed", b
    b_first, b_second = hosts_by_attempt(Path(b["dir"]))
    assert b_first == [bad] and bad not in b_second, (b_first, b_second)
    assert [(e["node"], e["kind"]) for e in events(team)] == [(bad, "cuda_error"), (bad, "oom_node")]
    assert_identical(Path(b["dir"]), Path(reference["dir"]))
    doc = run_cmd([str(BIN / "launcher"), "doctor", b["run_id"], "--root", str(root / "b")], root / "b",
                  extra_env={**slurm, "COLUMNS": "300"})
    assert doc.returncode == 0 and f"node {bad}: oom_node in this run; the node ledger says excluded: left out " \
        "of every later submission" in doc.stdout, doc.stdout + doc.stderr
    assert "61.4 GiB of its 79.2 GiB held by other processes" in doc.stdout, doc.stdout
    nodes = run_cmd([str(BIN / "launcher"), "nodes", "--ledger", str(team), "--json"], root, extra_env=slurm)
    (row,) = json.loads(nodes.stdout)
    assert (row["node"], row["state"], len(row["runs"])) == (bad, "excluded", 2), row

    # 3. another root's sweep sharing the ledger: every point queued without the node, and it says so
    res = launch(["-m", *BASE, *shared, "seed=1,2"], root / "sweep", extra_env=slurm)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert f"excluding {bad} (the node ledger" in res.stdout + res.stderr, res.stdout + res.stderr
    points = wait_final(root / "sweep", 2, timeout=300)
    assert all(p["status"] == "completed" for p in points), points
    placed = [json.loads((Path(p["dir"]) / "status.json").read_text())["hosts"] for p in points]
    assert all(bad not in h for h in placed), placed

    # 4. after the expiry the node is used again (a dry run: nothing left out, no line)
    res = launch([*BASE, *shared, "cluster.health.expire_h=0.0001", "submit.dry_run=true"], root / "later",
                 extra_env=slurm)
    assert res.returncode == 0 and "--exclude" not in res.stdout and "excluding" not in res.stdout + res.stderr, \
        res.stdout[-3000:] + res.stderr[-2000:]
