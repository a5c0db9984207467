"""A run on a prepared dataset (data=tokens) archives the dataset's manifest, and one altered shard
byte makes `launcher reproduce` refuse, naming the shard (issue 21), and a new run on it fail before
its first step, naming the shard. One short local run (1 rank,
gpt_tiny, 3 steps); the other refusals and checks are pure (tests/unit/test_data_checks.py)."""
import json
from pathlib import Path

import numpy as np
import pytest

from helpers import BIN, launch, run_cmd, runs_json


@pytest.mark.timeout(300)
def test_reproduce_refuses_a_run_whose_shard_changed(tmp_path):
    from launcher.data.manifest import write_dataset

    rng = np.random.default_rng(0)
    ds = tmp_path / "ds"
    write_dataset(ds, {"train": [rng.integers(1, 500, size=200).tolist() for _ in range(20)], "val": []},
                  vocab_size=512, eos_id=0)
    root = tmp_path / "runs"
    res = launch(["model=gpt_tiny", "cluster=local", "cluster.gpus_per_node=1", "data=tokens", f"data.path={ds}",
                  "train.steps=3", "train.global_batch_size=2", "train.micro_batch_size=2", "train.log_interval=0"],
                 root, timeout=240)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    (run,) = runs_json(root)
    assert run["status"] == "completed", run
    archived = json.loads((Path(run["dir"]) / "data_manifest.json").read_text())
    assert [d["path"] for d in archived["datasets"]] == [str(ds)]

    (shard,) = json.loads((ds / "manifest.json").read_text())["splits"]["train"]["shards"]
    data = bytearray((ds / shard["bin"]).read_bytes())
    data[10] ^= 0x01
    (ds / shard["bin"]).write_bytes(bytes(data))
    res = run_cmd([str(BIN / "launcher"), "reproduce", run["run_id"], "--root", str(root)], root, timeout=120)
    assert res.returncode == 2, res.stdout + res.stderr
    assert f"dataset changed: {ds / shard['bin']}: sha256" in res.stderr, res.stderr
    assert len(runs_json(root)) == 1  # nothing launched
    # a new launch on the changed shard: the ranks verify every shard before they map it, so the run fails
    # naming the shard instead of training on bytes the manifest does not hold
    res = launch(["model=gpt_tiny", "cluster=local", "cluster.gpus_per_node=1", "data=tokens", f"data.path={ds}",
                  "train.steps=3", "train.global_batch_size=2", "train.micro_batch_size=2", "train.log_interval=0"],
                 root, timeout=240)
    assert res.returncode != 0, res.stdout[-3000:]
    failed = next(r for r in runs_json(root) if r["run_id"] != run["run_id"])
    assert failed["status"] == "failed" and failed["config"]["data"]["path"] == str(ds), failed
    assert f"{ds / shard['bin']}: sha256" in (failed["error"] or ""), failed["error"]
    metrics = Path(failed["dir"]) / "metrics.jsonl"
    assert not metrics.exists() or not metrics.read_text()  # not one step trained
