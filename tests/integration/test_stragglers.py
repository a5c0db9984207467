"""Stragglers on the real local Slurm cluster (4 nodes, each a process of this host), 2 nodes x 1 rank,
the shipped straggler thresholds (named at 1.5x, requeued without the node at 3x) over a short window:

- a rank made slow by the product's fault injection (``train.faults`` mode ``slow``: each of its steps
  takes 0.25 s longer): named with its node in the log and the ledger, the run saves, its job is requeued
  without that node, and it completes;
- a rank made slow from outside (its process paused and resumed, SIGSTOP/SIGCONT, 90% of the time,
  running for less than a step between pauses, as a throttled node runs), with the requeue off: named with its
  node in the ledger; the run goes on and completes.
"""
from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from helpers import launch, wait_final

BASE = ["cluster=local_slurm", "cluster.nodes=2", "cluster.gpus_per_node=1", "model=gpt_tiny",
        "optim.warmup_steps=0", "train.log_interval=0", "cluster.health.straggler_window=5"]


def events(root: Path) -> list:
    return [json.loads(p.read_text()) for p in sorted((root / "nodes" / "events").glob("*.json"))]


def rank_record(run: Path, rank: int) -> dict:
    path = run / "ranks" / f"rank_{rank}.json"
    return json.loads(path.read_text()) if path.is_file() else {}


@pytest.mark.slurm
@pytest.mark.timeout(600)
def test_a_rank_slowed_by_the_fault_setting_is_named_and_the_run_requeued_without_its_node(slurm, tmp_path):
    root = tmp_path / "runs"
    res = launch([*BASE, "train.steps=24", "train.checkpoint.every=4",
                  "train.max_restarts=2",  # the straggler's requeue needs a restart
                  "train.faults=[{at_step: 2, rank: 1, mode: slow, attempt: 1}]"], root, extra_env=slurm)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    (row,) = wait_final(root, 1, timeout=420)
    assert row["status"] == "completed", row
    run = Path(row["dir"])
    # the slowed attempt's (a later attempt's ranks may be named too where other work shares the cores)
    (ev,) = [e for e in events(root) if e["kind"] == "straggler" and e["attempt"] == 1]
    assert ev["rank"] == 1 and "is a straggler: its own step time" in ev["detail"], ev
    restarts = [json.loads(line) for line in (run / "restarts.jsonl").read_text().splitlines() if line.strip()]
    r = restarts[0]
    assert r["reason"] == "straggler" and r["excluded"] == [ev["node"]], r
    assert ev["node"] in r["nodes"]  # the first attempt ran there
    last = json.loads((run / "status.json").read_text())["hosts"]
    assert ev["node"] not in last, (ev["node"], last)
    assert [m["step"] for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())] == \
        list(range(1, 25))


@pytest.mark.slurm
@pytest.mark.timeout(600)
def test_a_rank_paused_from_outside_is_named_with_its_node(slurm, tmp_path):
    root = tmp_path / "runs"
    # steps enough for the throttled rank to be named (a window of 5 steps) with a wide margin, not for time
    res = launch([*BASE, "train.steps=150", "train.checkpoint.every=0",
                  "cluster.health.straggler_requeue_ratio=0"],  # named only: the run goes on
                 root, extra_env=slurm)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    (run,) = [p.parent for p in root.glob("*/*/run.json")]
    deadline = time.time() + 300
    while not rank_record(run, 1).get("pid") and time.time() < deadline:
        time.sleep(0.2)  # (the job starting on its nodes)
    pid = rank_record(run, 1)["pid"]
    stop = threading.Event()

    def throttle() -> None:  # paused 90% of the time, as a node running at a tenth of its speed: in runs
        try:  # shorter than a step, so that every step spans a pause (not one step in many stalled)
            while not stop.is_set():
                os.kill(pid, signal.SIGSTOP)
                stop.wait(0.09)
                os.kill(pid, signal.SIGCONT)
                stop.wait(0.01)
        except ProcessLookupError:
            pass
        finally:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass

    pauser = threading.Thread(target=throttle, daemon=True)
    pauser.start()
    try:
        while not [e for e in events(root) if e["kind"] == "straggler" and e["rank"] == 1] and time.time() < deadline:
            time.sleep(0.2)
    finally:
        stop.set()
        pauser.join(5)
    ev = [e for e in events(root) if e["kind"] == "straggler" and e["rank"] == 1][0]
    assert ev["rank"] == 1 and ev["node"] == rank_record(run, 1)["slurmd_nodename"], ev
    (row,) = wait_final(root, 1, timeout=300)
    assert row["status"] == "completed", row  # named only: no restart
    assert not (run / "restarts.jsonl").exists() or not (run / "restarts.jsonl").read_text().strip()
