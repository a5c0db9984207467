"""The dropout RNG tracker (recipes.gpt.rng): named streams swapped in and out of the default generator,
their seeds (launcher.config.seeding.tracker_seeds), save/restore, recomputation, and the masks of a
tensor-parallel model with tp=2 simulated in one process (the collectives replaced by shape-correct
stand-ins: the masks depend on shapes and streams only, not on the values)."""
import contextlib
import io
import json

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from dropout_probe import record_masks, sdpa_mask_is_exact
from launcher.app import CONF_DIR, normalize_overrides
from launcher.config import rules
from launcher.config.seeding import derive_seed, seed_plan, tracker_seeds
from launcher.training.checkpoint import rng_state, set_rng_state
from recipes.gpt import rng
from recipes.gpt.model import GPT
from recipes.gpt.parallel import tensor_parallel as tpm
from recipes.gpt.parallel.pipeline import GPTStage

MODEL = dict(name="t", num_layers=2, hidden_size=32, num_heads=4, ffn_hidden_size=64, vocab_size=64, seq_len=16,
             dropout=0.2, tie_embeddings=True)
SEED = 11
RESIDUAL = ("embedding.dropout", "blocks.0.attn.resid_dropout", "blocks.0.mlp.dropout",
            "blocks.1.attn.resid_dropout", "blocks.1.mlp.dropout")
ATTN = ("attn.0", "attn.1")


# ---------------------------------------------------------------------------------------- seeds


def test_stream_seeds_replicated_over_tp_distinct_elsewhere():
    s = {(d, p, t): tracker_seeds(SEED, d, p, t) for d in range(2) for p in range(2) for t in range(2)}
    for (d, p, t), v in s.items():
        assert v == {"replicated": derive_seed(SEED, "dropout", d, p),
                     "model_parallel": derive_seed(SEED, "dropout", d, p, t)}
        assert v["replicated"] == s[(d, p, 0)]["replicated"]  # the same on every tp rank
    mp = [v["model_parallel"] for v in s.values()]
    rep = {v["replicated"] for v in s.values()}
    assert len(set(mp)) == 8 and len(rep) == 4 and not rep & set(mp)
    plan = seed_plan(SEED, None, 2)
    assert json.loads(json.dumps(plan)) == plan  # archived as JSON
    streams = plan["dropout"]["megatron"]
    assert "dp_rank, pp_rank)" in streams["replicated"] and "tp_rank)" in streams["model_parallel"]


# ---------------------------------------------------------------------------------------- the tracker


def test_fork_draws_its_stream_and_leaves_the_default_generator_alone():
    tracker = rng.dropout_tracker(SEED, 0, 0, 0)
    torch.manual_seed(3)
    a = torch.rand(3)
    with tracker.fork(rng.REPLICATED):
        x1 = torch.rand(4)
    with tracker.fork(rng.MODEL_PARALLEL):
        y = torch.rand(2)
    with tracker.fork(rng.REPLICATED):
        x2 = torch.rand(4)
    b = torch.rand(3)
    torch.manual_seed(3)
    assert torch.equal(torch.cat([a, b]), torch.rand(6))  # the default generator never noticed
    seeds = tracker_seeds(SEED, 0, 0, 0)
    stream = torch.Generator().manual_seed(seeds["replicated"])
    assert torch.equal(torch.cat([x1, x2]), torch.rand(8, generator=stream))  # one stream, continued
    assert torch.equal(y, torch.rand(2, generator=torch.Generator().manual_seed(seeds["model_parallel"])))
    with pytest.raises(KeyError, match="no RNG stream"):
        with tracker.fork("other"):
            pass


