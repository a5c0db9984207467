"""gather_weights (benchmarks/construction_memory.py), which the shard-first drills use to put the
weights each rank built back together: refuses gaps and disagreeing replicas, and ZeRO-3 partitions
filled in chunks join to the single-process values."""
from __future__ import annotations

import math
import sys
from typing import Dict

import pytest
import torch
from omegaconf import OmegaConf

from helpers import REPO

sys.path.insert(0, str(REPO))  # benchmarks/ is not an installed package
from benchmarks.construction_memory import _entry, dump_weights, gather_weights  # noqa: E402


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
