"""Resuming on another layout (launcher.submit.reshard, launcher.training.universal): the GPT
(fp32, dropout 0) as DDP dp2 dies at step 6 (checkpoint every 4), is resumed as DeepSpeed ZeRO-2 dp2,
dies again at step 10 (checkpoint at 8), and is resumed as FSDP in one process. Its per-step losses equal the
uninterrupted single-process run's within the layout tests' tolerance, and each reshard's loaded state
(weights, Adam's moments and steps, gathered) is bitwise what was saved. The refusals' rules:
tests/unit/test_reshard_rules.py."""
import json
from pathlib import Path

import pytest

from helpers import BIN, EQUIV_BASE, launch, read_metrics, run_cmd, runs_json

LOSS_ATOL = 5e-6  # the layout tests' tolerance (tests/integration/test_engine_megatron.py)


def _resume(run: Path, root: Path, *changes: str):
    return run_cmd([str(BIN / "launcher"), "resume", str(run), *changes], root, timeout=300)


def _lines(path: Path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.dist
@pytest.mark.timeout(600)
def test_ddp_to_zero2_to_fsdp_in_one_process_trains_on_identically(equivalence_reference, tmp_path):
    root = tmp_path / "runs"
    res = launch([*EQUIV_BASE, "cluster.gpus_per_node=2", "parallelism.engine=ddp", "train.checkpoint.every=4",
                  "train.fail_at_step=6", "train.fail_rank=0", "train.fail_attempt=1", "train.max_restarts=0"],
                 root, timeout=300)
    assert res.returncode == 1, res.stdout[-2000:] + res.stderr[-2000:]
    (row,) = runs_json(root)
    run = Path(row["dir"])
    assert (run / "checkpoints" / "step_00000004" / "universal" / ".metadata").is_file()

    # refused before anything queues, naming the key and the fix: megatron's ZeRO-1 optimizer partitions
    res = _resume(run, root, "parallelism.tp=2", "parallelism.engine=megatron", "zero.stage=1")
    assert res.returncode == 2 and "megatron engine at ZeRO-1" in res.stderr and "zero.stage=0" in res.stderr, \
        res.stderr
    assert json.loads((run / "run.json").read_text())["layout"]["engine"] == "ddp"  # nothing changed

    res = _resume(run, root, "parallelism.engine=deepspeed", "zero.stage=2", "train.fail_at_step=10",
                  "train.fail_attempt=2")
    assert "resuming" in res.stdout and "from step 4" in res.stdout, res.stdout + res.stderr
    res = _resume(run, root, "parallelism.engine=fsdp", "zero.stage=0", "cluster.gpus_per_node=1",
                  "train.fail_at_step=null")
    assert res.returncode == 0 and "from step 8" in res.stdout, res.stdout[-2000:] + res.stderr[-2000:]

    rows, ref = read_metrics(run), read_metrics(equivalence_reference)
    assert [r["step"] for r in rows] == list(range(1, 11))
    dev = max(abs(a["loss"] - b["loss"]) for a, b in zip(rows, ref))
    print(f"max |loss - single process| over ddp dp2 -> ZeRO-2 dp2 -> fsdp 1: {dev:.2e}")
    assert dev <= LOSS_ATOL, ([r["loss"] for r in rows], [r["loss"] for r in ref])

    reshards = _lines(run / "reshard.jsonl")
    assert [(r["step"], r["moved"]) for r in reshards] == [
        (4, {"engine": ["ddp", "deepspeed"], "zero": [0, 2]}),
        (8, {"engine": ["deepspeed", "fsdp"], "dp": [2, 1], "zero": [2, 0]})]
    for r in reshards:
        assert r["bitwise_equal"] and not r["verify"]["mismatched"] and r["verify"]["tensors"] > 100, r
    layouts = [r["layout"] for r in _lines(run / "restarts.jsonl")]
    assert [(x["from"]["engine"], x["from"]["dp"], x["to"]["engine"], x["to"]["dp"], x["to"]["grad_accum"])
            for x in layouts] == [("ddp", 2, "deepspeed", 2, 4), ("deepspeed", 2, "fsdp", 1, 8)]
    assert json.loads((run / "status.json").read_text())["status"] == "completed"
    # the one-process attempt's rank record is the run's; the second rank's is under attempt 2's
    assert sorted(p.name for p in (run / "ranks").glob("rank_*.json")) == ["rank_0.json"]
    assert (run / "attempts" / "2" / "ranks" / "rank_1.json").is_file()

    # `launcher diff` against the uninterrupted run: the largest loss difference and each reshard
    res = run_cmd([str(BIN / "launcher"), "diff", str(run), str(equivalence_reference)], root, timeout=120)
    assert f"max |diff| {dev}" in res.stdout or dev == 0, res.stdout
    assert "resharded (a): step 4: engine ddp -> deepspeed, zero 0 -> 2 (113 tensors bitwise equal)" in res.stdout
    assert "resharded (a): step 8: engine deepspeed -> fsdp, dp 2 -> 1, zero 2 -> 0" in res.stdout, res.stdout


HF = ["recipe=lm", "model=hf_llama_tiny", "precision=fp32", "train.steps=10", "train.global_batch_size=8",
      "train.micro_batch_size=2", "optim.lr=3e-3", "optim.warmup_steps=2", "seed=11", "train.log_interval=0",
      "cluster=local", "wandb.enabled=false"]


@pytest.mark.dist
@pytest.mark.timeout(600)
def test_a_hugging_face_model_goes_fsdp2_to_zero3_and_back_identically(tmp_path):
    """transformers' Llama (recipe=lm) as FSDP2 dp2 dies at step 6, resumes as DeepSpeed ZeRO-3 dp2 (its
    weights partitioned too), dies at step 10, resumes as FSDP2 in one process: losses within the
    layout tests' tolerance of its single-process run, both reshards bitwise."""
    res = launch([*HF, "cluster.gpus_per_node=1"], tmp_path / "ref", timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    (ref,) = runs_json(tmp_path / "ref")
    root = tmp_path / "runs"
    res = launch([*HF, "cluster.gpus_per_node=2", "parallelism=fsdp", "train.checkpoint.every=4",
                  "train.fail_at_step=6", "train.fail_rank=0", "train.fail_attempt=1", "train.max_restarts=0"],
                 root, timeout=300)
    assert res.returncode == 1, res.stdout[-2000:] + res.stderr[-2000:]
    (row,) = runs_json(root)
    run = Path(row["dir"])
    res = _resume(run, root, "parallelism.engine=deepspeed", "zero.stage=3", "train.fail_at_step=10",
                  "train.fail_attempt=2")
    assert "from step 4" in res.stdout, res.stdout + res.stderr
    res = _resume(run, root, "parallelism.engine=fsdp", "zero.stage=0", "cluster.gpus_per_node=1",
                  "train.fail_at_step=null")
    assert res.returncode == 0 and "from step 8" in res.stdout, res.stdout[-2000:] + res.stderr[-2000:]

    rows, want = read_metrics(run), read_metrics(Path(ref["dir"]))
    assert [r["step"] for r in rows] == list(range(1, 11))
    dev = max(abs(a["loss"] - b["loss"]) for a, b in zip(rows, want))
    print(f"max |loss - single process| over fsdp dp2 -> ZeRO-3 dp2 -> fsdp 1 (Llama): {dev:.2e}")
    assert dev <= LOSS_ATOL, ([r["loss"] for r in rows], [r["loss"] for r in want])
    reshards = _lines(run / "reshard.jsonl")
    assert [(r["step"], r["moved"]) for r in reshards] == [
        (4, {"engine": ["fsdp", "deepspeed"], "zero": [0, 3]}),
        (8, {"engine": ["deepspeed", "fsdp"], "dp": [2, 1], "zero": [3, 0]})]
    for r in reshards:  # every weight and both Adam moments and the step of each parameter
        assert r["bitwise_equal"] and not r["verify"]["mismatched"] and r["verify"]["tensors"] > 80, r