def test_fork_swaps_back_when_the_body_raises():
    tracker = rng.dropout_tracker(SEED, 0, 0, 0)
    torch.manual_seed(4)
    before = torch.get_rng_state()
    with pytest.raises(RuntimeError):
        with tracker.fork(rng.REPLICATED):
            torch.rand(5)
            raise RuntimeError("stop")
    assert torch.equal(torch.get_rng_state(), before)
    fresh = torch.Generator().manual_seed(tracker.seeds[rng.REPLICATED])
    torch.rand(5, generator=fresh)
    with tracker.fork(rng.REPLICATED):  # the draws before the exception count
        assert torch.equal(torch.rand(3), torch.rand(3, generator=fresh))


def test_two_tp_ranks_same_replicated_masks_different_model_parallel_masks():
    t0, t1 = rng.dropout_tracker(SEED, 0, 0, 0), rng.dropout_tracker(SEED, 0, 0, 1)
    drop = torch.nn.Dropout(0.5).train()
    x = torch.ones(4, 16)
    m = {name: [rng.dropout(drop, x, t, name) for t in (t0, t1)] for name in (rng.REPLICATED, rng.MODEL_PARALLEL)}
    assert torch.equal(*m[rng.REPLICATED]) and not torch.equal(*m[rng.MODEL_PARALLEL])
    other_dp = rng.dropout_tracker(SEED, 1, 0, 0)
    assert not torch.equal(rng.dropout(drop, x, other_dp, rng.REPLICATED), rng.dropout(drop, x, t0, rng.REPLICATED))


def test_dropout_without_a_draw_does_not_touch_the_streams():
    tracker = rng.dropout_tracker(SEED, 0, 0, 0)
    before = tracker.get_states()
    x = torch.ones(8)
    assert torch.equal(rng.dropout(torch.nn.Dropout(0.3).eval(), x, tracker, rng.REPLICATED), x)
    assert torch.equal(rng.dropout(torch.nn.Dropout(0.0).train(), x, tracker, rng.REPLICATED), x)
    assert all(torch.equal(before[k], v) for k, v in tracker.states.items())
    torch.manual_seed(0)
    a = rng.dropout(torch.nn.Dropout(0.3).train(), x, None, rng.REPLICATED)  # no tracker: the default generator
    torch.manual_seed(0)
    assert torch.equal(a, torch.nn.Dropout(0.3).train()(x))


def test_state_dict_restores_the_streams():
    tracker = rng.dropout_tracker(SEED, 1, 0, 1)
    with tracker.fork(rng.REPLICATED):
        torch.rand(7)
    buf = io.BytesIO()
    torch.save(tracker.state_dict(), buf)  # as the checkpoint writes it
    with tracker.fork(rng.REPLICATED), tracker.fork(rng.MODEL_PARALLEL):
        pass
    want = {}
    for name in (rng.REPLICATED, rng.MODEL_PARALLEL):
        with tracker.fork(name):
            want[name] = torch.rand(5)
    again = rng.dropout_tracker(SEED, 1, 0, 1)  # a restarted rank: freshly seeded, then restored
    buf.seek(0)
    again.load_state_dict(torch.load(buf, weights_only=False))
    for name in (rng.REPLICATED, rng.MODEL_PARALLEL):
        with again.fork(name):
            assert torch.equal(torch.rand(5), want[name])
    with pytest.raises(ValueError, match="not this rank's"):
        rng.dropout_tracker(SEED, 1, 0, 0).load_state_dict(tracker.state_dict())


def test_checkpoint_rng_file_carries_the_tracker():
    tracker = rng.dropout_tracker(SEED, 0, 0, 0)
    with tracker.fork(rng.MODEL_PARALLEL):
        torch.rand(3)
    state = rng_state(tracker)
    with tracker.fork(rng.MODEL_PARALLEL):
        want = torch.rand(4)
        torch.rand(9)
    set_rng_state(state, tracker)
    with tracker.fork(rng.MODEL_PARALLEL):
        assert torch.equal(torch.rand(4), want)
    old = rng_state()  # a checkpoint written without a tracker leaves the streams as they are
    assert "tracker" not in old
    kept = tracker.get_states()
    set_rng_state(old, tracker)
    assert all(torch.equal(kept[k], v) for k, v in tracker.states.items())


