"""Dropout with tensor parallelism, through real 2-rank `launch cluster=local parallelism=tp` runs.

The masks: a probe recipe (tests/dropout_probe.py, ``recipe._target_=dropout_probe.main``) builds the
run's megatron engine and records the masks of one training-mode forward on each rank, and on rank 0
those of the single-process GPT given an RNG tracker of the same seed (dp = pp = tp rank 0):
- without sequence parallelism the embedding and residual dropouts act on replicated activations: the
  same masks on both tp ranks, and the very masks of that single-process model; the attention-probability
  dropout acts on each rank's own heads: masks drawn per rank, different on the two ranks and different
  from the single process's masks for those heads;
- with sequence parallelism the embedding and residual dropouts act on each rank's sequence chunk: drawn
  per rank, different on the two ranks and from the single process's.

Training: tp=2 with dropout (sequence parallel, selective recompute) trains, and a run whose rank is
killed mid-run restarts from its checkpoint and ends bitwise where an uninterrupted run ends (losses and
every checkpointed tensor, the dropout streams included).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import List

import pytest

from helpers import launch, read_metrics, runs_json, tensors

pytestmark = [pytest.mark.dist, pytest.mark.timeout(600)]

BASE = ["model=gpt_tiny", "precision=fp32", "cluster=local", "cluster.gpus_per_node=2", "parallelism=tp",
        "model.dropout=0.1", "seed=23", "train.log_interval=0"]
RESIDUAL = ("embedding.dropout", "blocks.0.attn.resid_dropout", "blocks.0.mlp.dropout",
            "blocks.1.attn.resid_dropout", "blocks.1.mlp.dropout")
ATTN = ("attn.0", "attn.1")


def _probe(tmp_path: Path, extra: List[str]) -> List[dict]:
    import torch

    work = tmp_path / "work"  # the probe recipe's own directory: snapshotted and run as the job's code
    work.mkdir()
    shutil.copy(Path(__file__).resolve().parents[1] / "dropout_probe.py", work / "dropout_probe.py")
    root = tmp_path / "runs"
    res = launch([*BASE, "train.steps=1", "train.micro_batch_size=2", "train.global_batch_size=2", *extra,
                  "recipe._target_=dropout_probe.main"], root, timeout=300, cwd=work)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    (run,) = runs_json(root)
    assert run["status"] == "completed", run
    out = [torch.load(Path(run["dir"]) / "probe" / f"masks_rank{r}.pt", weights_only=False) for r in (0, 1)]
    assert [o["tp_rank"] for o in out] == [0, 1]
    return out


@pytest.mark.parametrize("sp", [False, True], ids=["replicated_residual", "sequence_parallel"])
def test_masks_across_tp_ranks(tmp_path, sp):
    import torch

    r0, r1 = _probe(tmp_path, [f"parallelism.sequence_parallel={str(sp).lower()}"])
    assert r0["sequence_parallel"] is sp and r1["sequence_parallel"] is sp
    a, b, single = r0["masks"], r1["masks"], r0["single"]
    assert sorted(a) == sorted(b) == sorted(single) == sorted(RESIDUAL + ATTN)
    for k in a:  # p = 0.1 drawn: some dropped, most kept
        assert 0.8 < a[k].float().mean() < 0.97, (k, a[k].float().mean())
    bs, s, h, heads = 2, 64, 64, 4
    for k in ATTN:  # the rank's own heads: its own masks
        assert a[k].shape == b[k].shape == (bs, heads // 2, s, s)
        assert not torch.equal(a[k], b[k]), k
        assert not torch.equal(torch.cat([a[k], b[k]], dim=1), single[k]), k
    for k in RESIDUAL:
        if sp:  # the rank's sequence chunk: drawn per rank
            assert a[k].shape == b[k].shape == (bs, s // 2, h)
            assert not torch.equal(a[k], b[k]), k
            assert not torch.equal(torch.cat([a[k], b[k]], dim=1), single[k]), k
        else:  # replicated: one mask on both ranks, the single-process model's
            assert a[k].shape == (bs, s, h)
            assert torch.equal(a[k], b[k]), k
            assert torch.equal(a[k], single[k]), k


TRAIN = [*BASE, "parallelism.sequence_parallel=true", "train.recompute=selective", "train.steps=12",
         "train.checkpoint.every=3", "train.global_batch_size=8", "train.micro_batch_size=4", "optim.lr=3e-3",
         "optim.warmup_steps=2"]


def _checkpoint_tensors(run_dir: Path) -> dict:
    """Every tensor of the run's latest checkpoint, by file and key path."""
    import torch

    ckpt = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip()
    return {k: t for f in sorted(ckpt.rglob("*.pt"))
            for k, t in tensors(torch.load(f, map_location="cpu", weights_only=False), str(f.relative_to(ckpt)))}


def test_trains_and_resumes_bitwise(tmp_path):
    import torch

    runs = {}
    for name, extra in (("reference", []),
                        ("killed", ["train.fail_at_step=8", "train.fail_rank=1", "train.fail_mode=kill",
                                    "train.fail_attempt=1",
                                    # step 6's checkpoint committed before step 8's kill (async, it may
                                    # still be in flight)
                                    "train.checkpoint.async_save=false"])):
        root = tmp_path / name
        res = launch([*TRAIN, *extra], root, timeout=300)
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        (run,) = runs_json(root)
        runs[name] = Path(run["dir"])
    ref, run = runs["reference"], runs["killed"]
    losses = [r["loss"] for r in read_metrics(ref)]
    assert len(losses) == 12 and sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.1, losses
    restarts = [json.loads(x) for x in (run / "restarts.jsonl").read_text().splitlines()]
    assert [(r["attempt"], r["from_step"]) for r in restarts] == [(2, 6)], restarts
    assert [r["step"] for r in read_metrics(run)] == list(range(1, 13))
    assert [r["loss"] for r in read_metrics(run)] == losses  # bitwise
    got, want = _checkpoint_tensors(run), _checkpoint_tensors(ref)
    assert got.keys() == want.keys()
    streams = [k for k in got if "/tracker/states/" in k]
    assert len(streams) == 4, streams  # 2 ranks x (replicated, model_parallel), in the RNG files
    different = [k for k in got if got[k].shape != want[k].shape or not torch.equal(got[k], want[k])]
    assert not different, different[:5]
