"""Unit tests of the GPT recipe: model, synthetic data/sampler, and the DDP training loop."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from launcher.config.layout import Layout
from launcher.config.rules import resolve
from launcher.config.seeding import derive_seed
from launcher.run.rundir import RunDir
from launcher.runtime.context import RunContext
from recipes.common.data import (
    BigramDataset,
    micro_batch_indices,
    micro_batches,
    transition_table,
)
from recipes.common.schedule import lr_at
from recipes.gpt.model import GPT, count_parameters
from recipes.gpt.schema import GPTRunConfig as RunConfig
from recipes.gpt.train import main

TINY_MODEL = dict(
    name="gpt_unit",
    num_layers=2,
    hidden_size=32,
    num_heads=4,
    ffn_hidden_size=64,
    vocab_size=64,
    seq_len=16,
    dropout=0.0,
    tie_embeddings=True,
)
METRIC_KEYS = {"step", "loss", "tokens_per_s", "samples_per_s", "step_time_s", "lr", "grad_norm"}


def make_cfg(model=None, **sections):
    """A typed RunConfig with the tiny model; ``sections`` are merged on top."""
    overrides = {
        "cluster": {"name": "unit"},
        "model": {**TINY_MODEL, **(model or {})},
        "train": {"micro_batch_size": 2, "global_batch_size": 8, "steps": 5, "log_interval": 10},
        "optim": {"lr": 1e-2, "warmup_steps": 0},
        "recipe": {"_target_": "recipes.gpt.train.main"},
    }
    for key, value in sections.items():
        overrides[key] = {**overrides.get(key, {}), **value}
    return OmegaConf.merge(OmegaConf.structured(RunConfig), overrides)


def make_ctx(cfg, run_dir: Path, rank: int = 0, world_size: int = 1) -> RunContext:
    """As the launcher does: the layout of ``cfg`` on a ``world_size``-process node (raises
    ConfigErrors, a ValueError, when a layout rule is broken)."""
    on_world = OmegaConf.merge(cfg, {"cluster": {"nodes": 1, "gpus_per_node": world_size}})
    return RunContext(
        rank=rank,
        world_size=world_size,
        local_rank=rank,
        local_world_size=world_size,
        node_rank=0,
        hostname="localhost",
        rundir=RunDir(run_dir),
        layout=resolve(on_world),
        device="cpu",
        backend="gloo",
    )


def read_metrics(run_dir: Path):
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def run_single(cfg, run_dir: Path):
    """``main`` in this process, inside a world_size=1 gloo group (FileStore in run_dir)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    ctx = make_ctx(cfg, run_dir)
    dist.init_process_group(
        "gloo", init_method=f"file://{run_dir / 'store'}", rank=0, world_size=1
    )
    try:
        return main(cfg, ctx)
    finally:
        ctx.close()
        dist.destroy_process_group()


def analytic_params(m: dict) -> int:
    h, f, v, s, layers = (m[k] for k in ("hidden_size", "ffn_hidden_size", "vocab_size", "seq_len", "num_layers"))
    embed = v * h + s * h
    block = (
        2 * h  # ln1
        + 3 * h * h + 3 * h  # qkv
        + h * h + h  # attention output projection
        + 2 * h  # ln2
        + h * f + f  # fc1
        + f * h + h  # fc2
    )
    head = 0 if m["tie_embeddings"] else v * h
    return embed + layers * block + 2 * h + head


# ---------------------------------------------------------------------------- model


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tie", [True, False])
def test_parameter_count_matches_analytic(tie):
    m = {**TINY_MODEL, "tie_embeddings": tie}
    model = GPT(OmegaConf.create(m))
    assert count_parameters(model) == analytic_params(m)
    assert (model.head.weight is model.embedding.word.weight) == tie
    # modular seams for later tensor/pipeline parallelism
    assert len(model.blocks) == m["num_layers"]
    assert isinstance(model.final_norm, torch.nn.LayerNorm)


@pytest.mark.timeout(120)
def test_init_scales_output_projections():
    m = {**TINY_MODEL, "num_layers": 8, "hidden_size": 128, "ffn_hidden_size": 512}
    torch.manual_seed(0)
    model = GPT(OmegaConf.create(m))
    out_std = 0.02 / math.sqrt(2 * m["num_layers"])
    proj = torch.cat([b.attn.proj.weight.flatten() for b in model.blocks])
    fc1 = torch.cat([b.mlp.fc1.weight.flatten() for b in model.blocks])
    assert proj.std().item() == pytest.approx(out_std, rel=0.05)
    assert fc1.std().item() == pytest.approx(0.02, rel=0.05)
    assert all(torch.all(b.attn.qkv.bias == 0) for b in model.blocks)