# ---------------------------------------------------------------------------------------- in the model


def _stage(tp_size, tp_rank, sp=False, recompute="none", m=None):
    m = OmegaConf.create(m or MODEL)
    with torch.device("meta"):
        full = GPT(m, seed=None)
    tpm.name_parameters(full)
    ctx = tpm.TPContext(group=None, rank=tp_rank, size=tp_size, sequence_parallel=sp)
    stage = GPTStage(full, ctx, 1, 0, recompute, contextlib.nullcontext)
    stage.set_recompute(recompute)
    tpm.materialize(stage, SEED, int(m.num_layers), torch.device("cpu"))
    rng.attach(stage, rng.dropout_tracker(SEED, 0, 0, tp_rank))
    return stage.train()


def _single(recompute="none"):
    model = GPT(OmegaConf.create(MODEL), recompute=recompute, seed=SEED).train()
    rng.attach(model, rng.dropout_tracker(SEED, 0, 0, 0))
    return model


def _tokens():
    return torch.randint(0, MODEL["vocab_size"], (2, MODEL["seq_len"]), generator=torch.Generator().manual_seed(1))


def test_attach_reaches_every_dropout_site():
    stage, model = _stage(1, 0), _single()
    for mod in (stage, model):
        holders = [n for n, sub in mod.named_modules() if hasattr(sub, "rng")]
        assert all(sub.rng is mod.rng for sub in mod.modules() if hasattr(sub, "rng"))
        assert "embedding" in holders and "blocks.1.attn" in holders and "blocks.1.mlp" in holders


def test_recorded_attention_mask_is_the_one_sdpa_applies():
    assert sdpa_mask_is_exact()


