"""A checkpoint whose native files hold every tensor of the universal form whole (DDP's) names them
instead of writing them a second time; the resume that needs the universal form (another layout)
writes it from those files, and it loads bit for bit."""
from __future__ import annotations

import json
import threading

import pytest
import torch
from omegaconf import OmegaConf
from test_async_universal import Engine
from test_fault_tolerance_parts import Ctx, make_run

from launcher.config.layout import UNIVERSAL_LINKS, has_universal
from launcher.run import checkpoint_manifest as cm
from launcher.training import universal, universal_links
from launcher.training.checkpoint import Checkpointer


class Scaled(Engine):
    """With an fp16 loss scaler, whose tiny state no native file holds as a tensor."""

    def __init__(self):
        super().__init__()
        self.scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)

    def universal_state(self):
        return universal.module_state(self.model, self.optimizer, self.scaler)


def _save(tmp_path, engine, async_save):
    rd = make_run(tmp_path)
    cfg = OmegaConf.create({"train": {"steps": 9, "fail_at_step": None, "fail_rank": 0, "fail_mode": "exception",
                                      "fail_attempt": None,
                                      # (both values of async_save: each path names the state alike)
                                      "checkpoint": {"every": 2, "keep": 2, "async_save": async_save}}})
    ck = Checkpointer(cfg, Ctx(rd), engine)
    engine.train_step()
    at_save = {k: v.detach().clone() for k, v in engine.model.state_dict().items()}
    moments = {k: {n: t.clone() for n, t in s.items()} for k, s in engine.optimizer.state_dict()["state"].items()}
    ck.save(2, [{"step": 1}, {"step": 2}])
    engine.train_step()  # (an async save's copy is done before this step changes the state)
    ck.finish()
    return rd.checkpoint_dir(2), at_save, moments


@pytest.mark.parametrize("async_save", [True, False])
def test_a_ddp_checkpoint_names_its_universal_form_and_a_reshard_writes_it_once(tmp_path, async_save, monkeypatch):
    engine = Scaled()
    agreed_in = []
    agree = universal_links.agree
    monkeypatch.setattr(universal_links, "agree", lambda *a, **k: agreed_in.append(
        threading.current_thread().name) or agree(*a, **k))
    ckpt, at_save, moments = _save(tmp_path, engine, async_save)
    # an async save's links are decided off the training thread (its first save's cost: the agreement)
    assert agreed_in == (["checkpoint-writer"] if async_save else ["MainThread"])
    assert not (ckpt / universal.DIR).exists()  # each byte written once
    assert has_universal(ckpt) and json.loads((ckpt / "meta.json").read_text())["universal"] == "linked"
    spec = json.loads((ckpt / UNIVERSAL_LINKS.format(rank="00000")).read_text())
    assert spec["model.weight"] == ["model.pt", "model", "weight"]
    assert spec["optim.weight.exp_avg"] == ["model.pt", "optimizer", "state", 0, "exp_avg"]
    assert spec["scaler.scale"] == {"value": [1024.0], "dtype": "float64", "shape": [1]}
    manifest = json.loads((ckpt / "checkpoint.json").read_text())
    assert UNIVERSAL_LINKS.format(rank="00000") in json.dumps(manifest)  # verified at resume like the rest

    scratch = tmp_path / "run" / "checkpoints" / ".universal_00000002"
    source = universal_links.source(ckpt, 0, scratch)
    assert source == scratch and (scratch / ".metadata").is_file() and not (ckpt / universal.DIR).exists()
    fresh = Scaled()
    with torch.no_grad():
        for p in fresh.model.parameters():
            p.zero_()
    universal.load_module_state(fresh.model, fresh.optimizer, source, fresh.scaler)
    for name, value in fresh.model.state_dict().items():
        assert torch.equal(value, at_save[name]), name  # the state of step 2, not the one trained after
    got = fresh.optimizer.state_dict()["state"]
    for k, state in moments.items():
        for n, t in state.items():
            assert torch.equal(got[k][n], t), (k, n)
    assert fresh.scaler.get_scale() == 1024.0
    universal_links.release(source, ckpt, 0)
    assert not scratch.exists() and cm.problems(ckpt) == []  # the checkpoint as its manifest lists it


def test_what_no_native_file_holds_whole_is_written_as_before(tmp_path):
    """A moment the native files leave out (here the optimizer's whole state): universal/ is written."""

    class ModelOnly(Engine):
        def checkpoint_files(self):
            return {"model.pt": {"model": self.model.state_dict()}}

    ckpt, _, _ = _save(tmp_path, ModelOnly(), async_save=True)
    assert universal.present(ckpt) and not list(ckpt.glob(UNIVERSAL_LINKS.format(rank="*")))
    assert json.loads((ckpt / "meta.json").read_text())["universal"] is True


