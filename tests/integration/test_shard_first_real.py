"""Shard-first construction through real `launch cluster=local` runs: the weights each layout builds,
gathered, are bitwise the single-process model's (GPT(cfg.model, seed=cfg.seed)) - one process,
megatron tp2, pp2, tp2 x pp2, and ZeRO-3 on 4 ranks, whose ranks never hold the whole model; and every
rank records the memory its construction and its steps used.

The runs use the build-only recipe of benchmarks/construction_memory.py (the engine is constructed,
nothing trained) with recipe.params.dump_weights: each rank writes what it built (megatron: its shards
and where they sit in the full parameters; ZeRO-3: the parameters gathered by DeepSpeed's
zero.GatheredParameters after deepspeed.initialize), put back together by ``gather_weights``.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Dict, List

import pytest
import torch
import yaml
from omegaconf import OmegaConf

from helpers import REPO, launch, read_metrics, runs_json

sys.path.insert(0, str(REPO))  # benchmarks/ is not an installed package
from benchmarks.construction_memory import TARGET, _entry, dump_weights, gather_weights  # noqa: E402

TINY = ["model=gpt_tiny", "precision=fp32", "seed=11", "cluster=local", "wandb.enabled=false",
        "train.log_interval=0"]

LAYOUTS = {
    # name: (overrides, processes)
    "single": (["parallelism.engine=ddp"], 1),
    "tp2": (["parallelism=tp"], 2),
    "pp2": (["parallelism=pp"], 2),
    "tp2xpp2": (["parallelism=3d"], 4),
    "zero3x4": (["zero=3"], 4),
}


def _launch(overrides: List[str], procs: int, root: Path, timeout: float = 300) -> Path:
    res = launch([*TINY, f"cluster.gpus_per_node={procs}", *overrides], root, timeout=timeout,
                 extra_env={"PYTHONPATH": str(REPO)})  # the build-only recipe's module, found at launch
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    (run,) = runs_json(root)
    assert run["status"] == "completed", run
    return Path(run["dir"])


def _states(rdir: Path, procs: int) -> Dict[int, dict]:
    states = {r: json.loads((rdir / "ranks" / f"state_{r}.json").read_text()) for r in range(procs)}
    for st in states.values():
        assert st["host_peak_build_bytes"] >= 0 and st["host_peak_source"] in ("hwm", "sampled"), st
        assert st["host_rss_after_build_bytes"] > 0 and st["host_rss_before_build_bytes"] > 0, st
    return states


@pytest.mark.dist
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_the_weights_built_gathered_are_bitwise_the_single_process_models(name, tmp_path):
    overrides, procs = LAYOUTS[name]
    rdir = _launch(["train.steps=1", "train.micro_batch_size=1", f"train.global_batch_size={2 * procs}",
                    f"recipe._target_={TARGET}", "+recipe.params.dump_weights=true", *overrides],
                   procs, tmp_path / "runs")
    cfg = OmegaConf.create(yaml.safe_load((rdir / "config.yaml").read_text()))
    from recipes.gpt.model import GPT

    want = {n: p.detach() for n, p in GPT(cfg.model, seed=int(cfg.seed)).named_parameters()}
    got = gather_weights(rdir / "built_weights")
    assert sorted(got) == sorted(want)
    differ = [n for n in want if want[n].dtype != got[n].dtype or not torch.equal(
        want[n].reshape(-1).view(torch.uint8), got[n].reshape(-1).view(torch.uint8))]
    assert not differ, (name, differ)

    states = _states(rdir, procs)
    total = sum(p.numel() for p in want.values())
    if name == "zero3x4":  # each rank holds its partitions only: ceil(numel / 4) of every parameter
        held = sum(math.ceil(p.numel() / 4) for p in want.values()) * 4
        assert all(st["params"] == held for st in states.values()), (held, states)
        assert held < 0.26 * total * 4
    if name == "tp2xpp2":  # about a quarter each (the norms and biases replicated, the head's copy)
        assert all(st["params"] < 0.4 * total * 4 for st in states.values()), states


@pytest.mark.dist
@pytest.mark.timeout(600)
def test_a_training_run_records_its_construction_and_step_memory(tmp_path):
    """The GPT recipe itself (ZeRO-3, built partitioned): every rank's state record carries what the
    model's construction used and the peak over the steps; every metrics row the resident memory."""
    rdir = _launch(["train.steps=2", "train.micro_batch_size=2", "train.global_batch_size=4", "zero=3"], 2,
                   tmp_path / "runs")
    for st in _states(rdir, 2).values():
        assert st["host_peak_step_bytes"] >= st["host_rss_after_build_bytes"] - (64 << 20), st
        assert st["host_peak_step_source"] in ("hwm", "lifetime") and st["activation_bytes"] > 0, st
        assert st["params"] > 0 and st["optimizer"] > 0  # the records already there are kept
    rows = read_metrics(rdir)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["host_rss_bytes"] > 10 << 20 for r in rows), rows


