"""The data position is one integer: on a prepared dataset (data=tokens), a dp2 run whose rank is killed
mid-run and resumed from its checkpoint loads, step by step, exactly the samples of an uninterrupted dp2
run and of a dp4 run of the same config (data.log_samples: every rank's sample ids), and reports the
periodic eval loss."""
import json
from pathlib import Path
from typing import Dict, List

import numpy as np
import pytest

from helpers import launch, read_metrics, runs_json

STEPS = 6
BASE = ["model=gpt_tiny", "precision=fp32", "cluster=local", "data=tokens", "data.log_samples=true",
        "data.eval_every=3", f"train.steps={STEPS}", "train.global_batch_size=8", "train.micro_batch_size=2",
        "train.checkpoint.every=2", "train.log_interval=0", "seed=5"]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    from launcher.data.manifest import write_dataset

    rng = np.random.default_rng(0)

    def docs(n):
        return [rng.integers(1, 500, size=int(rng.integers(20, 300))).tolist() for _ in range(n)]

    out = tmp_path_factory.mktemp("data") / "ds"
    write_dataset(out, {"train": docs(60), "val": docs(8)}, vocab_size=512, eos_id=0, shard_tokens=2048)
    return out


def run(root: Path, dataset: Path, procs: int, *extra: str) -> Path:
    res = launch([*BASE, f"data.path={dataset}", f"cluster.gpus_per_node={procs}", *extra], root, timeout=240)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    (r,) = runs_json(root)
    assert r["status"] == "completed", r
    return Path(r["dir"])


def samples_by_step(run_dir: Path) -> Dict[int, List[list]]:
    """Step -> the sample ids of every rank, rank by rank (a step's global batch in order)."""
    out: Dict[int, List[list]] = {}
    ranks = sorted(run_dir.glob("samples/rank_*.jsonl"), key=lambda p: int(p.stem.split("_")[1]))
    for path in ranks:
        lines = [json.loads(x) for x in path.read_text().splitlines()]
        assert [x["step"] for x in lines] == list(range(1, STEPS + 1)), path  # one line per step, once
        for x in lines:
            out.setdefault(x["step"], []).extend(x["samples"])
    return out


@pytest.mark.dist
@pytest.mark.timeout(600)
def test_killed_resumed_dp2_loads_the_samples_of_dp2_and_dp4(tmp_path, dataset):
    killed = run(tmp_path / "killed", dataset, 2, "train.fail_at_step=5", "train.fail_rank=1",
                 "train.fail_mode=kill", "train.fail_attempt=1")
    plain = run(tmp_path / "plain", dataset, 2)
    wide = run(tmp_path / "wide", dataset, 4)
    (restart,) = [json.loads(x) for x in (killed / "restarts.jsonl").read_text().splitlines()]
    assert 0 < restart["from_step"] < 5  # killed in step 5: resumed from 4 (or 2, if 4's async save was cut)
    ref = samples_by_step(plain)
    assert len(ref[1]) == 8 and ref[1] != ref[2]
    assert samples_by_step(killed) == ref
    assert samples_by_step(wide) == ref
    evals = {name: [r.get("eval_loss") for r in read_metrics(d)] for name, d in
             (("killed", killed), ("plain", plain), ("wide", wide))}
    assert [e is not None for e in evals["plain"]] == [False, False, True, False, False, True]
    assert evals["killed"] == evals["plain"]  # bitwise: the resumed run is the uninterrupted one
    assert evals["wide"][-1] == pytest.approx(evals["plain"][-1], rel=1e-4)