def test_links_name_the_same_tensor_or_an_equal_small_copy_and_keep_only_a_scalar_by_value():
    w = torch.arange(64.0)
    assert universal_links.links({"model": {"w": w}}, {"f.pt": {"m": {"w": w}}}) == {"model.w": ["f.pt", "m", "w"]}
    # a small copy equal bit for bit (a buffer the save copied at once) stands for it; a differing one not
    assert universal_links.links({"model": {"w": w.clone()}}, {"f.pt": {"m": {"w": w}}}) == {
        "model.w": ["f.pt", "m", "w"]}
    assert universal_links.links({"model": {"w": w + 1}}, {"f.pt": {"m": {"w": w}}}) == {"model.w": None}
    assert universal_links.links({"model": {"w": w[:32]}}, {"f.pt": {"w": w}}) == {"model.w": None}  # a view
    assert universal_links.links({"s": torch.tensor([2.0])}, {}) == {"s": {"value": [2.0], "dtype": "float32",
                                                                          "shape": [1]}}
    assert universal_links.links(None, {}) is None


def test_the_next_save_of_the_same_tensors_names_them_again_without_building_the_universal_state(tmp_path):
    """The state by parameter name (get_state_dict: milliseconds on the training path) is built again only
    where the native files' tensors changed, or a value is kept by value (the loss scaler's scale)."""
    built = []

    class Counted(Engine):
        def universal_state(self):
            built.append(1)
            return super().universal_state()

    class CountedScaled(Scaled):
        def universal_state(self):
            built.append(1)
            return super().universal_state()

    for engine, expected in ((Counted(), 1), (CountedScaled(), 3)):
        built.clear()
        (tmp_path / type(engine).__name__).mkdir()
        rd = make_run(tmp_path / type(engine).__name__)
        cfg = OmegaConf.create({"train": {"steps": 9, "fail_at_step": None, "fail_rank": 0, "fail_mode": "exception",
                                          "fail_attempt": None,  # (the default, async)
                                          "checkpoint": {"every": 2, "keep": 3, "async_save": True}}})
        ck = Checkpointer(cfg, Ctx(rd), engine)
        for step in (2, 4, 6):
            engine.train_step()
            ck.save(step, [{"step": step}])
        ck.finish()
        assert len(built) == expected, type(engine).__name__
        for step in (2, 4, 6):
            ckpt = rd.checkpoint_dir(step)
            assert (ckpt / UNIVERSAL_LINKS.format(rank="00000")).is_file() and not (ckpt / universal.DIR).exists()
            assert cm.problems(ckpt) == []


