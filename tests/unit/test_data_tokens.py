"""launcher.data.tokens and recipes.common.data on prepared datasets (built with manifest.write_dataset in
tmp_path): packing, one document per sample, blends by weight, epochs, sample i a pure function of
(seed, i) whatever the layout, the val split and its evaluation batches, and the sample log's rewind."""
import json
import math
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from launcher.config.layout import Layout
from launcher.config.seeding import data_seed
from launcher.data.manifest import DatasetError, write_dataset
from launcher.data.tokens import Source, TokenDataset, Windows, permute
from launcher.run.rundir import RunDir
from recipes.common.data import SampleLog, eval_batches, micro_batch_indices, train_batches, transition_table

EOS = 0


def docs(n, lo, hi, seed=0, vocab=100):
    """``n`` documents of random lengths in [lo, hi) with tokens in [1, vocab) (no EOS inside)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(1, vocab, size=int(rng.integers(lo, hi))).tolist() for _ in range(n)]


@pytest.fixture
def dataset(tmp_path):
    """A dataset whose train split spans several shards (small shard_tokens) and a val split."""
    d = tmp_path / "a"
    write_dataset(d, {"train": docs(40, 3, 60), "val": docs(6, 20, 40, seed=1)}, vocab_size=100, eos_id=EOS,
                  shard_tokens=128)
    return d


def stream(d, split="train"):
    """The split's tokens as one array, read without the loader (the reference)."""
    from launcher.data.manifest import Manifest

    m = Manifest.load(d)
    return np.concatenate([np.fromfile(d / s.bin, dtype=m.dtype) for s in m.split(split).shards])


