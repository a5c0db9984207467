"""``data=tokens`` before anything queues, and its datasets in the archive (issue 21).

Checks (launcher.data.checks, rows of the rule table): the path missing, not a prepared dataset,
its manifest unreadable; a blend weight <= 0 or an entry without a path; seq_len longer than every
document with packing off; the model's vocabulary smaller than the tokenizer's; eval asked of an
empty val split: each an error naming the key and the fix, read from manifest.json alone (no shard
hashed at launch). Archive (launcher.data.archived): data_manifest.json in each run dir, sealed;
`launcher show` names the dataset; `launcher reproduce` hashes every shard against it and refuses a
changed one naming the file (--trust-unverified goes on, recorded); `launcher resume` checks sizes.
Pure: datasets written with manifest.write_dataset, run dirs built in tmp_path."""
from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from launcher.app import CONF_DIR
from launcher.archive import software
from launcher.cli.main import main
from launcher.config.errors import ConfigErrors
from launcher.data import archived, checks, manifest
from launcher.data.manifest import write_dataset
from launcher.run.rundir import RunDir
from launcher.run.status import Status
from launcher.submit import pipeline, reproduce as reproduce_mod, resume as resume_mod
from launcher.submit.pipeline import InvalidSweep, Point, validate

TRAIN = [[(i * 7 + j) % 400 + 1 for j in range(40)] for i in range(30)]  # 30 documents of 41 tokens (EOS)


def dataset(tmp_path: Path, name: str = "ds", train=TRAIN, val=((5, 6, 7),), vocab: int = 512) -> Path:
    out = tmp_path / name
    write_dataset(out, {"train": train, "val": list(val)}, vocab_size=vocab, eos_id=0,
                  tokenizer_json='{"model": {"vocab": {}}}')
    return out


def _cfg(overrides):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def tokens(path, *more):
    return ["data=tokens", f"data.path={path}", "model.seq_len=32", *more]


def ok(overrides):
    return validate([Point(_cfg(overrides), list(overrides))])[0]


def refused(overrides) -> str:
    with pytest.raises(InvalidSweep) as ei:
        validate([Point(_cfg(overrides), list(overrides))])
    text = str(ei.value)
    assert "nothing was submitted" in text
    return text


# ---- the checks -----------------------------------------------------------------------------------

def test_a_prepared_dataset_passes_and_is_archived_by_its_absolute_path(tmp_path, monkeypatch):
    dataset(tmp_path)
    monkeypatch.chdir(tmp_path)
    c = ok(tokens("ds"))
    assert c.resolved["data"]["path"] == str(tmp_path / "ds")  # the job runs in its run dir's work/


def test_data_tokens_without_a_path_is_refused():
    text = refused(["data=tokens"])
    assert "data.path: data=tokens needs a prepared dataset" in text and "launcher data prepare" in text


def test_a_path_that_is_no_dataset_is_refused_naming_it(tmp_path):
    assert f"data.path: {tmp_path / 'nope'}: no such dataset directory" in refused(tokens(tmp_path / "nope"))
    (tmp_path / "plain").mkdir()
    text = refused(tokens(tmp_path / "plain"))
    assert f"{tmp_path / 'plain' / 'manifest.json'}: missing" in text and "not a prepared dataset" in text


def test_an_unreadable_manifest_is_refused_with_the_datasets_own_words(tmp_path):
    ds = dataset(tmp_path)
    (ds / "manifest.json").write_text("{not json")
    assert "manifest.json: not readable as JSON" in refused(tokens(ds))
    ds2 = dataset(tmp_path, "ds2")
    data = json.loads((ds2 / "manifest.json").read_text())
    data["splits"]["train"]["tokens"] = -1
    (ds2 / "manifest.json").write_text(json.dumps(data))
    assert "key 'splits.train.tokens' is -1" in refused(tokens(ds2))


def _blend(*entries) -> str:
    return "data.blend=[" + ", ".join("{" + ", ".join(f"{k}: '{v}'" if k == "path" else f"{k}: {v}"
                                                      for k, v in e.items()) + "}" for e in entries) + "]"


@pytest.mark.parametrize("weight", ["0", "-1", "nan"])
def test_a_blend_weight_not_above_zero_is_refused_naming_its_entry(tmp_path, weight):
    a, b = dataset(tmp_path, "a"), dataset(tmp_path, "b")
    text = refused(["data=tokens", "model.seq_len=32", _blend({"path": a, "weight": 1}, {"path": b, "weight": weight})])
    assert "data.blend[1].weight: is" in text and "weight > 0" in text and "data.blend[0]" not in text