def test_pieces_of_a_sharded_tensor_are_linked_to_their_files_and_assembled_exactly(tmp_path):
    """Two tensor-parallel ranks: a column-parallel weight whose rows are each rank's heads of a fused
    qkv (an index tensor: three runs each), a row-parallel weight split by columns, and a replicated bias
    rank 0 names whole. Each rank's links name its own shard file; the universal form written from them
    holds the full tensors bit for bit."""
    heads, head_dim, hidden, tp = 4, 2, 3, 2
    qkv = torch.randn(3 * heads * head_dim, hidden)
    proj = torch.randn(hidden, heads * head_dim)
    bias = torch.randn(hidden)
    idx = torch.arange(3 * heads * head_dim).view(3, heads, head_dim)
    for rank in range(tp):
        rows = idx[:, rank * heads // tp:(rank + 1) * heads // tp].reshape(-1)
        cols = slice(rank * heads * head_dim // tp, (rank + 1) * heads * head_dim // tp)
        shard = {"qkv": qkv[rows].clone(), "proj": proj[:, cols].clone(),
                 **({"bias": bias.clone()} if rank == 0 else {})}
        state = {"model": {"qkv": universal.Piece(shard["qkv"], tuple(qkv.shape), rows),
                           "proj": universal.Piece(shard["proj"], tuple(proj.shape), None, cols),
                           **({"bias": shard["bias"]} if rank == 0 else {})}}
        name = f"model_tp{rank}.pt"
        links = universal_links.agree(state, {name: {"model": shard}})  # (one process: its own vote)
        assert links["model.qkv"]["piece"] == [name, "model", "qkv"] and len(links["model.qkv"]["rows"]) == 3
        assert links["model.proj"]["cols"] == [[cols.start, cols.stop]] and links["model.proj"]["rows"] is None
        torch.save({"model": shard}, tmp_path / name)
        (tmp_path / universal_links.file_name(rank)).write_text(json.dumps(links))
    out = tmp_path / "scratch"
    universal_links.materialize(tmp_path, out)
    got = {"model": {"qkv": torch.empty_like(qkv), "proj": torch.empty_like(proj), "bias": torch.empty_like(bias)}}
    import torch.distributed.checkpoint as dcp

    dcp.load(got, checkpoint_id=str(out), no_dist=True)
    for k, want in (("qkv", qkv), ("proj", proj), ("bias", bias)):
        assert torch.equal(got["model"][k], want), k
    # a rank's links missing: its pieces do not cover the tensor, and the assembly says so
    (tmp_path / universal_links.file_name(1)).unlink()
    with pytest.raises(RuntimeError, match="pieces of model.qkv cover 36 of its 72 elements"):
        universal_links.materialize(tmp_path, out)


def test_a_piece_no_file_holds_is_not_linked_and_a_rank_with_nothing_to_name_agrees():
    w = torch.arange(8.0)
    piece = universal.Piece(w[:4].clone(), (8,), slice(0, 4))
    assert universal_links.links({"m": {"w": piece}}, {"f.pt": {"w": w}}) == {"m.w": None}
    assert universal_links.agree({"m": {"w": piece}}, {"f.pt": {"w": w}}) is None
    # a data-parallel replica of a ZeRO-0 stage holds no weights or moments: nothing to name, it agrees
    assert universal_links.agree({"model": {}, "optim": {}}, {}) == {}


def test_a_place_two_ranks_name_is_taken_once(tmp_path):
    """A tied weight's shards on the first and the last pipeline stage name the same places: the
    assembly takes each once (not twice the elements)."""
    w = torch.randn(4, 3)
    for rank, (rows, file) in enumerate(((slice(0, 2), "a.pt"), (slice(2, 4), "a.pt"),
                                         (slice(0, 2), "b.pt"), (slice(2, 4), "b.pt"))):
        name = f"{file[0]}{rank}.pt"
        torch.save({"w": w[rows].clone()}, tmp_path / name)
        links = {"w": {"piece": [name, "w"], "shape": [4, 3], "rows": [[rows.start, rows.stop]], "cols": None}}
        (tmp_path / universal_links.file_name(rank)).write_text(json.dumps(links))
    universal_links.materialize(tmp_path, tmp_path / "out")
    import torch.distributed.checkpoint as dcp

    got = {"w": torch.empty(4, 3)}
    dcp.load(got, checkpoint_id=str(tmp_path / "out"), no_dist=True)
    assert torch.equal(got["w"], w)


def test_fragments_of_flat_partitions_are_linked_by_storage_and_assembled(tmp_path):
    """Two ZeRO ranks, each holding a flat fp32 partition of two parameters concatenated (a parameter
    split across the partitions' boundary): each fragment is a view of its rank's partition, linked as
    [start in the file's tensor, numel, start in the flattened parameter]; the assembly is exact."""
    a, b = torch.randn(3, 4), torch.randn(5)
    flat = torch.cat([a.reshape(-1), b])  # 17 elements over two ranks: 9 and 8
    bounds = [(0, 9), (9, 17)]
    for rank, (lo, hi) in enumerate(bounds):
        part = flat[lo:hi].clone()
        state = {"model": {}}
        for name, t, start in (("a", a, 0), ("b", b, 12)):
            first, last = max(lo, start), min(hi, start + t.numel())
            if first < last:  # this rank's fragment of it: a view of its partition
                state["model"][name] = universal.Piece(part[first - lo:last - lo], tuple(t.shape), flat=first - start)
        name = f"optim_{rank}.pt"
        files = {name: {"optimizer_state_dict": {"single_partition_of_fp32_groups": [part]}}}
        links = universal_links.agree(state, files)
        assert links["model.a"]["piece"] == [name, "optimizer_state_dict", "single_partition_of_fp32_groups", 0]
        torch.save(files[name], tmp_path / name)
        (tmp_path / universal_links.file_name(rank)).write_text(json.dumps(links))
    assert json.loads((tmp_path / universal_links.file_name(1)).read_text())["model.a"]["flat"] == [0, 3, 9]
    universal_links.materialize(tmp_path, tmp_path / "out")
    import torch.distributed.checkpoint as dcp

    got = {"model": {"a": torch.empty(3, 4), "b": torch.empty(5)}}
    dcp.load(got, checkpoint_id=str(tmp_path / "out"), no_dist=True)
    assert torch.equal(got["model"]["a"], a) and torch.equal(got["model"]["b"], b)
    # a fragment no file's partition holds (a copy): not linked
    assert universal_links.links({"w": universal.Piece(flat[:3].clone(), (3,), flat=0)}, {"f.pt": {"p": flat}}) == {
        "w": None}
