"""A checkpoint's checkpoint.json and the choice of the checkpoint to resume from
(launcher.run.checkpoint_manifest), on checkpoint dirs built by hand (no torch): what counts as
intact, what a pointer may name, and when the choice falls back or fails."""
import json

import pytest

from launcher.run import checkpoint_manifest as cm
from launcher.run.checkpoint_manifest import CheckpointCorrupt
from launcher.run.rundir import RunDir


def checkpoint(rd: RunDir, step: int, files=None, marks=()) -> None:
    """A committed checkpoint after ``step`` (its manifest written as the committing rank does)."""
    d = rd.checkpoint_dir(step)
    d.mkdir(parents=True)
    for name, data in {"model.pt": b"m" * (100 + step), "meta.json": json.dumps({"step": step}).encode(),
                       **(files or {})}.items():
        (d / name).parent.mkdir(parents=True, exist_ok=True)
        (d / name).write_bytes(data)
    cm.write(d, step, [d / m for m in marks])
    rd.set_latest(d)


@pytest.fixture
def rd(tmp_path):
    rd = RunDir(tmp_path / "run")
    rd.path.mkdir()
    return rd


def test_no_latest_is_a_fresh_start_and_an_intact_latest_is_resumed(rd):
    assert cm.resume_point(rd) == cm.ResumePoint(None)
    checkpoint(rd, 4, {"zero/shard_0.pt": b"s"})  # an engine's own files, in subdirs too
    assert json.loads((rd.checkpoint_dir(4) / "checkpoint.json").read_text())["files"]["zero/shard_0.pt"] == {
        "size": 1, "sha256": cm.digest(rd.checkpoint_dir(4) / "zero/shard_0.pt")["sha256"]}
    assert cm.resume_point(rd) == cm.ResumePoint(rd.checkpoint_dir(4))


def test_a_done_marks_digests_are_used_and_an_empty_mark_is_no_digest(rd):
    d = rd.checkpoint_partial(2)
    d.mkdir(parents=True)
    (d / "model.pt").write_bytes(b"abc")
    (d / "done_rank_00001").touch()  # a mark without digests: the file is hashed by the committing rank
    cm.mark_done(d / "done_rank_00000", {"model.pt": {"size": 3, "sha256": "from-the-writer"}})
    manifest = cm.write(d, 2, [d / "done_rank_00000", d / "done_rank_00001"])
    assert manifest["files"]["model.pt"]["sha256"] == "from-the-writer"  # not hashed again
    assert manifest["files"]["done_rank_00001"] == cm.digest(d / "done_rank_00001")
    assert not list(d.glob("done_rank_*.tmp")) and not list(d.glob(".done*"))  # no stray mark


@pytest.mark.parametrize("text, problem", [
    ("../elsewhere", "names '../elsewhere', not a step_<n> checkpoint"),
    ("", "names '', not a step_<n> checkpoint"),
    ("step_00000009", "names step_00000009, which does not exist"),
])
def test_a_latest_naming_no_checkpoint_falls_back_or_fails(rd, text, problem):
    checkpoint(rd, 4)
    (rd.path / RunDir.LATEST).write_text(text)
    point = cm.resume_point(rd)
    assert point.path == rd.checkpoint_dir(4) and point.fell_back
    assert any(problem in p for ps in point.rejected.values() for p in ps), point.rejected
    (rd.checkpoint_dir(4) / "model.pt").write_bytes(b"x")  # and with nothing intact to fall back to
    with pytest.raises(CheckpointCorrupt, match="step_00000004/model.pt is 1 bytes"):
        cm.resume_point(rd)


def test_a_checkpoint_without_or_with_a_broken_manifest_is_rejected(rd):
    checkpoint(rd, 2)
    checkpoint(rd, 4)
    (rd.checkpoint_dir(4) / "checkpoint.json").write_text("{not json")
    point = cm.resume_point(rd)
    assert point.path == rd.checkpoint_dir(2)
    assert point.rejected == {"step_00000004": ["checkpoints/step_00000004/checkpoint.json unreadable "
                                                "(JSONDecodeError)"]}
    (rd.checkpoint_dir(2) / "checkpoint.json").unlink()
    with pytest.raises(CheckpointCorrupt, match="step_00000002/checkpoint.json missing"):
        cm.resume_point(rd)


def test_only_checkpoints_before_the_one_latest_names_are_candidates(rd):
    checkpoint(rd, 2)
    checkpoint(rd, 6)
    checkpoint(rd, 4)  # latest -> 4: 6 is later (a job that died before moving latest): not a fallback
    (rd.checkpoint_dir(4) / "model.pt").write_bytes(b"")
    assert cm.resume_point(rd).path == rd.checkpoint_dir(2)


def test_meta_saying_another_step_is_caught(rd):
    checkpoint(rd, 4, {"meta.json": json.dumps({"step": 3}).encode()})
    with pytest.raises(CheckpointCorrupt, match="meta.json says step 3, checkpoint.json step 4"):
        cm.resume_point(rd)


def test_adopt_moves_the_rejected_aside_points_latest_and_records(rd):
    checkpoint(rd, 2)
    checkpoint(rd, 4)
    (rd.checkpoint_dir(4) / "model.pt").write_bytes(b"truncated")
    point = cm.resume_point(rd)
    cm.adopt(rd, point, attempt=3)
    assert rd.latest_checkpoint() == rd.checkpoint_dir(2) and rd.checkpoints() == [rd.checkpoint_dir(2)]
    moved = rd.rejected_checkpoint(rd.checkpoint_dir(4), 3)
    assert moved.is_dir() and (moved / "model.pt").read_bytes() == b"truncated"
    (row,) = rd.fallbacks()
    assert row["attempt"] == 3 and row["resumed_from"] == "step_00000002" and row["from_step"] == 2
    assert row["rejected"] == {"step_00000004": ["checkpoints/step_00000004/model.pt is 9 bytes, checkpoint.json "
                                                 "says 104 (truncated)"]}
    assert row["moved"] == {"step_00000004": "checkpoints/rejected/step_00000004.attempt_3"}
    assert rd.restarts() == []  # a fallback is no restart
    cm.adopt(rd, cm.resume_point(rd), attempt=4)  # nothing rejected: nothing recorded
    assert len(rd.fallbacks()) == 1
