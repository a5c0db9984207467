"""`launcher data prepare` as a function (launcher/data/prepare.py): tiny inputs, one worker (in this
process), a small trained vocabulary; every bad input refused before anything is written."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from launcher.data.manifest import DatasetError, Manifest, verify
from launcher.data.prepare import is_val, prepare

TEXTS = ["The quick brown fox jumps over the lazy dog.\n" * 3,
         "def f(x):\n    return x * 2\n",
         "Lorem ipsum dolor sit amet, consectetur adipiscing elit.\n"]


def _corpus(tmp_path: Path) -> list:
    files = []
    for i, t in enumerate(TEXTS):
        f = tmp_path / "in" / f"doc{i}.txt"
        f.parent.mkdir(exist_ok=True)
        f.write_text(t)
        files.append(f)
    return files


def _run(files, out, **kw):
    kw.setdefault("vocab_size", 300)
    return prepare(files, out, workers=1, progress=False, **kw)


def _decoded(m: Manifest, split: str = "train") -> list:
    """The split's documents, decoded with the dataset's own tokenizer (EOS dropped)."""
    tok = Tokenizer.from_file(str(m.dir / m.tokenizer.file))
    docs = []
    for sh in m.split(split).shards:
        ids = np.fromfile(m.dir / sh.bin, dtype=m.dtype)
        starts = np.fromfile(m.dir / sh.idx, dtype="<i8")
        for a, b in zip(starts[:-1], starts[1:]):
            assert ids[b - 1] == m.eos_id
            docs.append(tok.decode(ids[a:b - 1].tolist()))
    return docs


def test_trained_tokenizer_round_trip(tmp_path):
    m = _run(_corpus(tmp_path), tmp_path / "ds", val_fraction=0.0)
    assert m.tokenizer.kind == "byte-level-bpe" and m.tokenizer.source is None
    assert 257 <= m.vocab_size <= 300 and m.dtype == "uint16"
    assert Tokenizer.from_file(str(m.dir / "tokenizer.json")).id_to_token(m.eos_id) == "<|endoftext|>"
    assert _decoded(m) == TEXTS  # every byte back, in input order
    assert [i.documents for i in m.inputs] == [1, 1, 1] and m.inputs[0].format == "text"
    assert m.inputs[0].size == len(TEXTS[0]) and m.inputs[0].path == str(tmp_path / "in" / "doc0.txt")
    assert m.split("train").documents == 3 and m.split("val").documents == 0
    assert m.prepare.workers == 1 and m.prepare.tokens_per_s > 0
    assert Manifest.load(tmp_path / "ds") == m and verify(tmp_path / "ds") == []


def test_jsonl_documents_and_text_field(tmp_path):
    f = tmp_path / "rows.jsonl"
    f.write_text(json.dumps({"body": "first row", "id": 1}) + "\n\n" + json.dumps({"body": ""}) + "\n"
                 + json.dumps({"body": "second row"}) + "\n")
    m = _run([f], tmp_path / "ds", text_field="body", val_fraction=0.0)
    assert _decoded(m) == ["first row", "second row"]  # the blank line and the empty text skipped
    assert (m.inputs[0].format, m.inputs[0].documents, m.text_field) == ("jsonl", 2, "body")


def test_given_tokenizer_is_copied_and_used(tmp_path):
    first = _run(_corpus(tmp_path), tmp_path / "a", val_fraction=0.0)
    m = prepare(_corpus(tmp_path), tmp_path / "b", tokenizer=str(first.dir / "tokenizer.json"), workers=1,
                progress=False, val_fraction=0.0)
    assert (m.tokenizer.kind, m.tokenizer.source) == ("file", str(first.dir / "tokenizer.json"))
    assert (m.dir / "tokenizer.json").read_bytes() == (first.dir / "tokenizer.json").read_bytes()
    assert m.split("train").shards == first.split("train").shards  # same tokens, same content-hashed shards


def test_val_split_is_a_pure_function_of_the_document(tmp_path):
    docs = [f"document number {i}\n" for i in range(200)]
    (tmp_path / "in").mkdir()
    for i, d in enumerate(docs):
        (tmp_path / "in" / f"{i:03}.txt").write_text(d)
    m = _run([tmp_path / "in"], tmp_path / "ds", glob="*.txt", val_fraction=0.25)
    val = set(_decoded(m, "val"))
    assert val == {d for d in docs if is_val(d, 0.25)}
    assert 25 < len(val) < 75  # about a quarter
    assert set(_decoded(m, "train")) == set(docs) - val
    # the same documents among others, in another order: each lands in the same split
    for i, d in enumerate(reversed(docs[:50])):
        (tmp_path / "in" / f"{i:03}.txt").write_text(d)
    (tmp_path / "in" / "extra.txt").write_text("something else entirely\n")
    m2 = _run([tmp_path / "in"], tmp_path / "ds2", glob="*.txt", val_fraction=0.25)
    assert set(_decoded(m2, "val")) - {"something else entirely\n"} == val
    assert is_val("x", 0.0) is False and is_val("x", 0.9999999) is True


def test_directories_expanded_by_glob_empty_files_skipped(tmp_path, capsys):
    (tmp_path / "src" / "pkg").mkdir(parents=True)
    (tmp_path / "src" / "pkg" / "__init__.py").write_text("")
    (tmp_path / "src" / "pkg" / "mod.py").write_text("x = 1\n")
    (tmp_path / "src" / "notes.txt").write_text("notes\n")
    (tmp_path / "src" / "b.py").write_bytes(b"s = '\xff'\n")  # not UTF-8
    m = _run([tmp_path / "src"], tmp_path / "ds", glob=["*.py", "*.txt"], val_fraction=0.0)
    assert [Path(i.path).name for i in m.inputs] == ["b.py", "notes.txt", "mod.py"]
    err = capsys.readouterr().err
    assert "skipped 1 empty file(s)" in err and "1 file(s) hold bytes that are not UTF-8" in err
    assert _decoded(m)[0] == "s = '\ufffd'\n"


def test_a_file_given_twice_is_read_once(tmp_path):
    files = _corpus(tmp_path)
    m = _run([files[0], tmp_path / "in", files[0]], tmp_path / "ds", glob="*.txt", val_fraction=0.0)
    assert [Path(i.path).name for i in m.inputs] == ["doc0.txt", "doc1.txt", "doc2.txt"]
    assert _decoded(prepare(str(files[1]), tmp_path / "one", workers=1, progress=False, vocab_size=300,
                            val_fraction=0.0)) == [TEXTS[1]]  # one path, not a list


def test_shards_split_by_shard_tokens(tmp_path):
    m = _run(_corpus(tmp_path), tmp_path / "ds", val_fraction=0.0, shard_tokens=20)
    assert len(m.split("train").shards) >= 2
    assert _decoded(m) == TEXTS and verify(m.dir) == []


def test_rerun_replaces_the_dataset_whole(tmp_path):
    files = _corpus(tmp_path)
    _run(files, tmp_path / "ds", val_fraction=0.0)
    m = _run(files[:1], tmp_path / "ds", val_fraction=0.0)
    assert _decoded(Manifest.load(tmp_path / "ds")) == TEXTS[:1]
    assert sorted(p.name for p in (tmp_path / "ds" / "shards").iterdir()) == sorted(
        Path(p).name for sh in m.split("train").shards for p in (sh.bin, sh.idx))


def _jsonl(tmp_path, text):
    f = tmp_path / "bad.jsonl"
    f.write_text(text)
    return f


def _bad(tmp_path, name):
    """(inputs, options, what the error says) of each bad input."""
    good = tmp_path / "good.txt"
    good.write_text("fine text\n")
    (tmp_path / "adir").mkdir(exist_ok=True)
    (tmp_path / "notjson.json").write_text("{nope")
    (tmp_path / "plain.json").write_text('{"a": 1}')
    cases = {
        "empty": lambda: ([tmp_path / "e.txt"], {}, f"{tmp_path / 'e.txt'}: empty (no text)"),
        "blank": lambda: ([tmp_path / "b.txt"], {}, f"{tmp_path / 'b.txt'}: empty (no text)"),
        "missing": lambda: ([tmp_path / "nope.txt"], {}, f"{tmp_path / 'nope.txt'}: no such file"),
        "directory": lambda: ([tmp_path / "adir"], {}, "is a directory; give --glob PATTERN"),
        "glob matches nothing": lambda: ([tmp_path / "adir"], {"glob": "*.md"}, "no file under it matches --glob"),
        "jsonl not json": lambda: ([_jsonl(tmp_path, '{"text": "a"}\n{oops\n')], {},
                                   f"{tmp_path / 'bad.jsonl'}:2: not JSON"),
        "jsonl no field": lambda: ([_jsonl(tmp_path, '{"text": "a"}\n\n{"body": "b"}\n')], {},
                                   f"{tmp_path / 'bad.jsonl'}:3: no 'text' field (it has 'body'); "
                                   "name the field with --text-field KEY"),
        "jsonl not text": lambda: ([_jsonl(tmp_path, '{"text": 5}\n')], {},
                                   f"{tmp_path / 'bad.jsonl'}:1: 'text' is int"),
        "jsonl no documents": lambda: ([_jsonl(tmp_path, '{"text": ""}\n')], {},
                                       "empty (no line with a non-empty 'text')"),
        "tokenizer missing": lambda: ([good], {"tokenizer": str(tmp_path / "tok.json"), "vocab_size": None},
                                      f"--tokenizer {tmp_path / 'tok.json'}: no such file"),
        "tokenizer not json": lambda: ([good], {"tokenizer": str(tmp_path / "notjson.json"), "vocab_size": None},
                                       "not a Hugging Face tokenizer JSON"),
        "tokenizer other json": lambda: ([good], {"tokenizer": str(tmp_path / "plain.json"), "vocab_size": None},
                                         "not a Hugging Face tokenizer JSON"),
        "vocab too small": lambda: ([good], {"vocab_size": 256},
                                    "--vocab-size 256: a byte-level BPE needs at least 257"),
        "vocab and tokenizer": lambda: ([good], {"tokenizer": str(tmp_path / "plain.json")}, "give one of them"),
        "val fraction": lambda: ([good], {"val_fraction": 1.0}, "--val-fraction 1.0: must be in [0, 1)"),
        "no inputs": lambda: ([], {}, "no input files"),
        "all in val": lambda: ([good], {"val_fraction": 0.9999999},
                               "puts every one of the 1 document(s) in the val split, none in train"),
    }
    (tmp_path / "e.txt").write_text("")
    (tmp_path / "b.txt").write_text(" \n\t\n")
    return cases[name]()


BAD = ["empty", "blank", "missing", "directory", "glob matches nothing", "jsonl not json", "jsonl no field",
       "jsonl not text", "jsonl no documents", "tokenizer missing", "tokenizer not json", "tokenizer other json",
       "vocab too small", "vocab and tokenizer", "val fraction", "no inputs", "all in val"]


@pytest.mark.parametrize("case", BAD)
def test_bad_input_refused_before_anything_is_written(tmp_path, case):
    inputs, options, message = _bad(tmp_path, case)
    before = sorted(tmp_path.rglob("*"))
    with pytest.raises(DatasetError) as e:
        _run(inputs, tmp_path / "out", **options)
    assert message in str(e.value), str(e.value)
    assert sorted(tmp_path.rglob("*")) == before  # no dataset dir, nothing aside


def test_unreadable_file_named(tmp_path, monkeypatch):
    f = tmp_path / "secret.txt"
    f.write_text("x")
    real = Path.read_bytes

    def denied(self):
        if self == f:
            raise PermissionError(13, "Permission denied", str(self))
        return real(self)

    monkeypatch.setattr(Path, "read_bytes", denied)
    with pytest.raises(DatasetError, match=f"{f}: cannot be read \\(Permission denied\\)"):
        _run([f], tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_tokenizer_without_an_end_token_refused(tmp_path):
    from tokenizers import models

    path = tmp_path / "tok.json"
    Tokenizer(models.BPE()).save(str(path))
    (tmp_path / "a.txt").write_text("hello\n")
    with pytest.raises(DatasetError, match="has no end-of-document special token"):
        prepare([tmp_path / "a.txt"], tmp_path / "out", tokenizer=str(path), workers=1, progress=False)


def test_a_llama_style_tokenizer_ends_documents_with_its_eos_and_adds_no_bos(tmp_path):
    from tokenizers import AddedToken, processors

    first = _run(_corpus(tmp_path), tmp_path / "a", val_fraction=0.0)
    tok = Tokenizer.from_file(str(first.dir / "tokenizer.json"))
    tok.add_special_tokens([AddedToken("<unk>", special=True), AddedToken("<s>", special=True),
                            AddedToken("</s>", special=True)])
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    # no <|endoftext|>: the trained one's id 0 is renamed away
    data = json.loads(tok.to_str())
    for t in data["added_tokens"]:
        if t["content"] == "<|endoftext|>":
            t["content"] = "<pad>"
    data["model"]["vocab"]["<pad>"] = data["model"]["vocab"].pop("<|endoftext|>")
    (tmp_path / "llama.json").write_text(json.dumps(data))
    m = prepare(_corpus(tmp_path), tmp_path / "b", tokenizer=str(tmp_path / "llama.json"), workers=1,
                progress=False, val_fraction=0.0)
    eos = Tokenizer.from_file(str(tmp_path / "llama.json")).token_to_id("</s>")
    assert m.eos_id == eos
    assert _decoded(m) == TEXTS  # each document ends with </s>, and no <s> was put before it
    ids = np.fromfile(m.dir / m.split("train").shards[0].bin, dtype=m.dtype)
    assert (ids == eos).sum() == 3 and not (ids == bos).any()


def test_a_directory_that_is_not_a_dataset_is_refused_first(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "mine.txt").write_text("keep me")
    with pytest.raises(DatasetError, match="is not a prepared dataset"):
        _run([tmp_path / "missing-too.txt"], tmp_path / "out")  # refused before the inputs are looked at
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["mine.txt"]


# ------------------------------------------------------------------- the commands, in-process --

def test_commands_prepare_show_verify(tmp_path, capsys):
    from launcher.cli.main import main

    files = [str(f) for f in _corpus(tmp_path)]
    out = str(tmp_path / "ds")
    assert main(["data", "prepare", *files, "-o", out, "--vocab-size", "300", "--workers", "1",
                 "--val-fraction", "0"]) == 0
    m = Manifest.load(out)
    assert f"{m.split('train').tokens:,} tokens" in capsys.readouterr().out
    assert main(["data", "show", out]) == 0
    shown = capsys.readouterr().out
    assert "byte-level-bpe, vocab" in shown and m.split("train").shards[0].bin in shown
    assert main(["data", "show", out, "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == m.to_json()
    assert main(["data", "verify", out]) == 0 and "intact" in capsys.readouterr().out
    (tmp_path / "ds" / m.split("train").shards[0].idx).unlink()
    assert main(["data", "verify", out]) == 1
    assert f"{tmp_path / 'ds' / m.split('train').shards[0].idx}: missing" in capsys.readouterr().err
    assert main(["data", "prepare", str(tmp_path / "nope.txt"), "-o", str(tmp_path / "x")]) == 2
    assert capsys.readouterr().err.startswith(f"launcher data prepare: {tmp_path / 'nope.txt'}: no such file")
    assert main(["data", "show", str(tmp_path)]) == 2
    assert "is not a prepared dataset" in capsys.readouterr().err


def test_help_states_the_real_defaults(capsys):
    from launcher.cli.main import build_parser, main
    from launcher.data.manifest import DEFAULT_SHARD_TOKENS
    from launcher.data.prepare import DEFAULT_VAL_FRACTION, DEFAULT_VOCAB_SIZE

    args = build_parser().parse_args(["data", "prepare", "f.txt", "-o", "d"])
    assert args.val_fraction == DEFAULT_VAL_FRACTION and args.vocab_size is None and args.workers is None
    with pytest.raises(SystemExit):
        main(["data", "prepare", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert f"default {DEFAULT_VOCAB_SIZE}; at least 257" in text and f"default {DEFAULT_SHARD_TOKENS}" in text
    assert f"(default {DEFAULT_VAL_FRACTION})" in text


def test_a_dataset_that_cannot_be_written_is_an_error_line(tmp_path, capsys, monkeypatch):
    from launcher.cli.main import main
    from launcher.data import manifest

    def full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(manifest.tempfile, "mkdtemp", full)
    files = [str(f) for f in _corpus(tmp_path)]
    assert main(["data", "prepare", *files, "-o", str(tmp_path / "ds"), "--vocab-size", "300", "--workers", "1"]) == 2
    assert "cannot write" in capsys.readouterr().err and not (tmp_path / "ds").exists()