def test_a_blend_entry_without_a_path_is_refused(tmp_path):
    text = refused(["data=tokens", "model.seq_len=32", _blend({"path": dataset(tmp_path), "weight": 1}, {"weight": 2})])
    assert "data.blend[1].path: a blend entry needs the path of a prepared dataset" in text


def test_a_blend_of_two_datasets_passes(tmp_path):
    c = ok(["data=tokens", "model.seq_len=32",
            _blend({"path": dataset(tmp_path, "a"), "weight": 3}, {"path": dataset(tmp_path, "b"), "weight": 1})])
    assert [d["key"] for d in archived.record(c.resolved)["datasets"]] == ["data.blend[0].path", "data.blend[1].path"]


def test_seq_len_longer_than_every_document_with_packing_off_names_the_longest(tmp_path):
    ds = dataset(tmp_path)
    text = refused(tokens(ds, "data.packing=false", "model.seq_len=64"))
    assert "model.seq_len: 64 needs documents of seq_len+1 = 65 tokens" in text
    assert "the longest train document" in text and "has 41" in text
    assert "data.packing=true" in text and "model.seq_len=40 or less" in text
    ok(tokens(ds, "data.packing=false", "model.seq_len=40"))  # 41 tokens: one window per document
    ok(tokens(ds, "model.seq_len=64"))  # packed: the documents are one stream


def test_the_models_vocabulary_is_the_datasets_unless_set_and_a_smaller_one_set_is_refused(tmp_path):
    ds = dataset(tmp_path, vocab=1000)
    text = refused(tokens(ds, "model.vocab_size=512"))
    assert "model.vocab_size: 512 is smaller than the tokenizer's vocabulary of 1000" in text
    assert "set model.vocab_size=1000 or more" in text
    assert ok(tokens(ds, "model.vocab_size=1024")).resolved["model"]["vocab_size"] == 1024  # set: kept
    # unset (gpt_tiny says 512): the manifest's, a multiple of tp for the vocab-parallel embedding
    assert ok(tokens(ds)).resolved["model"]["vocab_size"] == 1000
    tp4 = ["parallelism=tp", "parallelism.tp=4", "cluster=local_slurm", "cluster.nodes=1", "cluster.gpus_per_node=4",
           "train.global_batch_size=4", "train.micro_batch_size=4"]
    assert ok(tokens(ds, *tp4)).resolved["model"]["vocab_size"] == 1000
    assert ok(tokens(dataset(tmp_path, "ds2", vocab=1001), *tp4)).resolved["model"]["vocab_size"] == 1004
    # a blend: the largest tokenizer among its datasets; other data: the option's own number
    blend = f"data.blend=[{{path: {ds}, weight: 1}}, {{path: {dataset(tmp_path, 'ds3', vocab=1200)}, weight: 1}}]"
    assert ok(["data=tokens", blend, "model.seq_len=32"]).resolved["model"]["vocab_size"] == 1200
    assert ok([]).resolved["model"]["vocab_size"] == 512


def test_eval_of_an_empty_val_split_is_refused(tmp_path):
    ds = dataset(tmp_path, val=())
    text = refused(tokens(ds, "data.eval_every=10"))
    assert "data.eval_every: 10 evaluates on the val split, but the val split of" in text and "0 documents" in text
    assert "data.eval_every=0" in text and "--val-fraction" in text
    ok(tokens(ds))  # no eval asked: no val split needed


def test_a_dataset_given_to_the_synthetic_data_is_refused(tmp_path):
    text = refused(["data=synthetic", f"data.path={dataset(tmp_path)}"])
    assert "data.path: is set, but data=synthetic never reads it" in text and "data=tokens" in text


def test_every_problem_is_listed_at_once(tmp_path):
    ds = dataset(tmp_path, val=(), vocab=1000)
    text = refused(tokens(ds, "data.packing=false", "model.seq_len=64", "data.eval_every=5", "model.vocab_size=512"))
    assert all(k in text for k in ("model.seq_len:", "model.vocab_size:", "data.eval_every:"))


def test_launch_reads_the_manifest_only_never_a_shard(tmp_path, monkeypatch):
    ds = dataset(tmp_path, "fresh")
    opened = []
    real_open = open

    def watch(path, *a, **kw):
        if str(path).endswith((".bin", ".idx")):
            opened.append(path)
        return real_open(path, *a, **kw)

    monkeypatch.setattr("builtins.open", watch)
    monkeypatch.setattr(manifest, "file_sha256", lambda p: pytest.fail(f"hashed {p} at launch"))
    ok(tokens(ds))
    assert opened == []


def test_the_manifest_is_read_once_per_version(tmp_path):
    ds = dataset(tmp_path)
    first = checks.load(str(ds))
    assert checks.load(str(ds)) is first
    dataset(tmp_path, train=TRAIN[:3])  # prepared again: a new manifest.json
    assert checks.load(str(ds)).manifest.split("train").documents == 3