# ------------------------------------------------------------------------------------------------
# gather_weights itself: it notices a missing element and two ranks that disagree


class _Stub:
    def __init__(self, params: Dict[str, torch.nn.Parameter]) -> None:
        self.model = torch.nn.ParameterDict(params)


def test_gather_refuses_gaps_and_disagreeing_replicas(tmp_path):
    w = torch.arange(12, dtype=torch.float32).reshape(4, 3)

    def write(rank: int, entries) -> None:
        torch.save(entries, tmp_path / f"rank_{rank}.pt")

    write(0, [_entry("w", (4, 3), w[:2], rows=slice(0, 2))])
    write(1, [_entry("w", (4, 3), w[:, 1:], cols=slice(1, 3))])
    with pytest.raises(AssertionError, match="no rank built every element"):
        gather_weights(tmp_path)  # w[2:, 0] is nobody's
    write(2, [_entry("w", (4, 3), w[:, :1], cols=slice(0, 1))])
    assert torch.equal(gather_weights(tmp_path)["w"], w)
    write(3, [_entry("w", (4, 3), -w[1:2], rows=[1])])
    with pytest.raises(AssertionError, match="different values"):
        gather_weights(tmp_path)

    # a single-process engine's dump is its full parameters
    for p in tmp_path.glob("rank_*.pt"):
        p.unlink()
    dump_weights(_Stub({"w": torch.nn.Parameter(w.clone())}), tmp_path, 0)
    assert torch.equal(gather_weights(tmp_path)["w"], w)


# ------------------------------------------------------------------------------------------------
# the ZeRO-3 fill itself, chunk by chunk, for every rank of a group (no DeepSpeed: its layout by hand)


@pytest.mark.parametrize("world,chunk,dtype", [(3, 7, torch.float32), (4, 1000, torch.float32),
                                               (5, 64, torch.bfloat16)])
def test_zero3_partitions_filled_in_chunks_join_to_the_single_process_values(monkeypatch, world, chunk, dtype):
    from recipes.gpt.engines import deepspeed as ds_engine
    from recipes.gpt.model import GPT

    cfg = OmegaConf.create({"name": "t", "num_layers": 2, "hidden_size": 16, "num_heads": 2, "ffn_hidden_size": 64,
                            "vocab_size": 37, "seq_len": 8, "dropout": 0.0, "tie_embeddings": True})
    want = dict(GPT(cfg, seed=5).named_parameters())
    monkeypatch.setattr(ds_engine, "FILL_CHUNK", chunk)
    parts = {n: [] for n in want}
    for rank in range(world):
        model = GPT(cfg, seed=None)
        for p in model.parameters():  # DeepSpeed's layout: flattened, padded to world, 1/world each
            p.ds_shape, p.ds_tensor = tuple(p.shape), torch.full((math.ceil(p.numel() / world),), float("nan"),
                                                                   dtype=dtype)
        ds_engine._fill_partitions(model, 5, 2, rank_of=lambda p, rank=rank: rank)
        for n, p in model.named_parameters():
            parts[n].append(p.ds_tensor)
    for n, w in want.items():
        joined = torch.cat(parts[n])
        assert torch.equal(joined[: w.numel()], w.detach().reshape(-1).to(dtype)), n
        assert not joined[w.numel():].any(), n  # the padding is 0