@pytest.mark.timeout(120)
def test_causal_masking():
    torch.manual_seed(0)
    model = GPT(OmegaConf.create(TINY_MODEL)).eval()
    tokens = torch.randint(0, TINY_MODEL["vocab_size"], (2, TINY_MODEL["seq_len"]))
    changed = tokens.clone()
    t = 9
    changed[:, t] = (changed[:, t] + 1) % TINY_MODEL["vocab_size"]
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    assert a.shape == (2, TINY_MODEL["seq_len"], TINY_MODEL["vocab_size"])
    torch.testing.assert_close(a[:, :t], b[:, :t], rtol=0, atol=1e-6)
    assert not torch.allclose(a[:, t:], b[:, t:])


@pytest.mark.timeout(120)
def test_forward_with_labels_returns_mean_cross_entropy():
    torch.manual_seed(0)
    model = GPT(OmegaConf.create(TINY_MODEL)).eval()
    tokens = torch.randint(0, 64, (2, 16))
    labels = torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        logits = model(tokens)
        loss = model(tokens, labels=labels)
    expected = torch.nn.functional.cross_entropy(logits.reshape(-1, 64), labels.reshape(-1))
    torch.testing.assert_close(loss, expected)
    # small init: the untrained model is close to uniform
    assert abs(loss.item() - math.log(64)) < 0.1


@pytest.mark.timeout(120)
def test_recompute_modes_same_gradients():
    m = {**TINY_MODEL, "dropout": 0.1}
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    grads = {}
    for mode in ("none", "selective", "full"):
        torch.manual_seed(0)
        model = GPT(OmegaConf.create(m), recompute=mode).train()
        torch.manual_seed(7)  # same dropout masks
        model(tokens, labels=tokens).backward()
        grads[mode] = [p.grad.clone() for p in model.parameters()]
    for mode in ("selective", "full"):
        for g0, g1 in zip(grads["none"], grads[mode]):
            torch.testing.assert_close(g0, g1, rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="recompute"):
        GPT(OmegaConf.create(TINY_MODEL), recompute="bogus")


# ----------------------------------------------------------------- seeding and data


@pytest.mark.timeout(120)
def test_derive_seed_stable():
    s = derive_seed(1234, "data")
    assert s == derive_seed(1234, "data")
    assert 0 <= s < 2**31
    assert s != derive_seed(1234, "model") and s != derive_seed(1235, "data")


@pytest.mark.timeout(120)
def test_sampler_indices_layout():
    # dp=2, a=2, mb=2, G=8, step 3: rank 1 holds 24+4.. in two micro batches
    layout = Layout(dp=2, micro_batch_size=2, grad_accum=2)
    assert layout.global_batch_size == 8
    assert micro_batch_indices(3, layout, 1) == [[28, 29], [30, 31]]
    # a global batch that dp * micro batch does not divide has no layout (G=10, mb=4, dp=2)
    with pytest.raises(ValueError, match="global_batch_size"):
        resolve(make_cfg(train={"global_batch_size": 10, "micro_batch_size": 4}, cluster={"gpus_per_node": 2}))


@pytest.mark.timeout(120)
@pytest.mark.usefixtures("cpu_host")  # its premise: local processes on the CPU
def test_sampler_same_global_samples_for_any_dp():
    args = dict(data_seed=11, vocab_size=128, seq_len=32, branching=3)
    layouts = {dp: resolve(make_cfg(train={"global_batch_size": 16, "micro_batch_size": 4},
                                    cluster={"gpus_per_node": dp})) for dp in (1, 2, 4)}
    for step in (0, 1, 5):
        per_layout = []
        for dp, expected_accum in ((1, 4), (2, 2), (4, 1)):
            assert layouts[dp].dp == dp and layouts[dp].global_batch_size == 16
            toks, labs = [], []
            for rank in range(dp):
                mbs = micro_batches(step=step, layout=layouts[dp], dp_rank=rank, **args)
                assert len(mbs) == expected_accum
                for tokens, labels in mbs:
                    assert tokens.shape == labels.shape == (4, 32)
                    assert tokens.dtype == labels.dtype == torch.long
                    toks.append(tokens)
                    labs.append(labels)
            per_layout.append((torch.cat(toks), torch.cat(labs)))
        for tokens, labels in per_layout[1:]:
            assert torch.equal(tokens, per_layout[0][0])
            assert torch.equal(labels, per_layout[0][1])
    # deterministic across calls, different across steps
    a = micro_batches(step=2, layout=layouts[2], dp_rank=1, **args)
    b = micro_batches(step=2, layout=layouts[2], dp_rank=1, **args)
    c = micro_batches(step=3, layout=layouts[2], dp_rank=1, **args)
    assert all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(a, b))
    assert not torch.equal(a[0][0], c[0][0])


@pytest.mark.timeout(120)
def test_dataset_is_a_bigram_walk():
    ds = BigramDataset(data_seed=5, vocab_size=100, seq_len=40, branching=3)
    tokens, labels = ds.batch([0, 7, 123456])
    assert torch.equal(tokens[:, 1:], labels[:, :-1])  # labels are tokens shifted by one
    table = transition_table(5, 100, 3)
    allowed = (table[tokens] == labels.unsqueeze(-1)).any(-1)
    assert bool(allowed.all())
    # sample i depends on (seed, i) only
    t7, l7 = ds[7]
    assert torch.equal(t7, tokens[1]) and torch.equal(l7, labels[1])
    other = BigramDataset(data_seed=6, vocab_size=100, seq_len=40, branching=3)
    assert not torch.equal(other[7][0], t7)


