"""The public training API (launcher.training) with a plain module in one process: Checkpoint saves
and resumes any state dicts bit for bit, keeps K, rewinds the metrics file; StepLoop saves when due,
and on a stop signal saves, then raises ctx.interrupted."""
from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from launcher.config.schema import RunConfig
from launcher.run.rundir import RunDir
from launcher.runtime.context import RunContext
from launcher.runtime.restarts import Interrupted, StopFlag
from launcher.training import Checkpoint, StepLoop

STEPS = 8


def make_cfg(every=3, keep=2, async_save=True):
    return OmegaConf.merge(OmegaConf.structured(RunConfig), {
        "cluster": {"name": "unit"}, "wandb": {"enabled": False},
        "train": {"steps": STEPS, "checkpoint": {"every": every, "keep": keep, "async_save": async_save}}})


def make_ctx(run_dir: Path, attempt: int = 1) -> RunContext:
    run_dir.mkdir(parents=True, exist_ok=True)
    return RunContext(rank=0, world_size=1, local_rank=0, local_world_size=1, node_rank=0, hostname="localhost",
                      rundir=RunDir(run_dir), layout=None, device="cpu", backend="gloo", attempt=attempt,
                      stop_flag=StopFlag())


class Stop(Exception):
    pass


def train(cfg, ctx, crash_at=None, stop_at=None):
    """A user's loop: a BatchNorm MLP (buffers change in the forward), AdamW, a scheduler, data drawn
    from numpy, python and torch RNGs (all restored on resume), dropout. Returns (losses, weights)."""
    torch.manual_seed(0), np.random.seed(0), random.seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                                torch.nn.Dropout(0.2), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    ckpt = Checkpoint(cfg, ctx, {"model": model, "optimizer": opt, "scheduler": sched})
    loop = StepLoop(cfg, ctx, ckpt)
    for step in loop:
        if step == crash_at:
            ckpt.wait()  # the process dies: what it had written stays, the save in flight is not its
            raise Stop(step)
        x = torch.randn(8, 4) + float(np.random.rand()) + random.random()
        loss = (model(x).squeeze(1) - x.sum(1)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        loop.log(loss=loss.item())
        if step == stop_at:
            ctx.stop_flag.reason = "preempted"
    return loop.values("loss"), {k: v.clone() for k, v in model.state_dict().items()}


def metrics_steps(run_dir: Path):
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def slow_host_copy(monkeypatch):
    """An asynchronous save's copy to host memory takes a while: the next step's forward (which
    changes BatchNorm's buffers) runs meanwhile; its optimizer step waits for the copy."""
    import time

    from launcher.training import async_save

    real = async_save.host_copy

    def slow(obj, reuse=None, *more):
        if torch.is_tensor(obj):
            time.sleep(0.003)
        return real(obj, reuse, *more)

    monkeypatch.setattr(async_save, "host_copy", slow)


@pytest.mark.parametrize("async_save", [True, False])
def test_a_crashed_and_a_preempted_run_end_bitwise_where_an_uninterrupted_one_ends(tmp_path, async_save,
                                                                                   monkeypatch):
    cfg = make_cfg(async_save=async_save)
    slow_host_copy(monkeypatch)
    ref_losses, ref_weights = train(cfg, make_ctx(tmp_path / "ref"))
    assert len(ref_losses) == STEPS and metrics_steps(tmp_path / "ref") == list(range(1, STEPS + 1))
    rd = RunDir(tmp_path / "ref")
    # every 3 steps and the last, the last 2 kept
    assert [RunDir.checkpoint_step(p) for p in rd.checkpoints()] == [6, 8]
    assert rd.latest_checkpoint() == rd.checkpoint_dir(8)

    run = tmp_path / "run"
    with pytest.raises(Stop):  # attempt 1 dies in step 5: rows 1..4 logged, the checkpoint after 3 kept
        train(cfg, make_ctx(run), crash_at=5)
    assert metrics_steps(run) == [1, 2, 3, 4]
    RunDir(run).checkpoint_partial(4).mkdir()  # a save that died half-way: removed on resume

    with pytest.raises(Interrupted) as stop:  # attempt 2 resumes after 3; signalled in step 6
        train(cfg, make_ctx(run, attempt=2), stop_at=6)
    assert (stop.value.reason, stop.value.step) == ("preempted", 6)
    assert metrics_steps(run) == [1, 2, 3, 4, 5, 6]  # rewound to step 3, then 4..6 once each
    assert RunDir(run).latest_checkpoint() == RunDir(run).checkpoint_dir(6)  # saved at the boundary
    assert RunDir(run).stale_partials() == []

    losses, weights = train(cfg, make_ctx(run, attempt=3))
    assert metrics_steps(run) == list(range(1, STEPS + 1))
    assert losses == ref_losses  # bitwise: the resumed steps' rows come from the checkpoint
    assert [json.loads(x)["loss"] for x in (run / "metrics.jsonl").read_text().splitlines()] == ref_losses
    assert weights.keys() == ref_weights.keys()
    assert all(torch.equal(weights[k], ref_weights[k]) for k in weights)


def test_a_restart_without_a_checkpoint_starts_over_with_an_empty_metrics_file(tmp_path):
    cfg = make_cfg(every=0)
    run = tmp_path / "run"
    with pytest.raises(Stop):
        train(cfg, make_ctx(run), crash_at=4)
    assert metrics_steps(run) == [1, 2, 3]
    loop = StepLoop(cfg, make_ctx(run, attempt=2), Checkpoint(cfg, make_ctx(run, attempt=2), {}))
    assert (loop.start, loop.history) == (0, []) and metrics_steps(run) == []


def test_the_loop_overrides_and_a_checkpoint_refuses_an_object_without_a_state_dict(tmp_path):
    cfg = make_cfg()
    ctx = make_ctx(tmp_path / "run")
    ck = Checkpoint(cfg, ctx, {"w": torch.nn.Linear(2, 2)}, every=2, keep=1, async_save=False)
    assert (ck.every, ck.keep, ck.async_save) == (2, 1, False)
    loop = StepLoop(cfg, ctx, ck, steps=3)
    assert list(loop) == [1, 2, 3]
    assert [RunDir.checkpoint_step(p) for p in ctx.rundir.checkpoints()] == [3]  # due at 2 and the last
    with pytest.raises(TypeError, match="'data'"):
        Checkpoint(cfg, ctx, {"data": [1, 2]})


# ---- a checkpoint verified before it is loaded (launcher.run.checkpoint_manifest) ---------------------
def _truncate(ckpt: Path) -> str:
    p = ckpt / "state.pt"
    os.truncate(p, 1000)
    return "step_00000008/state.pt is 1000 bytes"


def _flip_one_byte(ckpt: Path) -> str:
    p = ckpt / "state.pt"
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0xFF
    p.write_bytes(bytes(data))
    return "step_00000008/state.pt changed (sha256"


def _repoint_latest(ckpt: Path) -> str:
    """A copy of the checkpoint planted under a later step's name, and `latest` pointed at it."""
    planted = ckpt.parent / "step_00000099"
    shutil.copytree(ckpt, planted)
    (ckpt.parent / "latest").write_text("step_00000099\n")
    shutil.rmtree(ckpt)  # (as probe P25: the real one gone too)
    return "step_00000099 holds step 8 (checkpoint.json), not the step its name says (99)"


def _delete_a_file(ckpt: Path) -> str:
    (ckpt / "rng_rank_00000.pt").unlink()
    return "step_00000008/rng_rank_00000.pt missing"


def _plant_a_file(ckpt: Path) -> str:
    (ckpt / "extra.pt").write_bytes(b"planted")
    return "step_00000008/extra.pt added (not in checkpoint.json)"


CORRUPTIONS = {"truncated": _truncate, "one byte flipped": _flip_one_byte, "latest re-pointed": _repoint_latest,
               "a file deleted": _delete_a_file, "a file planted": _plant_a_file}


def test_every_checkpoint_names_each_of_its_files_with_size_and_sha256(tmp_path):
    from launcher.run import checkpoint_manifest as cm

    train(make_cfg(every=3, keep=3), make_ctx(tmp_path / "run"))
    rd = RunDir(tmp_path / "run")
    assert [RunDir.checkpoint_step(p) for p in rd.checkpoints()] == [3, 6, 8]
    for ckpt in rd.checkpoints():
        manifest = json.loads((ckpt / "checkpoint.json").read_text())
        on_disk = sorted(str(p.relative_to(ckpt)) for p in ckpt.rglob("*")
                         if p.is_file() and p.name != "checkpoint.json")
        assert sorted(manifest["files"]) == on_disk and "state.pt" in on_disk and "meta.json" in on_disk
        assert manifest["step"] == RunDir.checkpoint_step(ckpt)
        assert all(manifest["files"][f] == cm.digest(ckpt / f) for f in on_disk)
        assert cm.problems(ckpt) == []
    # the rank's done mark carried its files' digests (the committing rank reused them)
    mark = json.loads((rd.checkpoint_dir(8) / "done_rank_00000").read_text())
    # and the model and its optimizer by parameter name: named in state.pt, which holds them whole
    assert set(mark["files"]) == {"state.pt", "rng_rank_00000.pt", "meta.json", "universal.links.00000.json"}


@pytest.mark.parametrize("way", list(CORRUPTIONS))
def test_a_corrupt_latest_falls_back_to_the_previous_intact_checkpoint_recorded(tmp_path, way):
    """Checkpoints after 6 and 8 (keep 2); the one after 8 corrupted: the resume is from 6, says why,
    moves the rejected one aside, and the run still ends bitwise where an uninterrupted one does."""
    cfg = make_cfg(every=3, keep=2)
    ref_losses, ref_weights = train(cfg, make_ctx(tmp_path / "ref"))
    run = tmp_path / "run"
    train(cfg, make_ctx(run))
    rd = RunDir(run)
    named = CORRUPTIONS[way](rd.checkpoint_dir(8))
    losses, weights = train(cfg, make_ctx(run, attempt=2))  # resumes from 6, redoes 7 and 8
    (row,) = rd.fallbacks()
    assert row["attempt"] == 2 and row["from_step"] == 6 and row["resumed_from"] == "step_00000006"
    assert any(named in p for ps in row["rejected"].values() for p in ps), row
    rejected = "step_00000099" if way == "latest re-pointed" else "step_00000008"
    assert row["moved"] == {rejected: f"checkpoints/rejected/{rejected}.attempt_2"}  # kept to inspect
    assert (run / row["moved"][rejected]).is_dir()
    assert rd.latest_checkpoint() == rd.checkpoint_dir(8)  # saved again after redoing 7 and 8
    assert [RunDir.checkpoint_step(p) for p in rd.checkpoints()] == [6, 8] and rd.restarts() == []
    assert metrics_steps(run) == list(range(1, STEPS + 1))
    assert losses == ref_losses and all(torch.equal(weights[k], ref_weights[k]) for k in weights)


@pytest.mark.parametrize("way", list(CORRUPTIONS))
def test_a_corrupt_latest_with_nothing_to_fall_back_to_fails_at_once_naming_the_file(tmp_path, way):
    """keep 1: the corrupt checkpoint is the only one. The resume raises before anything is loaded,
    naming the file; restart_policy ends the run at once (no restart reads the same bytes again)."""
    from launcher.run.checkpoint_manifest import CheckpointCorrupt
    from launcher.runtime import restart_policy

    cfg = make_cfg(every=3, keep=1)
    run = tmp_path / "run"
    train(cfg, make_ctx(run))
    named = CORRUPTIONS[way](RunDir(run).checkpoint_dir(8))
    before = (run / "metrics.jsonl").read_text()
    with pytest.raises(CheckpointCorrupt) as err:
        train(cfg, make_ctx(run, attempt=2))
    assert named in str(err.value), str(err.value)
    assert (run / "metrics.jsonl").read_text() == before  # nothing rewound: the run's record stands
    assert RunDir(run).fallbacks() == [] and not (run / "checkpoints" / "rejected").exists()
    failure = restart_policy.failure_of(err.value, str(err.value), attempt=2, step=None, from_step=8)
    decision = restart_policy.decide(failure, previous=None)
    assert failure.kind == "corrupt_checkpoint" and not decision.restart and decision.kind == "corrupt_checkpoint"


def test_every_rank_loads_what_the_ranks_verified_together(tmp_path, monkeypatch):
    """World 2, as rank 1: rank 0 offers a candidate (its names and sizes checked, the broadcast), rank 1
    hashes only its share of the files, and the gather tells both what either found: a problem found by
    rank 0 alone makes rank 1 pass over that checkpoint too (the next offer), so both load the same one
    or both raise the same CheckpointCorrupt (neither waits for the other)."""
    import torch.distributed as dist

    from launcher.run import checkpoint_manifest
    from launcher.run.checkpoint_manifest import CheckpointCorrupt

    cfg = make_cfg(every=3, keep=2)
    run = tmp_path / "run"
    train(cfg, make_ctx(run))
    rd = RunDir(run)
    offers, rank0_found, hashed = [], [], []

    def broadcast(box, src):
        assert src == 0
        box[0] = offers.pop(0)

    def gather(out, obj):
        out[:] = [rank0_found.pop(0), obj]

    def verify_alone(*_, **__):
        raise AssertionError("rank 1 checked the candidates on its own")

    digest = checkpoint_manifest.digest
    monkeypatch.setattr(checkpoint_manifest, "digest", lambda p: hashed.append(str(p)) or digest(p))
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(dist, "broadcast_object_list", broadcast)
    monkeypatch.setattr(dist, "all_gather_object", gather)
    monkeypatch.setattr(checkpoint_manifest, "resume_point", verify_alone)
    ctx = make_ctx(run, attempt=2)
    ctx.rank, ctx.world_size = 1, 2
    ck = Checkpoint(cfg, ctx, {"model": torch.nn.Linear(4, 16)}, async_save=False)

    def offer(step):
        path = rd.checkpoint_dir(step)
        return {"path": str(path), "files": checkpoint_manifest.listed_files(path), "meta": {"step": step}}

    offers[:] = [offer(8)]
    rank0_found[:] = [[]]
    assert ck._verified_latest() == rd.checkpoint_dir(8) and ck._latest_meta == {"step": 8}
    mine = checkpoint_manifest.shares(offer(8)["files"], 2)[1]
    assert sorted(hashed) == sorted(str(rd.checkpoint_dir(8) / f) for f in mine)
    assert 0 < len(mine) < len(offer(8)["files"])  # a share, not the checkpoint

    offers[:] = [offer(8), offer(6)]  # rank 0 found step 8 changed: it offers step 6 next
    rank0_found[:] = [["checkpoints/step_00000008/state.pt changed"], []]
    assert ck._verified_latest() == rd.checkpoint_dir(6)
    offers[:] = [offer(8), {"corrupt": {"step_00000008": ["checkpoints/step_00000008/state.pt changed"]}}]
    rank0_found[:] = [["checkpoints/step_00000008/state.pt changed"]]
    with pytest.raises(CheckpointCorrupt, match="state.pt changed"):
        ck._verified_latest()
    offers[:] = [{"error": "rank 0 could not verify the checkpoint: OSError: EIO"}]
    with pytest.raises(RuntimeError, match="EIO"):
        ck._verified_latest()
    assert rd.fallbacks() == [] and rd.checkpoint_dir(8).is_dir()  # only rank 0 records and moves


def test_a_loops_checkpoint_is_layout_independent_with_one_module_its_optimizer_and_no_rank_objects():
    """Objects offers universal state (launcher resume on another layout) for one module and its
    optimizer beside any other shared objects; not with per-rank objects, two modules or no optimizer."""
    from launcher.training.checkpoint import Objects

    m = torch.nn.Linear(2, 1)
    opt = torch.optim.AdamW(m.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    ok = Objects({"model": m, "optimizer": opt, "sched": sched}, {}, 0, "cpu")
    assert ok.universal_ok()
    assert set(ok.universal_state()["model"]) == {"weight", "bias"}
    assert not Objects({"model": m, "optimizer": opt}, {"sampler": sched}, 0, "cpu").universal_ok()
    assert not Objects({"a": m, "b": torch.nn.Linear(1, 1), "optimizer": opt}, {}, 0, "cpu").universal_ok()
    assert not Objects({"model": m}, {}, 0, "cpu").universal_ok()
    assert Objects({"model": m}, {}, 0, "cpu").universal_state() is None


def test_each_rank_hashes_a_share_of_the_checkpoint_none_more_than_its_part_and_the_largest_file():
    """At resume the digests are split across the ranks (checkpoint_manifest.shares): every file once,
    the same split on every rank, and no rank hashing more than total / world + the largest file."""
    from launcher.run.checkpoint_manifest import shares

    sizes = {f"shard_{i:03d}.pt": 1000 + 37 * (i % 11) for i in range(200)}
    sizes.update({"meta.json": 5, "big.pt": 9000})
    listed = {k: {"size": v, "sha256": "x"} for k, v in sizes.items()}
    for world in (1, 2, 7, 64, 300):
        split = shares(listed, world)
        assert len(split) == world and sorted(f for part in split for f in part) == sorted(listed)
        assert split == shares(dict(reversed(list(listed.items()))), world)  # the order read does not matter
        most = max(sum(sizes[f] for f in part) for part in split)
        assert most <= sum(sizes.values()) / world + max(sizes.values()), (world, most)
    assert shares(listed, 1) == [sorted(listed, key=lambda f: (-sizes[f], f))]


def test_a_blocking_save_feeds_the_hang_watch_file_by_file(tmp_path):
    """A save that blocks the training thread (the time limit's, async_save off) is progress: each file
    it writes or hashes beats the hang watch, so a large checkpoint does not look like a hang (before:
    one beat once the whole save was done). A writer thread never beats it (``_write(feed=False)``)."""
    import threading

    beats = []

    class Watch:
        step = None

        def beat(self, step=None):
            beats.append(threading.current_thread() is threading.main_thread())

    ctx = make_ctx(tmp_path / "run")
    ctx.watch = Watch()
    model = torch.nn.Linear(4, 16)
    state = {"model": model, "optimizer": torch.optim.AdamW(model.parameters())}
    ck = Checkpoint(make_cfg(every=0, keep=2), ctx, state, async_save=False)
    ck.save(2, [], block=True)
    files = [p for p in ctx.rundir.checkpoint_dir(2).rglob("*") if p.is_file()]
    assert len(beats) >= 4 and all(beats), (beats, files)  # state, RNG, meta, a universal file, then the end
    assert len(beats) <= len(files) + 1
