"""A split's token counts and unigram entropy (launcher/data/stats.py), from the shards on disk, and
`launcher data show` printing it per split."""
from __future__ import annotations

import math

import numpy as np
import pytest

from launcher.data.manifest import write_dataset
from launcher.data.stats import entropy, token_counts, unigram_entropy


def test_counts_and_entropy_of_a_known_distribution(tmp_path):
    # train: ids 1..3 with counts 4, 2, 1 per document and one EOS (0) each, in 3 documents over
    # several shards (shard_tokens=8): counts 0:3, 1:12, 2:6, 3:3 of 24 tokens
    doc = [1, 1, 2, 1, 3, 2, 1]
    m = write_dataset(tmp_path / "ds", {"train": [doc] * 3, "val": [[5, 5, 5]]}, vocab_size=10, eos_id=0,
                      shard_tokens=8)
    assert len(m.split("train").shards) == 3
    assert token_counts(m).tolist() == [3, 12, 6, 3, 0, 0, 0, 0, 0, 0]
    p = np.array([3, 12, 6, 3]) / 24
    assert unigram_entropy(tmp_path / "ds") == pytest.approx(float(-(p * np.log(p)).sum()), rel=1e-12)
    # val: 5 5 5 EOS
    assert token_counts(m, "val").tolist() == [1, 0, 0, 0, 0, 3, 0, 0, 0, 0]
    assert unigram_entropy(m, "val") == pytest.approx(-(0.25 * math.log(0.25) + 0.75 * math.log(0.75)))


def test_uniform_is_log_vocab_and_a_constant_is_zero(tmp_path):
    # every id of a 65536+ vocabulary (uint32 shards) once, EOS ending the one document: uniform
    vocab = 70_000
    m = write_dataset(tmp_path / "u", {"train": [list(range(1, vocab))]}, vocab_size=vocab, eos_id=0)
    assert m.dtype == "uint32"
    assert unigram_entropy(m) == pytest.approx(math.log(vocab), rel=1e-12)
    assert entropy(np.array([0, 7, 0])) == 0.0
    assert entropy(np.zeros(4)) is None


def test_a_split_without_tokens_has_none(tmp_path):
    m = write_dataset(tmp_path / "ds", {"train": [[1, 2]], "val": []}, vocab_size=4, eos_id=0)
    assert token_counts(m, "val").tolist() == [0, 0, 0, 0]
    assert unigram_entropy(m, "val") is None


def test_show_prints_each_splits_entropy(tmp_path, capsys):
    from launcher.cli.main import main

    ds = tmp_path / "ds"
    write_dataset(ds, {"train": [[1, 2, 3]] * 2, "val": []}, vocab_size=8, eos_id=0)
    assert main(["data", "show", str(ds)]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.split()[:1] == ["split"])
    assert header.split()[-1] == "entropy"
    train = next(line for line in out.splitlines() if line.split()[:1] == ["train"])
    val = next(line for line in out.splitlines() if line.split()[:1] == ["val"])
    assert train.split()[-1] == f"{math.log(4):.3f}" and val.split()[-1] == "-"
    assert "nats per token" in out

    (shard,) = [p for p in (ds / "shards").iterdir() if p.suffix == ".bin"]
    shard.unlink()
    assert main(["data", "show", str(ds)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"launcher data show: {ds}: a train shard cannot be read") and "verify" in err
