"""Shard-first construction: a rank's slices built from a meta-device model hold exactly the values
of the single-process model's slices, for every tp x pp place; the init is a function of (seed,
parameter, row) only, so any selection or ZeRO-3 partition of a weight equals that part of it."""
import contextlib
import math

import pytest
import torch
from omegaconf import OmegaConf

from recipes.gpt.init import init_flat, init_values, rule
from recipes.gpt.model import GPT
from recipes.gpt.parallel.pipeline import GPTStage
from recipes.gpt.parallel.tensor_parallel import TPContext, materialize, name_parameters

MODEL = dict(name="t", num_layers=4, hidden_size=64, num_heads=4, ffn_hidden_size=256, vocab_size=128, seq_len=32,
             dropout=0.0, tie_embeddings=True)
FLAGS = ("tensor_parallel", "sequence_parallel", "shared_embedding_copy")


def _stage(full, tp, tp_rank, pp, stage, sp=False):
    ctx = TPContext(group=None, rank=tp_rank, size=tp, sequence_parallel=sp)
    return GPTStage(full, ctx, pp, stage, "none", contextlib.nullcontext)


def _meta_stage(m, tp, tp_rank, pp, stage, seed, sp=False):
    with torch.device("meta"):
        full = GPT(m, seed=None)
    name_parameters(full)
    st = _stage(full, tp, tp_rank, pp, stage, sp)
    materialize(st, seed, int(m.num_layers), torch.device("cpu"))
    return st


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("tp,pp,sp", [(1, 1, False), (2, 1, False), (1, 2, False), (2, 2, False), (2, 2, True),
                                      (4, 1, False)])
def test_every_shard_built_from_meta_equals_the_slice_of_the_whole_model(tp, pp, sp, tied):
    m = OmegaConf.create({**MODEL, "tie_embeddings": tied})
    whole = GPT(m, seed=11)
    for stage in range(pp):
        for r in range(tp):
            want = _stage(whole, tp, r, pp, stage, sp)  # slices cut from real values
            got = _meta_stage(m, tp, r, pp, stage, seed=11, sp=sp)
            w, g = dict(want.named_parameters()), dict(got.named_parameters())
            assert list(w) == list(g)
            for name in w:
                assert g[name].device.type == "cpu" and not g[name].is_meta
                assert torch.equal(w[name], g[name]), (tp, pp, stage, r, name)
                for flag in FLAGS:
                    assert getattr(w[name], flag, None) == getattr(g[name], flag, None), (name, flag)
            if tied and pp == 1:  # the head is the embedding's own parameter, still shared
                assert got.head.weight is got.embedding.weight


def test_a_shard_holds_only_its_share_of_the_parameters():
    m = OmegaConf.create(MODEL)
    whole = sum(p.numel() for p in GPT(m, seed=1).parameters())
    held = [sum(p.numel() for p in _meta_stage(m, 2, r, 2, s, seed=1).parameters()) for s in range(2) for r in range(2)]
    # every rank holds about a quarter (replicated norms and biases, the last stage's head copy)
    assert all(h < 0.35 * whole for h in held), (held, whole)


def test_the_init_of_any_rows_and_columns_is_that_part_of_the_whole():
    full = init_values(3, "blocks.0.mlp.fc1.weight", (40, 24), 2)
    assert torch.equal(init_values(3, "blocks.0.mlp.fc1.weight", (40, 24), 2, rows=slice(10, 20), cols=slice(8, 16)),
                       full[10:20, 8:16])
    idx = torch.tensor([5, 1, 33])
    assert torch.equal(init_values(3, "blocks.0.mlp.fc1.weight", (40, 24), 2, rows=idx), full[idx])
    assert not torch.equal(full, init_values(4, "blocks.0.mlp.fc1.weight", (40, 24), 2))  # the seed matters
    assert not torch.equal(full, init_values(3, "blocks.1.mlp.fc1.weight", (40, 24), 2))  # so does the name
    assert abs(float(full.std()) - 0.02) < 0.004 and abs(float(full.mean())) < 0.004


@pytest.mark.parametrize("world", [1, 3, 4, 7])
def test_zero3_partitions_concatenate_to_the_flattened_whole(world):
    shape = (13, 10)
    full = init_values(5, "embedding.word.weight", shape, 2).reshape(-1)
    part = math.ceil(full.numel() / world)
    parts = [init_flat(5, "embedding.word.weight", shape, 2, r * part, (r + 1) * part) for r in range(world)]
    joined = torch.cat(parts)
    assert torch.equal(joined[: full.numel()], full)
    assert not joined[full.numel():].any()  # the padding of the last partition is 0


def test_the_rule_is_gpt2s():
    L = 6
    assert rule("blocks.0.attn.qkv.weight", L) == ("normal", 0.02)
    assert rule("blocks.3.attn.proj.weight", L) == ("normal", 0.02 / math.sqrt(2 * L))
    assert rule("blocks.3.mlp.fc2.weight", L)[1] == 0.02 / math.sqrt(2 * L)
    assert rule("blocks.3.mlp.fc2.bias", L) == ("zeros", 0.0)
    assert rule("blocks.3.ln1.weight", L) == ("ones", 0.0) and rule("final_norm.weight", L) == ("ones", 0.0)
    assert rule("embedding.position.weight", L) == ("normal", 0.02)


@pytest.mark.parametrize("threaded", [False, True])
def test_rows_drawn_in_place_equal_one_generator_per_row(threaded, monkeypatch):
    """The rows are drawn straight into place by a re-keyed generator, over threads for a large
    parameter: bitwise the values of one fresh Philox(key=(name, row)) per row, whole or by columns."""
    import numpy as np

    from recipes.gpt import init

    monkeypatch.setattr(init, "PARALLEL_VALUES", 1 if threaded else 1 << 40)
    if threaded:
        monkeypatch.setattr(init, "_threads", lambda: 3)
    name, shape, seed = "blocks.1.mlp.fc2.weight", (37, 50), 11
    base = init.derive_seed(seed, "init", name)
    _, std = init.rule(name, 4)
    ref = torch.stack([torch.from_numpy(
        np.random.Generator(np.random.Philox(key=init._row_seed(base, r))).standard_normal(50, dtype=np.float32))
        for r in range(37)]).mul_(std)
    assert torch.equal(init.init_values(seed, name, shape, 4), ref)
    assert torch.equal(init.init_values(seed, name, shape, 4, rows=[5, 2, 30], cols=slice(10, 35)),
                       ref[[5, 2, 30], 10:35])