# ---- the archive ----------------------------------------------------------------------------------

def _staged_run(tmp_path: Path, monkeypatch, overrides) -> RunDir:
    """The run dir `launch` stages for ``overrides`` (the pipeline's create and stage; nothing submitted),
    published and sealed as a finished run is."""
    monkeypatch.setattr(software, "pip_freeze", lambda: "")
    root = tmp_path / "runs"
    overrides = [*overrides, f"submit.runs_root={root}"]
    checked = validate([Point(_cfg(overrides), overrides)])
    code = root / "code"  # a snapshot inside the runs root, as a launch's
    code.mkdir(parents=True, exist_ok=True)
    sweep = pipeline.create(checked, root, ["launch"], code, None)
    pipeline.stage(sweep, checked)
    rd = sweep.dir.publish(0)
    rd.set_status(Status.running)
    assert rd.finish(Status.completed, exit_code=0)
    return rd


def test_each_run_dir_holds_its_datasets_manifests_sealed(tmp_path, monkeypatch):
    a, b = dataset(tmp_path, "a"), dataset(tmp_path, "b", train=TRAIN[:10])
    rd = _staged_run(tmp_path, monkeypatch, ["data=tokens", "model.seq_len=32",
                                             _blend({"path": a, "weight": 3}, {"path": b, "weight": 1})])
    rec = rd.data_manifest()
    assert [(d["path"], d["weight"]) for d in rec["datasets"]] == [(str(a), 3.0), (str(b), 1.0)]
    assert rec["datasets"][1]["manifest"] == json.loads((b / "manifest.json").read_text())
    assert rd.verify() == [] and RunDir.DATA_MANIFEST in json.loads((rd.path / "manifest.json").read_text())["files"]
    path = rd.path / RunDir.DATA_MANIFEST
    os.chmod(path, path.stat().st_mode | stat.S_IWUSR)
    path.write_text(json.dumps({**rec, "datasets": rec["datasets"][:1]}))
    assert f"{RunDir.DATA_MANIFEST} changed" in "; ".join(rd.verify())


def test_a_synthetic_run_holds_no_data_manifest(tmp_path, monkeypatch):
    rd = _staged_run(tmp_path, monkeypatch, [])
    assert rd.data_manifest() is None and not (rd.path / RunDir.DATA_MANIFEST).exists()


def test_show_prints_the_dataset(tmp_path, monkeypatch, capsys):
    ds = dataset(tmp_path)
    rd = _staged_run(tmp_path, monkeypatch, tokens(ds))
    assert main(["show", str(rd.path), "--root", str(tmp_path / "runs")]) == 0
    out = " ".join(capsys.readouterr().out.split())
    sha = json.loads((ds / "manifest.json").read_text())["tokenizer"]["sha256"]
    assert str(ds) in out and "train 1,230 tokens (30 documents)" in out and f"tokenizer sha256 {sha[:16]}" in out


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[3] ^= 0x01
    path.write_bytes(bytes(data))


def test_reproduce_refuses_a_changed_shard_naming_it(tmp_path, monkeypatch, capsys):
    ds = dataset(tmp_path)
    rd = _staged_run(tmp_path, monkeypatch, tokens(ds))
    launched = []
    monkeypatch.setattr(reproduce_mod, "reproduce", lambda *a, **kw: launched.append(kw))
    root = str(tmp_path / "runs")
    assert main(["reproduce", str(rd.path), "--root", root]) == 0 and launched[0]["unverified"] == []
    (shard,) = json.loads((ds / "manifest.json").read_text())["splits"]["train"]["shards"]
    _flip_a_byte(ds / shard["bin"])
    assert main(["reproduce", str(rd.path), "--root", root]) == 2
    err = capsys.readouterr().err
    assert f"dataset changed: {ds / shard['bin']}: sha256" in err and "refusing to reproduce" in err
    assert "data that changed since" in err and len(launched) == 1
    assert main(["reproduce", str(rd.path), "--root", root, "--trust-unverified"]) == 0
    assert [p.split(":")[1].strip() for p in launched[1]["unverified"]] == [str(ds / shard["bin"])]


def test_reproduce_on_other_data_does_not_check_the_archived_dataset(tmp_path, monkeypatch):
    ds, other = dataset(tmp_path), dataset(tmp_path, "other")
    rd = _staged_run(tmp_path, monkeypatch, tokens(ds))
    (shard,) = json.loads((ds / "manifest.json").read_text())["splits"]["train"]["shards"]
    _flip_a_byte(ds / shard["bin"])
    assert reproduce_mod.data_problems(rd.path, []) != []
    assert reproduce_mod.data_problems(rd.path, [f"data.path={other}"]) == []


