"""The dataset format (launcher/data/manifest.py): written, loaded, verified; damage named by file."""
from __future__ import annotations

import json

import numpy as np
import pytest

from launcher.data.manifest import (
    FORMAT,
    DatasetError,
    Input,
    Manifest,
    Prepare,
    check_destination,
    verify,
    write_dataset,
)

DOCS = {"train": [[5, 6, 7], [8], [], [9, 10]], "val": [[11, 12]]}


def _write(out, docs=DOCS, **kw):
    kw.setdefault("vocab_size", 100)
    kw.setdefault("eos_id", 0)
    return write_dataset(out, docs, tokenizer_json='{"model": {}}', **kw)


def test_round_trip(tmp_path):
    out = tmp_path / "ds"
    m = _write(out, inputs=[Input("/x.txt", 3, "ab" * 32, "text", 1)], val_fraction=0.1,
               prepare=Prepare(1.5, 10.0, 2))
    loaded = Manifest.load(out)
    assert loaded == m
    assert list(json.loads((out / "manifest.json").read_text()))[0] == "format"
    assert (loaded.format, loaded.vocab_size, loaded.eos_id, loaded.dtype) == (FORMAT, 100, 0, "uint16")
    train = loaded.split("train")
    # the empty document is skipped; each document is followed by the EOS id
    assert (train.documents, train.tokens, train.longest_document) == (3, (3 + 1) + (1 + 1) + (2 + 1), 4)
    (shard,) = train.shards
    assert shard.bin == f"shards/train-{shard.bin_sha256[:16]}.bin"
    ids = np.fromfile(out / shard.bin, dtype="<u2")
    assert ids.tolist() == [5, 6, 7, 0, 8, 0, 9, 10, 0]
    assert np.fromfile(out / shard.idx, dtype="<i8").tolist() == [0, 4, 6, 9]
    assert loaded.split("val").tokens == 3
    assert verify(out) == []
    assert verify(out, hashes=False) == []
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())  # nothing left aside


def test_shards_close_at_document_boundaries(tmp_path):
    docs = {"train": [[1] * 3, [2] * 3, [3] * 9, [4]]}
    m = _write(tmp_path / "ds", docs, shard_tokens=8)
    # 4+4 fill the first; the 10-token document takes a shard alone; the last starts a new one
    assert [s.tokens for s in m.split("train").shards] == [8, 10, 2]
    assert m.split("val").documents == 0 and m.split("val").shards == ()
    assert verify(tmp_path / "ds") == []


def test_uint32_for_a_large_vocabulary(tmp_path):
    m = _write(tmp_path / "ds", {"train": [[70000, 1]]}, vocab_size=70001)
    assert m.dtype == "uint32"
    assert np.fromfile(tmp_path / "ds" / m.split("train").shards[0].bin, dtype="<u4").tolist() == [70000, 1, 0]


def test_a_token_outside_the_vocabulary_is_refused_and_nothing_is_left(tmp_path):
    with pytest.raises(DatasetError, match="outside the vocabulary"):
        _write(tmp_path / "ds", {"train": [[1, 100]]})
    assert list(tmp_path.iterdir()) == []


def test_flipped_byte_truncated_and_missing_shard_each_named(tmp_path):
    out = tmp_path / "ds"
    m = _write(out)
    train, val = m.split("train").shards[0], m.split("val").shards[0]
    data = bytearray((out / train.bin).read_bytes())
    data[1] ^= 0x01
    (out / train.bin).write_bytes(bytes(data))
    (out / val.idx).write_bytes((out / val.idx).read_bytes()[:-3])
    (out / val.bin).unlink()
    problems = verify(out)
    assert len(problems) == 3, problems
    assert f"{out / train.bin}: sha256" in problems[0] and "differs" in problems[0]
    assert any(p.startswith(f"{out / val.bin}: missing") for p in problems)
    assert any(p.startswith(f"{out / val.idx}: size") for p in problems)
    # sizes only: the flipped byte is not seen, the others are
    assert len(verify(out, hashes=False)) == 2


def test_altered_tokenizer_named(tmp_path):
    out = tmp_path / "ds"
    _write(out)
    (out / "tokenizer.json").write_text('{"model": {"x": 1}}')
    (problem,) = verify(out)
    assert problem.startswith(f"{out / 'tokenizer.json'}: sha256")


@pytest.mark.parametrize("edit, key", [
    (lambda d: d.pop("dtype"), "'dtype' missing"),
    (lambda d: d["tokenizer"].update(vocab_size="many"), "'tokenizer.vocab_size' is 'many'"),
    (lambda d: d["splits"]["train"]["shards"][0].pop("bin_sha256"), "'splits.train.shards[0].bin_sha256' missing"),
    (lambda d: d["splits"]["train"].update(tokens=1), "'splits.train.tokens' is 1"),
    (lambda d: d["tokenizer"].update(eos_id=100), "'tokenizer.eos_id' is 100"),
    (lambda d: d.update(format="other/9"), "format 'other/9'"),
    (lambda d: d["splits"]["val"]["shards"][0].update(bin="../../etc/passwd"),
     "'splits.val.shards[0].bin' is '../../etc/passwd', not a path inside the dataset directory"),
])
def test_bad_manifest_names_the_file_and_the_key(tmp_path, edit, key):
    out = tmp_path / "ds"
    _write(out)
    data = json.loads((out / "manifest.json").read_text())
    edit(data)
    (out / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(DatasetError) as e:
        Manifest.load(out)
    assert str(e.value).startswith(f"{out / 'manifest.json'}: ") and key in str(e.value)
    (line,) = verify(out)
    assert key in line


def test_not_a_dataset(tmp_path):
    with pytest.raises(DatasetError, match="not a prepared dataset"):
        Manifest.load(tmp_path)
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(DatasetError, match="manifest.json: not readable as JSON"):
        Manifest.load(tmp_path)
    with pytest.raises(DatasetError, match="no such dataset directory"):
        Manifest.load(tmp_path / "nowhere")
    with pytest.raises(DatasetError, match="no split 'test'"):
        _write(tmp_path / "ds").split("test")


def test_destination_rules(tmp_path):
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(DatasetError, match="not a prepared dataset; give a new or empty directory"):
        _write(tmp_path / "other")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other"]  # nothing written aside either
    (tmp_path / "f").write_text("")
    with pytest.raises(DatasetError, match="is a file"):
        check_destination(tmp_path / "f")
    (tmp_path / "empty").mkdir()
    _write(tmp_path / "empty")
    assert verify(tmp_path / "empty") == []


def test_rewriting_a_dataset_replaces_it_whole(tmp_path):
    out = tmp_path / "ds"
    first = _write(out)
    second = _write(out, {"train": [[42, 43]]})
    assert Manifest.load(out) == second
    old = {sh.bin for s in first.splits.values() for sh in s.shards}
    assert not any((out / b).exists() for b in old)  # none of the old shards remains
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds"]
    assert verify(out) == []