def layout(dp, mb, gbs):
    return Layout(dp=dp, micro_batch_size=mb, grad_accum=gbs // (dp * mb))


def cfg_for(path, **data):
    return OmegaConf.create({"seed": 7, "data": {"name": "tokens", "seed": None, "path": str(path), "blend": [],
                                                 "packing": True, "eval_every": 0, "eval_batches": 2,
                                                 "log_samples": False, "branching": 4, **data}})


# ---- windows -------------------------------------------------------------------------------------

def test_packing_cuts_the_stream_into_windows_that_share_one_token(dataset):
    s = stream(dataset)
    w = Windows(dataset, seq_len=16)
    assert len(Windows(dataset, seq_len=16).manifest.split("train").shards) > 2  # windows cross shard ends
    assert len(w) == (len(s) - 1) // 16
    for k in range(len(w)):
        assert w.window(k).tolist() == s[k * 16:k * 16 + 17].tolist()
    with pytest.raises(IndexError):
        w.window(len(w))


def test_no_packing_one_document_per_sample_short_ones_skipped_long_ones_cut(tmp_path):
    d = tmp_path / "d"
    documents = [[1, 2], [3, 4, 5, 6, 7, 8], [9] * 4, list(range(10, 30))]
    write_dataset(d, {"train": documents}, vocab_size=64, eos_id=EOS, shard_tokens=8)
    w = Windows(d, seq_len=4, packing=False)  # windows of 5 tokens: a document of >= 5 tokens with its EOS
    assert [w.window(k).tolist() for k in range(len(w))] == [[3, 4, 5, 6, 7], [9, 9, 9, 9, EOS], [10, 11, 12, 13, 14]]
    with pytest.raises(DatasetError, match="no document has seq_len"):
        TokenDataset([d], seq_len=30, packing=False)


def test_labels_are_the_tokens_shifted_by_one(dataset):
    ds = TokenDataset([dataset], seq_len=16, seed=3)
    tokens, labels = ds.batch([0, 5, 9])
    assert tokens.dtype == torch.long and tokens.shape == labels.shape == (3, 16)
    for row, i in enumerate([0, 5, 9]):
        win = ds.tokens(i)
        assert tokens[row].tolist() == win[:-1].tolist() and labels[row].tolist() == win[1:].tolist()


# ---- epochs --------------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 2, 3, 5, 17, 64, 1000, 4097])
def test_permute_is_a_bijection_that_depends_on_the_key(n):
    p = permute(np.arange(n), n, key=11)
    assert sorted(p.tolist()) == list(range(n))
    if n >= 17:
        assert p.tolist() != list(range(n)) and p.tolist() != permute(np.arange(n), n, key=12).tolist()


def test_every_epoch_is_a_permutation_of_the_windows_and_epochs_differ(dataset):
    ds = TokenDataset([dataset], seq_len=16, seed=3)
    n = len(ds.windows[0])
    d, e, w = ds.ids(range(3 * n))
    assert set(d.tolist()) == {0} and e.tolist() == [k // n for k in range(3 * n)]
    epochs = [w[k * n:(k + 1) * n].tolist() for k in range(3)]
    assert all(sorted(x) == list(range(n)) for x in epochs)
    assert epochs[0] != epochs[1] != epochs[2]
    assert ds.sample_ids(n + 2) == (0, 1, epochs[1][2])


# ---- blends --------------------------------------------------------------------------------------

def test_blend_weights_are_honoured_to_one_sample_at_every_block(tmp_path):
    paths = []
    for k, n in enumerate([30, 5, 12]):
        paths.append(tmp_path / f"d{k}")
        write_dataset(paths[-1], {"train": docs(n, 10, 40, seed=k)}, vocab_size=100, eos_id=EOS)
    weights = [5.0, 1.0, 2.5]
    ds = TokenDataset([Source(str(p), w) for p, w in zip(paths, weights)], seq_len=8, seed=1, block=256)
    d, e, _ = ds.ids(range(256 * 40))
    for b in range(1, 41):
        counts = np.bincount(d[:b * 256], minlength=3)
        assert np.all(np.abs(counts - b * 256 * np.array(weights) / sum(weights)) < 1), (b, counts)
    assert e.max() > 0  # the small dataset wrapped into later epochs; each of its epochs a permutation
    small = [w for dd, w in zip(d.tolist(), ds.ids(range(256 * 40))[2].tolist()) if dd == 1]
    n1 = len(ds.windows[1])
    assert sorted(small[:n1]) == list(range(n1))


def test_a_datasets_kth_sample_is_the_same_whatever_else_is_blended(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    write_dataset(a, {"train": docs(20, 10, 40)}, vocab_size=100, eos_id=EOS)
    write_dataset(b, {"train": docs(20, 10, 40, seed=5)}, vocab_size=100, eos_id=EOS)
    blend = TokenDataset([Source(str(a), 1), Source(str(b), 3)], seq_len=8, seed=2, block=64)
    d, e, w = blend.ids(range(2000))
    d_, e_, w_ = blend.ids(list(range(1999, -1, -1)))  # any order, any batch: the same answer
    assert (d_[::-1] == d).all() and (w_[::-1] == w).all()
    one = Counter(d.tolist())
    assert one[0] + one[1] == 2000 and abs(one[1] - 1500) <= 1


def test_a_weight_that_is_not_positive_is_refused(dataset):
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(DatasetError, match="weight"):
            TokenDataset([Source(str(dataset), 1.0), Source(str(dataset), bad)], seq_len=8)


def test_a_weight_too_small_for_the_block_is_refused(dataset):
    with pytest.raises(DatasetError, match="at least 1/"):
        TokenDataset([Source(str(dataset), 1.0), Source(str(dataset), 1e-6)], seq_len=8, block=4096)


# ---- purity: the layout does not change which samples a step sees ------------------------------------

@pytest.mark.parametrize("dp,mb", [(1, 8), (2, 4), (2, 1), (4, 2), (8, 1)])
def test_the_samples_of_a_step_do_not_depend_on_dp_or_micro_batch(dataset, dp, mb):
    cfg = cfg_for(dataset)
    ref = train_batches(cfg, layout(1, 16, 16), 0, seq_len=16, vocab_size=100)
    lay = layout(dp, mb, 16)
    for step in (1, 2, 9):
        ids = [x for r in range(dp) for x in train_batches(cfg, lay, r, seq_len=16, vocab_size=100).sample_ids(step)]
        assert ids == ref.sample_ids(step)
        got = torch.cat([t for r in range(dp) for t, _ in train_batches(cfg, lay, r, seq_len=16, vocab_size=100)(step)])
        assert torch.equal(got, ref(step)[0][0])


def test_the_data_seed_changes_the_order(dataset):
    a = train_batches(cfg_for(dataset), layout(1, 8, 8), 0, seq_len=16, vocab_size=100)
    b = train_batches(cfg_for(dataset, seed=99), layout(1, 8, 8), 0, seq_len=16, vocab_size=100)
    assert a.sample_ids(1) != b.sample_ids(1)


def test_a_vocabulary_larger_than_the_model_is_refused(dataset):
    with pytest.raises(ValueError, match="model.vocab_size"):
        train_batches(cfg_for(dataset), layout(1, 8, 8), 0, seq_len=16, vocab_size=50)


def test_a_blend_in_the_config_replaces_the_path(tmp_path, dataset):
    b = tmp_path / "b"
    write_dataset(b, {"train": docs(20, 10, 40, seed=3)}, vocab_size=100, eos_id=EOS)
    cfg = cfg_for(dataset, blend=[{"path": str(dataset), "weight": 1.0}, {"path": str(b), "weight": 1.0}])
    ids = train_batches(cfg, layout(1, 8, 64), 0, seq_len=16, vocab_size=100).sample_ids(1)
    assert {d for d, _, _ in ids} == {0, 1}


# ---- the val split and evaluation --------------------------------------------------------------------

def test_val_split_reads_the_val_shards(dataset):
    val = TokenDataset([dataset], seq_len=8, split="val", seed=1)
    s = stream(dataset, "val")
    assert len(val.windows[0]) == (len(s) - 1) // 8
    sid = val.sample_ids(0)
    assert val.tokens(0).tolist() == s[sid.window * 8:sid.window * 8 + 9].tolist()


def test_eval_batches_are_fixed_and_split_over_dp_like_steps(dataset):
    cfg = cfg_for(dataset)  # eval_batches=2: two global batches of 8
    one = eval_batches(cfg, layout(1, 4, 8), 0, seq_len=8, vocab_size=100)
    assert len(one) == 4 and one[0][0].shape == (4, 8)
    whole = torch.cat([t for t, _ in one])
    assert torch.equal(torch.cat([t for t, _ in eval_batches(cfg, layout(1, 4, 8), 0, seq_len=8, vocab_size=100)]),
                       whole)  # the same samples at every evaluation
    for dp, mb in ((2, 2), (4, 1)):
        lay = layout(dp, mb, 8)
        parts = [eval_batches(cfg, lay, r, seq_len=8, vocab_size=100) for r in range(dp)]
        # eval batch b: rank by rank, as a training step's samples
        got = torch.cat([t for b in range(2) for r in range(dp)
                         for t, _ in parts[r][b * lay.grad_accum:(b + 1) * lay.grad_accum]])
        assert torch.equal(got, whole)
    train = train_batches(cfg, layout(1, 4, 8), 0, seq_len=8, vocab_size=100)(1)
    assert not torch.equal(train[0][0], one[0][0])


def test_a_dataset_without_val_documents_cannot_be_evaluated(tmp_path):
    d = tmp_path / "noval"
    write_dataset(d, {"train": docs(5, 10, 40)}, vocab_size=100, eos_id=EOS)
    with pytest.raises(DatasetError, match="val split has no sample"):
        eval_batches(cfg_for(d), layout(1, 4, 8), 0, seq_len=8, vocab_size=100)


def test_synthetic_data_has_a_val_split_too():
    cfg = OmegaConf.create({"seed": 7, "data": {"name": "synthetic", "seed": None, "branching": 4,
                                                "eval_batches": 1}})
    val = eval_batches(cfg, layout(1, 4, 8), 0, seq_len=8, vocab_size=32)
    train = train_batches(cfg, layout(1, 4, 8), 0, seq_len=8, vocab_size=32)(1)
    assert len(val) == 2 and not torch.equal(val[0][0], train[0][0])
    table = transition_table(data_seed(7, None), 32, 4)  # the same language: every step a successor
    tokens, labels = val[0]
    assert all(int(b) in table[int(a)].tolist() for a, b in zip(tokens.reshape(-1), labels.reshape(-1)))


def test_micro_batch_arithmetic_is_the_synthetic_datas(dataset):
    lay = layout(2, 2, 8)
    ids = train_batches(cfg_for(dataset), lay, 1, seq_len=8, vocab_size=100)
    ds = TokenDataset([dataset], seq_len=8, seed=data_seed(7, None))
    flat = [i for g in micro_batch_indices(2, lay, 1) for i in g]
    assert ids.sample_ids(3) == [list(ds.sample_ids(i)) for i in flat]


# ---- the sample log ----------------------------------------------------------------------------------

def test_sample_log_writes_a_line_per_step_and_rewinds_on_resume(tmp_path):
    rd = RunDir(tmp_path / "run")
    ctx = SimpleNamespace(rundir=rd, rank=1)
    log = SampleLog(ctx, start=0, enabled=True)
    for step in range(1, 6):
        log.write(step, lambda s: [[0, 0, s * 10]])
    path = tmp_path / "run" / "samples" / "rank_1.jsonl"
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [1, 2, 3, 4, 5]
    log = SampleLog(ctx, start=3, enabled=True)  # resumed after step 3: 4 and 5 are redone
    log.write(4, lambda s: [[0, 0, 99]])
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and rows[-1]["samples"] == [[0, 0, 99]]
    SampleLog(SimpleNamespace(rundir=rd, rank=0), start=0, enabled=False).write(1, lambda s: [[0]])
    assert not (tmp_path / "run" / "samples" / "rank_0.jsonl").exists()


# ---- the GPT loop on a prepared dataset (one process, in this process) ---------------------------------

@pytest.mark.timeout(120)
def test_gpt_trains_on_tokens_and_evaluating_leaves_training_unchanged(tmp_path):
    from test_gpt_recipe import make_cfg, read_metrics, run_single

    d = tmp_path / "ds"
    write_dataset(d, {"train": docs(30, 10, 80, vocab=64), "val": docs(4, 20, 40, seed=2, vocab=64)},
                  vocab_size=64, eos_id=EOS)
    data = {"name": "tokens", "path": str(d), "log_samples": True}

    def cfg(every):  # dropout on: an evaluation that drew from the RNG streams would change the losses
        return make_cfg(model={"dropout": 0.1}, data={**data, "eval_every": every}, train={"steps": 5})

    summary = run_single(cfg(2), tmp_path / "eval")
    run_single(cfg(0), tmp_path / "plain")
    rows, plain = read_metrics(tmp_path / "eval"), read_metrics(tmp_path / "plain")
    assert [r["loss"] for r in rows] == [r["loss"] for r in plain]
    assert [r["step"] for r in rows if "eval_loss" in r] == [2, 4, 5] and not any("eval_loss" in r for r in plain)
    assert summary["final_eval_loss"] == rows[-1]["eval_loss"] and math.isfinite(rows[-1]["eval_loss"])
    logged = [json.loads(x) for x in (tmp_path / "eval" / "samples" / "rank_0.jsonl").read_text().splitlines()]
    expected = train_batches(cfg(2), layout(1, 2, 8), 0, seq_len=16, vocab_size=64)
    assert [x["samples"] for x in logged] == [expected.sample_ids(s) for s in range(1, 6)]