@pytest.mark.timeout(120)
def test_torch_walk_matches_numpy_walk(monkeypatch):
    import recipes.common.data as data

    expected = BigramDataset(3, 50, 20, 2).batch([1, 2, 3])
    monkeypatch.setattr(data, "_np", None)
    got = BigramDataset(3, 50, 20, 2).batch([1, 2, 3])
    assert torch.equal(expected[0], got[0]) and torch.equal(expected[1], got[1])


@pytest.mark.timeout(120)
def test_lr_schedule():
    kw = dict(lr=1.0, min_lr_ratio=0.1, warmup_steps=4, total_steps=20)
    assert lr_at(1, **kw) == pytest.approx(0.25)
    assert lr_at(4, **kw) == pytest.approx(1.0)
    assert lr_at(20, **kw) == pytest.approx(0.1)
    values = [lr_at(s, **kw) for s in range(4, 21)]
    assert all(a >= b for a, b in zip(values, values[1:]))


# --------------------------------------------------------------------- training loop


@pytest.mark.timeout(120)
def test_main_single_process_learns(tmp_path):
    cfg = make_cfg(train={"steps": 30})
    summary = run_single(cfg, tmp_path)
    rows = read_metrics(tmp_path)
    assert len(rows) == 30
    assert [r["step"] for r in rows] == list(range(1, 31))
    for row in rows:
        assert METRIC_KEYS <= row.keys()
        assert all(math.isfinite(row[k]) for k in METRIC_KEYS)
    losses = [r["loss"] for r in rows]
    first5, last5 = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last5 < first5 - 0.5, (first5, last5)
    assert summary["steps"] == 30
    assert summary["final_loss"] == pytest.approx(losses[-1])
    assert summary["first_loss"] == pytest.approx(losses[0])
    assert summary["params"] == analytic_params(TINY_MODEL)
    assert summary["world_size"] == 1 and summary["grad_accum"] == 4
    assert summary["mean_tokens_per_s"] > 0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["full", "selective"])
def test_main_recompute_same_losses(tmp_path, mode):
    base = run_single(make_cfg(train={"steps": 4}), tmp_path / "none")
    other = run_single(make_cfg(train={"steps": 4, "recompute": mode}), tmp_path / mode)
    assert base["final_loss"] == pytest.approx(other["final_loss"], abs=1e-5)
    a = [r["loss"] for r in read_metrics(tmp_path / "none")]
    b = [r["loss"] for r in read_metrics(tmp_path / mode)]
    assert a == pytest.approx(b, abs=1e-5)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_main_mixed_precision_runs(tmp_path, dtype):
    summary = run_single(make_cfg(train={"steps": 3}, precision={"dtype": dtype}), tmp_path)
    assert math.isfinite(summary["final_loss"])
    assert len(read_metrics(tmp_path)) == 3


@pytest.mark.timeout(120)
def test_main_rejects_tensor_parallel(tmp_path):
    with pytest.raises(ValueError, match="parallelism.tp"):
        run_single(make_cfg(parallelism={"tp": 2, "engine": "ddp"}), tmp_path)


@pytest.mark.timeout(120)
def test_main_fault_injection(tmp_path):
    cfg = make_cfg(train={"steps": 5, "fail_at_step": 3, "fail_rank": 0})
    with pytest.raises(RuntimeError, match="injected failure at step 3 on rank 0"):
        run_single(cfg, tmp_path)
    assert len(read_metrics(tmp_path)) == 2


def test_prefetched_batches_are_the_ones_made_inline_and_the_next_is_made_ahead():
    import threading

    from recipes.common.data import Prefetch, micro_batches

    lay = Layout(dp=2, micro_batch_size=2, grad_accum=3)
    make = lambda s: micro_batches(7, s - 1, lay, 1, 64, 16, 4)  # noqa: E731
    made_in = []

    def recording(s):
        made_in.append((s, threading.current_thread().name))
        return make(s)

    pre = Prefetch(recording, last=4)
    try:
        for step in (1, 2, 3, 4):
            got = pre.get(step)
            want = make(step)
            assert all(torch.equal(a, b) and torch.equal(c, d) for (a, c), (b, d) in zip(got, want))
    finally:
        pre.close()
    assert [s for s, _ in made_in] == [1, 2, 3, 4]  # each step made once, none past the last
    assert all(name.startswith("prefetch") for s, name in made_in if s > 1)  # made while the step before trained
    # a step asked out of order (a resumed attempt) is made inline
    pre = Prefetch(make, last=10)
    try:
        assert torch.equal(pre.get(6)[0][0], make(6)[0][0])
    finally:
        pre.close()
