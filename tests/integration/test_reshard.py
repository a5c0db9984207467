"""Resuming on another layout (launcher.submit.reshard, launcher.training.universal): the GPT
(fp32, dropout 0) goes megatron 3d on 4 Slurm nodes -> DeepSpeed ZeRO-2 on 2 -> megatron pp4 on 4 ->
DDP on one node, a Hugging Face Llama FSDP2 -> ZeRO-3 -> FSDP2 (cluster=local), each killed between
hops. The per-step losses equal the uninterrupted single-process run's within the layout tests'
tolerance, and each reshard's loaded state (weights, Adam's moments and steps, gathered) is bitwise
what was saved. The refusals' rules: tests/unit/test_reshard_rules.py."""
import json
from pathlib import Path

import pytest

from helpers import BIN, EQUIV_BASE, launch, read_metrics, run_cmd, runs_json, wait_final

LOSS_ATOL = 5e-6  # the layout tests' tolerance (tests/integration/test_engine_megatron.py)


def _resume(run: Path, root: Path, *changes: str):
    return run_cmd([str(BIN / "launcher"), "resume", str(run), *changes], root, timeout=300)


def _lines(path: Path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _losses_match(run: Path, ref: Path, steps: int, hops: str) -> float:
    """Every step's loss of the resharded run within LOSS_ATOL of the single-process run's; the largest
    difference."""
    rows, want = read_metrics(run), read_metrics(ref)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    dev = max(abs(a["loss"] - b["loss"]) for a, b in zip(rows, want))
    print(f"max |loss - single process| over {hops}: {dev:.2e}")
    assert dev <= LOSS_ATOL, ([r["loss"] for r in rows], [r["loss"] for r in want])
    return dev


# The drill on the 4-node local Slurm cluster: gpt_tiny with 4 layers (so that pp=4 divides it)
SLURM_BASE = [*EQUIV_BASE, "model.num_layers=4", "train.steps=16", "train.checkpoint.every=4",
              # blocking saves: each resharded start needs the failed attempt's last save
              "train.checkpoint.async_save=false"]


@pytest.mark.timeout(1200)
def test_3d_on_4_slurm_nodes_to_zero2_on_2_to_pp4_on_4_to_ddp_on_1(slurm, tmp_path):
    """dp2 x pp2 x tp2 on 4 nodes (2 processes each) killed at step 6, resumed as DeepSpeed ZeRO-2 dp4 on
    2 nodes, killed at 10, as megatron pp4 on 4 nodes, killed at 14, as DDP on one node: every step's
    loss within the layout tests' tolerance of one process (cluster=local), every reshard bitwise."""
    res = launch([*SLURM_BASE[:-2], "cluster.gpus_per_node=1"], tmp_path / "ref", timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    (ref,) = runs_json(tmp_path / "ref")
    root = tmp_path / "runs"
    res = launch([*SLURM_BASE, "cluster=local_slurm", "cluster.nodes=4", "cluster.gpus_per_node=2", "parallelism=3d",
                  "parallelism.tp=2", "parallelism.pp=2", "train.fail_at_step=6", "train.fail_rank=0",
                  # no restart: the next attempt is launcher resume on another layout
                  "train.fail_attempt=1", "train.max_restarts=0"], root, extra_env=slurm, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    (row,) = wait_final(root, 1, timeout=300)
    assert row["status"] == "failed", row
    run = Path(row["dir"])
    # each rank's tensor-parallel shards named in its own files, not gathered into universal/
    ckpt = run / "checkpoints" / "step_00000004"
    assert json.loads((ckpt / "meta.json").read_text())["universal"] == "linked" and not (ckpt / "universal").exists()

    # refused before anything queues, naming the key and the fix: DeepSpeed's ZeRO-0 in bf16 (its own
    # unpartitioned master copy), and a pipeline that does not divide the model's 4 layers
    res = _resume(run, root, "parallelism.engine=deepspeed", "zero.stage=0", "precision.dtype=bf16",
                  "parallelism.tp=1", "parallelism.pp=1", "cluster.nodes=2")
    assert res.returncode == 2 and "DeepSpeed ZeRO-0 in bf16" in res.stderr and "set zero.stage" in res.stderr, \
        res.stderr
    res = _resume(run, root, "parallelism.pp=3", "parallelism.tp=1", "cluster.nodes=3", "cluster.gpus_per_node=1")
    assert res.returncode == 2 and "model.num_layers: 4 layers cannot be split evenly into pp=3" in res.stderr, \
        res.stderr
    assert json.loads((run / "run.json").read_text())["layout"]["tp"] == 2  # nothing changed

    hops = [(["parallelism.engine=deepspeed", "zero.stage=2", "parallelism.tp=1", "parallelism.pp=1",
              "cluster.nodes=2", "train.fail_at_step=10", "train.fail_attempt=2"], 4, "failed"),
            (["parallelism.engine=megatron", "zero.stage=0", "parallelism.pp=4", "cluster.nodes=4",
              "cluster.gpus_per_node=1", "train.fail_at_step=14", "train.fail_attempt=3"], 8, "failed"),
            (["parallelism.engine=ddp", "parallelism.pp=1", "cluster.nodes=1", "train.fail_at_step=null"], 12,
             "completed")]
    for changes, step, end in hops:
        res = run_cmd([str(BIN / "launcher"), "resume", str(run), *changes, "--wait"], root, timeout=400,
                      extra_env=slurm)
        assert f"from step {step}" in res.stdout, res.stdout[-2000:] + res.stderr[-2000:]
        (row,) = wait_final(root, 1, timeout=300)
        assert row["status"] == end, (row, res.stdout[-2000:])
        if step == 4:  # ZeRO-2's saves name each rank's fragments of its fp32 partitions: nothing gathered
            ckpt = run / "checkpoints" / "step_00000008"
            assert json.loads((ckpt / "meta.json").read_text())["universal"] == "linked", ckpt

    dev = _losses_match(run, Path(ref["dir"]), 16, "3d on 4 nodes -> ZeRO-2 dp4 on 2 -> pp4 on 4 -> ddp on 1")
    reshards = _lines(run / "reshard.jsonl")
    assert [(r["step"], r["to"]["engine"], r["to"]["nodes"], r["to"]["dp"], r["to"]["tp"], r["to"]["pp"])
            for r in reshards] == [(4, "deepspeed", 2, 4, 1, 1), (8, "megatron", 4, 1, 1, 4), (12, "ddp", 1, 1, 1, 1)]
    for r in reshards:
        assert r["bitwise_equal"] and not r["verify"]["mismatched"] and not r["verify"]["missing"], r
    assert (reshards[0]["from"]["nodes"], reshards[0]["from"]["tp"], reshards[0]["from"]["pp"]) == (4, 2, 2)
    four = [f"node{i}" for i in range(1, 5)]  # each resume's row names the nodes of the attempt it ended
    nodes = [r["nodes"] for r in _lines(run / "restarts.jsonl")]
    assert (nodes[0], len(nodes[1]), nodes[2]) == (four, 2, four) and set(nodes[1]) < set(four), nodes
    assert json.loads((run / "status.json").read_text())["status"] == "completed"
    # the one-process attempt's records are the run's; those of the ranks and nodes it lacks are under
    # the attempts that had them
    assert sorted(p.name for p in (run / "ranks").glob("rank_*.json")) == ["rank_0.json"]
    assert (run / "attempts" / "1" / "ranks" / "rank_7.json").is_file()
    assert (run / "attempts" / "3" / "ranks" / "rank_3.json").is_file()
    assert len(list((run / "topology").glob("node_*.json"))) == 1

    # `launcher diff` against the uninterrupted run: the largest loss difference and each reshard
    res = run_cmd([str(BIN / "launcher"), "diff", str(run), ref["dir"]], root, timeout=120)
    assert f"max |diff| {dev}" in res.stdout or dev == 0, res.stdout
    assert ("resharded (a): step 4: engine megatron -> deepspeed, dp 2 -> 4, tp 2 -> 1, pp 2 -> 1, zero 0 -> 2 "
            "(209 tensors bitwise equal)") in res.stdout, res.stdout
    assert "resharded (a): step 12: engine megatron -> ddp, pp 4 -> 1" in res.stdout, res.stdout


HF = ["recipe=lm", "model=hf_llama_tiny", "precision=fp32", "train.steps=10", "train.global_batch_size=8",
      "train.micro_batch_size=2", "optim.lr=3e-3", "optim.warmup_steps=2", "seed=11", "train.log_interval=0",
      "cluster=local"]


@pytest.mark.dist
@pytest.mark.timeout(600)
def test_a_hugging_face_model_goes_fsdp2_to_zero3_and_back_identically(tmp_path):
    """transformers' Llama (recipe=lm) as FSDP2 dp2 dies at step 6, resumes as DeepSpeed ZeRO-3 dp2 (its
    weights partitioned too), dies at step 10, resumes as FSDP2 in one process: losses within the
    layout tests' tolerance of its single-process run, both reshards bitwise (each from the shards as
    its save linked them in its own files, FSDP2's rows and ZeRO-3's flat partitions, assembled at the
    resume)."""
    res = launch([*HF, "cluster.gpus_per_node=1"], tmp_path / "ref", timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    (ref,) = runs_json(tmp_path / "ref")
    root = tmp_path / "runs"
    res = launch([*HF, "cluster.gpus_per_node=2", "parallelism=fsdp", "train.checkpoint.every=4",
                  # no restart: the next attempt is launcher resume on another layout
                  "train.fail_at_step=6", "train.fail_rank=0", "train.fail_attempt=1", "train.max_restarts=0"],
                 root, timeout=300)
    assert res.returncode == 1, res.stdout[-2000:] + res.stderr[-2000:]
    (row,) = runs_json(root)
    run = Path(row["dir"])
    # FSDP2's shards named in its own files (each rank's rows of each tensor), not written twice
    fsdp_ckpt = run / "checkpoints" / "step_00000004"
    assert json.loads((fsdp_ckpt / "meta.json").read_text())["universal"] == "linked"
    assert not (fsdp_ckpt / "universal").exists()
    res = _resume(run, root, "parallelism.engine=deepspeed", "zero.stage=3", "train.fail_at_step=10",
                  "train.fail_attempt=2")
    assert "from step 4" in res.stdout, res.stdout + res.stderr
    # ZeRO-3's fragments of each parameter and moment named in its own partitions' files, not written twice
    zero3_ckpt = run / "checkpoints" / "step_00000008"
    assert json.loads((zero3_ckpt / "meta.json").read_text())["universal"] == "linked"
    assert not (zero3_ckpt / "universal").exists()
    res = _resume(run, root, "parallelism.engine=fsdp", "zero.stage=0", "cluster.gpus_per_node=1",
                  "train.fail_at_step=null")
    assert res.returncode == 0 and "from step 8" in res.stdout, res.stdout[-2000:] + res.stderr[-2000:]

    _losses_match(run, Path(ref["dir"]), 10, "fsdp dp2 -> ZeRO-3 dp2 -> fsdp 1 (Llama)")
    reshards = _lines(run / "reshard.jsonl")
    assert [(r["step"], r["moved"]) for r in reshards] == [
        (4, {"engine": ["fsdp", "deepspeed"], "zero": [0, 3]}),
        (8, {"engine": ["deepspeed", "fsdp"], "dp": [2, 1], "zero": [3, 0]})]
    for r in reshards:  # every weight and both Adam moments and the step of each parameter
        assert r["bitwise_equal"] and not r["verify"]["mismatched"] and r["verify"]["tensors"] > 80, r


@pytest.mark.dist
@pytest.mark.timeout(600)
def test_megatron_tp2_zero1_in_fp16_goes_on_as_ddp_with_its_partitions_and_its_grown_loss_scale(tmp_path):
    """The GPT in fp16 as megatron tp2 x ZeRO-1 dp2 (each rank holds its shards of the moments of its
    partition) dies at step 6 after its scale grew (2**4, doubling every 2 good steps), resumes as DDP in
    one process: every weight, every moment (assembled from the shards of the ranks that held it) and the
    scaler (scale, good steps, overflows left) bitwise the saved ones. The saves wrote no universal/: each
    rank named its shards in its own files."""
    root = tmp_path / "runs"
    res = launch([*EQUIV_BASE, "precision=fp16", "precision.initial_scale_power=4", "precision.loss_scale_window=2",
                  # blocking saves: the resharded start needs the last save
                  "train.steps=8", "train.checkpoint.every=4", "train.checkpoint.async_save=false",
                  "cluster.gpus_per_node=4", "parallelism.engine=megatron", "parallelism.tp=2", "zero.stage=1",
                  "train.fail_at_step=6",
                  "train.fail_rank=0",
                  # no restart: the next attempt is launcher resume on another layout
                  "train.fail_attempt=1", "train.max_restarts=0"], root, timeout=300)
    assert res.returncode == 1, res.stdout[-2000:] + res.stderr[-2000:]
    (row,) = runs_json(root)
    run = Path(row["dir"])
    import torch
    import torch.distributed.checkpoint as dcp

    saved = {"scaler": {k: torch.zeros(1, dtype=dt) for k, dt in (("scale", torch.float64),
                                                                   ("good_steps", torch.int64),
                                                                   ("overflows_left", torch.int64))}}
    from launcher.training import universal_links

    # linked: each rank's shards of the weights and of its partition's moments named in its own files
    ckpt = run / "checkpoints" / "step_00000004"
    assert json.loads((ckpt / "meta.json").read_text())["universal"] == "linked"
    assert not (ckpt / "universal").exists() and len(list(ckpt.glob("universal.links.*.json"))) == 4
    # written from them as a reshard does
    source = universal_links.source(ckpt, 0, tmp_path / "universal")
    dcp.load(saved, checkpoint_id=str(source), no_dist=True)
    assert saved["scaler"]["scale"].item() > 2 ** 4, saved  # grown before the checkpoint
    res = _resume(run, root, "zero.stage=0", "parallelism.engine=ddp", "parallelism.tp=1", "cluster.gpus_per_node=1",
                  "train.fail_at_step=null")
    assert res.returncode == 0 and "from step 4" in res.stdout, res.stdout[-2000:] + res.stderr[-2000:]
    (reshard,) = _lines(run / "reshard.jsonl")
    assert reshard["moved"]["engine"] == ["megatron", "ddp"] and reshard["bitwise_equal"], reshard
    assert not reshard["verify"]["mismatched"] and not reshard["verify"]["missing"], reshard
    assert reshard["from"]["zero"] == 1 and reshard["verify"]["tensors"] > 100, reshard  # moments and scaler too
    assert [r["step"] for r in read_metrics(run)] == list(range(1, 9))