def test_tensor_parallel_model_at_tp1_draws_the_single_process_masks():
    """One code path: the sharded model's layers at tp=1 and the single-process GPT, each with a tracker
    of the same rank, draw the same masks everywhere and give the same logits."""
    tokens = _tokens()
    stage, model = _stage(1, 0), _single()
    a = record_masks(stage, lambda: stage(tokens))
    b = record_masks(model, lambda: model(tokens))
    assert sorted(a) == sorted(b) == sorted(RESIDUAL + ATTN)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert all(0.6 < a[k].float().mean() < 0.95 for k in a)  # p = 0.2 drawn, not all kept
    torch.testing.assert_close(_stage(1, 0)(tokens), _single()(tokens), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("build", ["single", "tp1_stage"])
def test_recompute_replays_the_forward_masks(build):
    """Selective and full recomputation draw the forward's masks again (the streams restored for the
    recomputation): the gradients equal the ones without recompute, and the streams end where they
    would without it."""
    tokens = _tokens()
    grads, states = {}, {}
    for mode in ("none", "selective", "full"):
        torch.manual_seed(0)
        if build == "single":
            model = _single(mode)
            loss = model(tokens, labels=tokens)
        else:
            model = _stage(1, 0, recompute=mode)
            loss = torch.nn.functional.cross_entropy(model(tokens).reshape(-1, MODEL["vocab_size"]), tokens.reshape(-1))
        loss.backward()
        grads[mode] = [p.grad.clone() for p in model.parameters()]
        states[mode] = model.rng.get_states()
    for mode in ("selective", "full"):
        for g0, g1 in zip(grads["none"], grads[mode]):
            torch.testing.assert_close(g0, g1, rtol=1e-5, atol=1e-7)
        assert all(torch.equal(states["none"][k], v) for k, v in states[mode].items())


@pytest.fixture
def simulated_collectives(monkeypatch):
    """tp collectives for one simulated rank: the shapes a real group gives (values irrelevant here)."""
    monkeypatch.setattr(tpm, "_all_reduce", lambda x, tp: x.clone())
    monkeypatch.setattr(tpm, "_all_gather_seq", lambda x, tp: torch.cat([x] * tp.size, dim=tpm.SEQ_DIM))
    monkeypatch.setattr(tpm, "_reduce_scatter_seq",
                        lambda x, tp: x.chunk(tp.size, dim=tpm.SEQ_DIM)[tp.rank].contiguous())


@pytest.mark.parametrize("sp", [False, True], ids=["replicated_residual", "sequence_parallel"])
def test_tp2_masks_simulated_in_one_process(simulated_collectives, sp):
    tokens = _tokens()
    ranks = []
    for r in range(2):
        stage = _stage(2, r, sp=sp)
        ranks.append(record_masks(stage, lambda stage=stage: stage(tokens)))
    model = _single()
    single = record_masks(model, lambda: model(tokens))
    b, s, h, heads = 2, MODEL["seq_len"], MODEL["hidden_size"], MODEL["num_heads"]
    for k in ATTN:  # this rank's heads: its own masks, not the single process's for those heads
        assert ranks[0][k].shape == ranks[1][k].shape == (b, heads // 2, s, s)
        assert not torch.equal(ranks[0][k], ranks[1][k])
        assert not torch.equal(torch.cat([ranks[0][k], ranks[1][k]], dim=1), single[k])
    for k in RESIDUAL:
        if sp:  # this rank's sequence chunk: drawn per rank
            assert ranks[0][k].shape == ranks[1][k].shape == (b, s // 2, h)
            assert not torch.equal(ranks[0][k], ranks[1][k])
            assert not torch.equal(torch.cat([ranks[0][k], ranks[1][k]], dim=1), single[k])
        else:  # replicated: the same on both ranks, and the single process's (same seed, dp and pp rank)
            assert ranks[0][k].shape == (b, s, h)
            assert torch.equal(ranks[0][k], ranks[1][k]) and torch.equal(ranks[0][k], single[k]), k


# ---------------------------------------------------------------------------------------- layout and GPU


def _cfg(*overrides):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=normalize_overrides(list(overrides)))


@pytest.mark.parametrize("extra", [[], ["parallelism.sequence_parallel=true"]])
@pytest.mark.usefixtures("cpu_host")  # its premise: local processes on the CPU
def test_layout_accepts_dropout_with_tensor_parallelism(extra):
    errors = rules.problems(_cfg("parallelism=tp", "model.dropout=0.1", *extra))
    assert not errors, [str(e) for e in errors]
    assert "model.dropout" in [e.key for e in rules.problems(_cfg("parallelism=tp", "model.dropout=1.5"))]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_streams():
    dev = torch.device("cuda", 0)
    t0, t1 = rng.dropout_tracker(SEED, 0, 0, 0, dev), rng.dropout_tracker(SEED, 0, 0, 1, dev)
    torch.cuda.manual_seed(5)
    before = torch.cuda.get_rng_state(dev)
    cpu_before = torch.get_rng_state()
    drop = torch.nn.Dropout(0.5).train()
    x = torch.ones(64, 64, device=dev)
    rep = [rng.dropout(drop, x, t, rng.REPLICATED) for t in (t0, t1)]
    mp = [rng.dropout(drop, x, t, rng.MODEL_PARALLEL) for t in (t0, t1)]
    assert torch.equal(*rep) and not torch.equal(*mp)
    assert torch.equal(torch.cuda.get_rng_state(dev), before) and torch.equal(torch.get_rng_state(), cpu_before)
    q, k, v = (torch.randn(2, 4, 32, 16, device=dev, dtype=torch.bfloat16) for _ in range(3))
    saved = t0.state_dict()
    with t0.fork(rng.MODEL_PARALLEL):
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=0.3, is_causal=True)
    t0.load_state_dict(saved)
    with t0.fork(rng.MODEL_PARALLEL):
        b = torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=0.3, is_causal=True)
    with t0.fork(rng.MODEL_PARALLEL):
        c = torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=0.3, is_causal=True)
    assert torch.equal(a, b) and not torch.equal(b, c)
    assert torch.equal(torch.cuda.get_rng_state(dev), before)