def test_a_dataset_prepared_again_in_place_is_named(tmp_path, monkeypatch):
    ds = dataset(tmp_path)
    rd = _staged_run(tmp_path, monkeypatch, tokens(ds))
    dataset(tmp_path, train=TRAIN[:5])  # the same dir, other documents: other shards, a new manifest
    text = "\n".join(reproduce_mod.data_problems(rd.path))
    assert f"{ds / 'manifest.json'}: differs from the manifest archived at launch" in text
    assert "shards/train-" in text and "missing" in text


def test_resume_checks_sizes_only_and_refuses_a_missing_or_resized_shard(tmp_path, monkeypatch):
    ds = dataset(tmp_path)
    rd = _staged_run(tmp_path, monkeypatch, tokens(ds))
    (shard,) = json.loads((ds / "manifest.json").read_text())["splits"]["train"]["shards"]
    bin_path = ds / shard["bin"]
    _flip_a_byte(bin_path)  # same size: only reproduce's hashes see it
    assert archived.problems(rd.data_manifest(), hashes=False) == []
    with open(bin_path, "ab") as f:
        f.write(b"\0\0")
    with pytest.raises(ConfigErrors) as ei:
        resume_mod.prepare(rd.path)
    assert f"{bin_path}: size {shard['bin_size'] + 2} bytes differs from the manifest's {shard['bin_size']}" in str(
        ei.value)
    bin_path.unlink()
    with pytest.raises(ConfigErrors, match=f"{bin_path}: missing"):
        resume_mod.prepare(rd.path)


def test_the_archived_record_names_each_dataset_and_its_manifest_digest(tmp_path):
    ds = dataset(tmp_path)
    tree = {"data": {"name": "tokens", "path": str(ds), "blend": []}}
    rec = archived.record(tree)
    (entry,) = rec["datasets"]
    assert entry["path"] == str(ds) and entry["key"] == "data.path"
    assert entry["manifest_sha256"] == manifest.file_sha256(ds / "manifest.json")
    assert archived.problems(rec, hashes=True) == []
    assert archived.record({"data": {"name": "synthetic"}}) is None


def test_the_points_of_a_sweep_on_one_dataset_share_one_record(tmp_path, monkeypatch):
    monkeypatch.setattr(software, "pip_freeze", lambda: "")
    ds, root = dataset(tmp_path), tmp_path / "runs"
    points = [Point(_cfg(o), o) for o in (tokens(ds, f"seed={s}", f"submit.runs_root={root}") for s in (1, 2))]
    checked = validate(points)
    (root / "code").mkdir(parents=True)
    sweep = pipeline.create(checked, root, ["launch"], root / "code", None)
    a, b = (rd.path / RunDir.DATA_MANIFEST for rd in pipeline.stage(sweep, checked))
    assert os.path.samefile(a, b) and json.loads(a.read_text())["datasets"][0]["path"] == str(ds)


def test_the_sequence_length_is_the_one_the_recipe_declares():
    from types import SimpleNamespace

    from launcher.config.values import Values

    lm_like = SimpleNamespace(model=SimpleNamespace(seq_len=128), values=Values({"lm": {"seq_len": 128}}))
    assert checks.seq_len_of(lm_like) == ("lm.seq_len", 128)  # a recipe whose data shape is its own group's
    gpt_like = SimpleNamespace(model=SimpleNamespace(seq_len=64), values=Values({"model": {"seq_len": 64}}))
    assert checks.seq_len_of(gpt_like) == ("model.seq_len", 64)
    no_facts = SimpleNamespace(model=None, values=Values({"model": {"seq_len": 16}}))
    assert checks.seq_len_of(no_facts) == ("model.seq_len", 16)
    assert checks.seq_len_of(SimpleNamespace(model=None, values=Values({"data": {}}))) is None


def test_a_recipe_without_a_sequence_length_is_held_to_the_dataset_checks_only(tmp_path):
    ds = dataset(tmp_path, train=[[1, 2]], vocab=100000)
    ok(["recipe=commbench", "data=tokens", f"data.path={ds}"])  # no seq_len, no vocabulary of its own
    assert "data.path:" in refused(["recipe=commbench", "data=tokens", f"data.path={tmp_path / 'nope'}"])


@pytest.mark.parametrize("junk", [[1, 2], {"datasets": {"a": 1}}, {"datasets": [3, {"manifest": [1]}]}, "text"])
def test_a_hand_edited_data_manifest_never_breaks_show(junk):
    assert isinstance(archived.describe(junk), list)
    assert isinstance(archived.problems(junk if isinstance(junk, dict) else {}, hashes=False), list)
