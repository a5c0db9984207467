"""The seal covers what can run or be resumed (issue 27): every file, symlink (as a link, never
followed), directory and checkpoint of a run dir, and its code snapshot's tree; a removed or replaced
manifest is found and never sealed over; reproduce refuses a run it cannot verify; the snapshot takes
no symlink out of the tree and none into a credential dir. Each class: the reported attack, then one
more case of it that no report listed (named "unlisted")."""
import json
import os
import shutil
import stat
from pathlib import Path

import pytest

from launcher.archive import registry, snapshot
from launcher.backends import JobState
from launcher.cli.main import main
from launcher.run.outcome import record_lost_outcome
from launcher.run.rundir import RunDir, SweepDir, tree_sha256
from launcher.run.status import Status
from launcher.submit import reproduce as reproduce_mod


def sealed_run(root: Path, index: int = 0, snap: Path = None) -> RunDir:
    """A finished run of sweep ``s1`` under ``root`` (its code snapshot ``snap``), sealed."""
    sweep = SweepDir(root / "s1")
    rd = sweep.run(index)
    rd.path.mkdir(parents=True)
    rd.write_config({"optim": {"lr": 0.001}})
    if snap is not None:
        rd.write_code({"commit": None}, "", {"path": str(snap)})
    rd.write_run({"run_id": sweep.run_id(index), "sweep_id": sweep.sweep_id, "index": index})
    rd.set_status(Status.running)
    rd.rewrite_metrics([{"step": 1, "loss": 1.0}])
    rd.checkpoint_dir(4).mkdir(parents=True)
    (rd.checkpoint_dir(4) / "checkpoint.json").write_text('{"files": {}}')
    with open(rd.checkpoint_dir(4) / "model.pt", "wb") as f:  # a large shard: sealed by its size
        f.truncate(2 << 20)
    rd.set_latest(rd.checkpoint_dir(4))
    assert rd.finish(Status.completed, exit_code=0)
    assert rd.verify() == []
    return rd


def writable(path: Path) -> Path:
    os.chmod(path, path.stat().st_mode | stat.S_IWUSR)
    return path


def code_snapshot(tmp_path: Path) -> Path:
    snap = tmp_path / "runs" / "s1" / "code"
    (snap / "pkg").mkdir(parents=True)
    (snap / "pkg" / "train.py").write_text("print('train')\n")
    return snap


# ---- H1: what is added to the code snapshot -----------------------------------------------------

def test_a_symlinked_dir_planted_in_the_snapshot_breaks_the_seal(tmp_path):
    snap = code_snapshot(tmp_path)
    rd = sealed_run(tmp_path / "runs", snap=snap)
    evil = tmp_path / "elsewhere" / "sitecustomize"
    evil.mkdir(parents=True)
    (evil / "__init__.py").write_text("open('PWNED', 'w')\n")
    before = tree_sha256(snap)
    os.symlink(evil, snap / "sitecustomize")
    assert tree_sha256(snap) != before
    problems = rd.verify()
    assert f"code snapshot {snap} changed" in problems
    assert any("holds a symlink sitecustomize" in p for p in problems), problems
    assert main(["show", str(rd.path), "--root", str(tmp_path / "runs"), "--json"]) == 1


def test_unlisted_a_snapshot_file_swapped_for_a_link_to_an_identical_copy(tmp_path):
    """Same content, so a digest that follows links cannot see it; but the copy outside can be edited
    at will afterwards."""
    snap = code_snapshot(tmp_path)
    rd = sealed_run(tmp_path / "runs", snap=snap)
    outside = tmp_path / "outside_train.py"
    shutil.copy(snap / "pkg" / "train.py", outside)
    (snap / "pkg" / "train.py").unlink()
    os.symlink(outside, snap / "pkg" / "train.py")
    assert f"code snapshot {snap} changed" in rd.verify()


# ---- M7: the seal never follows a symlink out of the run dir ---------------------------------------

def test_sealing_and_reopening_never_touch_a_linked_files_mode_nor_read_it(tmp_path):
    outside = tmp_path / "data.bin"
    outside.write_text("data")
    os.chmod(outside, 0o644)
    rd = SweepDir(tmp_path / "runs" / "s1").run(0)
    rd.path.mkdir(parents=True)
    rd.write_run({"run_id": "s1-0"})
    os.symlink(outside, rd.path / "data-link.bin")
    rd.finish(Status.completed)
    assert stat.S_IMODE(outside.stat().st_mode) == 0o644  # not made read-only by the seal
    manifest = json.loads((rd.path / "manifest.json").read_text())
    assert manifest["links"] == {"data-link.bin": str(outside)} and "data-link.bin" not in manifest["files"]
    os.chmod(outside, 0o444)
    rd.reopen(1)  # launcher resume
    assert stat.S_IMODE(outside.stat().st_mode) == 0o444  # not made writable by resume


def test_unlisted_a_linked_directory_and_a_dangling_link_are_sealed_as_links(tmp_path):
    data = tmp_path / "dataset"
    data.mkdir()
    (data / "shard0").write_text("rows")
    os.chmod(data / "shard0", 0o644)
    rd = SweepDir(tmp_path / "runs" / "s1").run(0)
    rd.path.mkdir(parents=True)
    rd.write_run({"run_id": "s1-0"})
    os.symlink(data, rd.path / "data")
    os.symlink(tmp_path / "gone", rd.path / "dangling")
    rd.finish(Status.completed)
    manifest = json.loads((rd.path / "manifest.json").read_text())
    assert manifest["links"] == {"data": str(data), "dangling": str(tmp_path / "gone")}
    assert not any(k.startswith("data/") for k in manifest["files"])  # never descended into
    assert stat.S_IMODE((data / "shard0").stat().st_mode) == 0o644
    (data / "shard0").write_text("changed rows")  # the dataset is not the run's: no seal over it
    assert rd.verify() == []


# ---- L7: anything added to a sealed run dir -----------------------------------------------------

@pytest.mark.parametrize("plant,expect", [
    ("linked_dir", "linked_dir added after the seal (a symlink to "),
    ("tmp_file", "ranks/rank_9.error.tmp added after the seal"),
    ("empty_dir", "empty added after the seal (a directory)"),
])
def test_a_symlinked_dir_a_tmp_file_or_an_empty_dir_added_is_found(tmp_path, plant, expect):
    rd = sealed_run(tmp_path / "runs")
    if plant == "linked_dir":
        os.symlink(tmp_path, rd.path / "linked_dir")
    elif plant == "tmp_file":
        (rd.path / "ranks").mkdir()
        (rd.path / "ranks" / "rank_9.error.tmp").write_text("x")
    else:
        (rd.path / "empty").mkdir()
    assert any(p.startswith(expect) for p in rd.verify()), rd.verify()


def test_unlisted_a_sealed_symlink_re_pointed_or_a_file_turned_into_a_link(tmp_path):
    rd = SweepDir(tmp_path / "runs" / "s1").run(0)
    rd.path.mkdir(parents=True)
    rd.write_run({"run_id": "s1-0"})
    os.symlink("wandb/run-1/logs/debug.log", rd.path / "debug.log")
    rd.write_config({"optim": {"lr": 0.001}})
    rd.finish(Status.completed)
    (rd.path / "debug.log").unlink()
    os.symlink("/etc/passwd", rd.path / "debug.log")
    copy = tmp_path / "config.yaml"
    shutil.copy(rd.path / "config.yaml", copy)
    (rd.path / "config.yaml").unlink()
    os.symlink(copy, rd.path / "config.yaml")  # same bytes behind it
    assert rd.verify() == [
        "config.yaml changed (a file when sealed, a symlink now)",
        "debug.log changed (a symlink to /etc/passwd, sealed pointing to wandb/run-1/logs/debug.log)"]


# ---- M9: checkpoints ----------------------------------------------------------------------------

def test_a_checkpoint_added_and_latest_re_pointed_or_the_sealed_one_deleted_is_found(tmp_path):
    rd = sealed_run(tmp_path / "runs")
    ckpts = writable(rd.path / "checkpoints")
    shutil.copytree(rd.checkpoint_dir(4), rd.checkpoint_dir(99))
    writable(ckpts / "latest")
    rd.set_latest(rd.checkpoint_dir(99))
    shutil.rmtree(rd.checkpoint_dir(4))
    assert rd.verify() == ["checkpoint step_00000004 missing", "checkpoint step_00000099 added after the seal",
                           "checkpoints/latest re-pointed: step_00000004 when sealed, step_00000099 now"]


def test_unlisted_a_checkpoint_shard_truncated_or_its_record_edited(tmp_path):
    rd = sealed_run(tmp_path / "runs")
    os.truncate(writable(rd.checkpoint_dir(4) / "model.pt"), 100)
    writable(rd.checkpoint_dir(4) / "checkpoint.json").write_text('{"files": {"model.pt": "forged"}}')
    assert rd.verify() == ["checkpoints/step_00000004/checkpoint.json changed",
                           "checkpoints/step_00000004/model.pt changed"]


# ---- M10: a removed manifest (and status) is tampering, never pending, never sealed again ---------

def test_deleting_manifest_and_status_is_found_and_never_sealed_over(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    root = tmp_path / "runs"
    rd = sealed_run(root)
    cfg = writable(rd.path / "config.yaml")
    cfg.write_text(cfg.read_text().replace("0.001", "0.5"))
    (rd.path / "manifest.json").unlink()
    (rd.path / "status.json").unlink()
    problems = rd.verify()
    assert len(problems) == 1 and problems[0].startswith("manifest.json missing: the run was sealed "), problems
    assert registry.reindex(root) == 1
    (row,) = registry.list_runs(root, refresh=False)
    assert row["error"] == problems[0]  # the listing says so: not a plain pending run
    capsys.readouterr()
    assert main(["runs", "--root", str(root)]) == 0
    assert "tampered" in capsys.readouterr().out
    # the commands that settle runs (launcher status, resume) see a job that ended: nothing recorded
    record_lost_outcome(rd, JobState(Status.completed, "COMPLETED"))
    assert not (rd.path / "manifest.json").exists() and not (rd.path / "status.json").exists()
    assert rd.seal() == {} and not (rd.path / "manifest.json").exists()
    assert rd.verify() == problems
    assert main(["show", str(rd.path), "--root", str(root), "--json"]) == 1


def test_unlisted_a_manifest_replaced_by_a_forged_one(tmp_path):
    rd = sealed_run(tmp_path / "runs")
    cfg = writable(rd.path / "config.yaml")
    cfg.write_text(cfg.read_text().replace("0.001", "0.5"))
    manifest = json.loads((rd.path / "manifest.json").read_text())
    manifest["files"]["config.yaml"] = __import__("hashlib").sha256(cfg.read_bytes()).hexdigest()
    (rd.path / "manifest.json").unlink()
    (rd.path / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    (problem,) = rd.verify()
    assert problem.startswith("manifest.json is not the manifest the run was sealed with"), problem


def test_a_started_run_without_its_status_does_not_read_as_intact(tmp_path):
    rd = SweepDir(tmp_path / "runs" / "s1").run(0)
    rd.path.mkdir(parents=True)
    rd.write_run({"run_id": "s1-0"})
    rd.set_status(Status.running)
    rd.rewrite_metrics([{"step": 1, "loss": 1.0}])
    (rd.path / "status.json").unlink()
    assert rd.verify() == ["status.json missing although the run started (metrics.jsonl exist)"]


def test_resume_reopens_and_the_next_attempt_is_sealed_again(tmp_path):
    """The mark is the current seal's: reopening (launcher resume) removes it with the manifest."""
    rd = sealed_run(tmp_path / "runs")
    rd.reopen(1)
    assert rd.seal_mark() is None and rd.verify() == []
    assert rd.set_status(Status.running) and rd.finish(Status.completed, exit_code=0)
    assert rd.seal_mark() is not None and rd.verify() == []


# ---- L12: reproduce of a run it cannot verify ---------------------------------------------------

def _forged_elsewhere(tmp_path: Path) -> RunDir:
    """A hand-made run dir outside any runs root: a copy of a real run, its snapshot a modified copy,
    and a manifest written with RunDir.seal()."""
    snap = code_snapshot(tmp_path)
    real = sealed_run(tmp_path / "runs", snap=snap)
    fake = tmp_path / "elsewhere" / "s1" / "0"
    shutil.copytree(real.path, fake)
    evil = tmp_path / "elsewhere" / "code"
    shutil.copytree(snap, evil)
    (evil / "pkg" / "train.py").write_text("print('evil')\n")
    for p in (fake / "manifest.json", fake / "code" / "snapshot.json"):
        writable(p)
    (fake / "manifest.json").unlink()
    (fake / "code" / "snapshot.json").write_text(json.dumps({"path": str(evil)}))
    forged = RunDir(fake)
    assert forged.seal() and forged.verify() == []  # the forged manifest matches
    return forged


def test_reproduce_refuses_a_hand_made_run_outside_the_root(tmp_path, capsys, monkeypatch):
    forged = _forged_elsewhere(tmp_path)
    monkeypatch.setenv("LAUNCHER_RUNS", str(tmp_path / "runs"))
    problems = reproduce_mod.provenance_problems(forged.path, [tmp_path / "runs"])
    assert problems[0].startswith(f"{forged.path} lies outside the known runs roots")
    assert problems[1].startswith(f"its code snapshot {tmp_path / 'elsewhere' / 'code'} lies outside")
    launched = []
    monkeypatch.setattr(reproduce_mod, "reproduce", lambda *a, **kw: launched.append(kw))
    assert main(["reproduce", str(forged.path), "--root", str(tmp_path / "runs")]) == 2
    err = capsys.readouterr().err
    assert "lies outside the known runs roots" in err and "--trust-unverified" in err and not launched
    # the override: reproduced, and what did not verify recorded in the reproduction's run.json
    assert main(["reproduce", str(forged.path), "--root", str(tmp_path / "runs"), "--trust-unverified"]) == 0
    assert launched[0]["unverified"] == problems
    assert "warning: reproducing an unverified archive" in capsys.readouterr().err


def test_reproduce_records_trusted_unverified_in_the_new_runs_record(tmp_path, monkeypatch):
    forged = _forged_elsewhere(tmp_path)
    seen = {}
    monkeypatch.setattr(reproduce_mod, "archived_point", lambda *a, **kw: type("P", (), {"cfg": None})())
    monkeypatch.setattr(reproduce_mod, "topology_warnings", lambda *a: [])
    monkeypatch.setattr(reproduce_mod.pipeline, "launch", lambda points, **kw: seen.update(kw))
    monkeypatch.setattr(reproduce_mod, "finish", lambda *a: None)
    reproduce_mod.reproduce(forged.path, [], unverified=["it lies outside"])
    assert seen["extra_meta"]["trusted_unverified"] == ["it lies outside"]


def test_unlisted_reproduce_refuses_a_copy_that_claims_another_runs_id(tmp_path, capsys):
    """Inside the root and intact, but `cp -a s1/0 s1/7`: its run.json names run s1-0."""
    root = tmp_path / "runs"
    rd = sealed_run(root)
    shutil.copytree(rd.path, rd.path.parent / "7")
    assert RunDir(rd.path.parent / "7").verify() == []
    assert reproduce_mod.provenance_problems(rd.path, [root]) == []
    assert reproduce_mod.provenance_problems(rd.path.parent / "7", [root]) == [
        "its run.json names run s1-0, but the dir is that of run s1-7"]
    assert main(["reproduce", str(rd.path.parent / "7"), "--root", str(root)]) == 2
    assert "names run s1-0" in capsys.readouterr().err


# ---- M6: the snapshot takes no link out of the tree, none into a credential dir -------------------

def _tree(tmp_path: Path) -> Path:
    """A tree outside git: the snapshot takes its .py/.yaml/... files (the links among them too)."""
    src = tmp_path / "proj"
    src.mkdir()
    (src / "train.py").write_text("print('hi')\n")
    return src


def test_a_link_to_a_docker_config_is_refused_by_the_snapshot(tmp_path):
    src = _tree(tmp_path)
    home = tmp_path / "home"
    (home / ".docker").mkdir(parents=True)
    (home / ".docker" / "config.json").write_text('{"auths": {"r": {"auth": "PLANTEDdocker11"}}}')
    os.symlink(home / ".docker" / "config.json", src / "docker-config.yaml")  # its own name looks harmless
    info = snapshot.take(src, tmp_path / "s" / "code", known={})
    assert info["refused"] == ["docker-config.yaml"] and info["files"] == 1
    assert not (tmp_path / "s" / "code" / "docker-config.yaml").exists()
    assert not [p for p in (tmp_path / "s").rglob("*") if p.is_file() and b"PLANTED" in p.read_bytes()]


def test_unlisted_links_into_an_in_tree_gnupg_dir_or_out_of_the_tree(tmp_path):
    src = _tree(tmp_path)
    (src / ".gnupg").mkdir()
    (src / ".gnupg" / "pubring.yaml").write_text("key: 1\n")
    os.symlink(".gnupg/pubring.yaml", src / "ring.yaml")  # a relative link inside the tree
    outside = tmp_path / "shared_cfg.yaml"
    outside.write_text("lr: 1\n")
    os.symlink(outside, src / "cfg.yaml")
    info = snapshot.take(src, tmp_path / "s" / "code", known={})
    assert sorted(info["refused"]) == [".gnupg/pubring.yaml", "ring.yaml"]
    assert info["links_out"] == {"cfg.yaml": str(outside)} and info["files"] == 1
    (warning,) = snapshot.left_out_warnings(info)
    assert "cfg.yaml: a symlink to" in warning and "outside the source tree" in warning
    assert not [p for p in (tmp_path / "s" / "code").rglob("*") if p.is_symlink()]


def test_a_fifo_sealed_stays_intact(tmp_path):
    """Not a file, link or directory: sealed as what it is (no false alarm at every check)."""
    rd = SweepDir(tmp_path / "runs" / "s1").run(0)
    rd.path.mkdir(parents=True)
    rd.write_run({"run_id": "s1-0"})
    os.mkfifo(rd.path / "pipe")
    rd.finish(Status.completed)
    assert rd.verify() == []
    os.unlink(rd.path / "pipe")
    assert rd.verify() == ["pipe missing (a special file)"]


def test_the_seal_takes_a_checkpoint_files_digest_from_its_checkpoint_json(tmp_path, monkeypatch):
    """The seal runs at the end of the job, on rank 0: a checkpoint file its checkpoint.json already
    names with this size is not read again (every rank's RNG file and done mark, thousands of them);
    one the record does not match is hashed; verify hashes every one (a byte changed since is found)."""
    import hashlib

    from launcher.run import sealing as seal_mod

    rd = RunDir(tmp_path / "run")
    rd.path.mkdir()
    rd.write_run({"run_id": "x-0"})
    rd.set_status(Status.running)
    ck = rd.checkpoint_dir(2)
    ck.mkdir(parents=True)
    for name, data in (("rng_rank_00000.pt", b"rng0"), ("rng_rank_00001.pt", b"rng1"), ("meta.json", b"{}")):
        (ck / name).write_bytes(data)
    recorded = {n: {"size": (ck / n).stat().st_size, "sha256": hashlib.sha256((ck / n).read_bytes()).hexdigest()}
                for n in ("rng_rank_00000.pt", "rng_rank_00001.pt")}
    recorded["meta.json"] = {"size": 99, "sha256": "0" * 64}  # another size: hashed, not taken
    (ck / "checkpoint.json").write_text(json.dumps({"step": 2, "files": recorded}))
    rd.set_latest(ck)
    hashed = []
    real = seal_mod.file_sha256
    monkeypatch.setattr(seal_mod, "file_sha256", lambda p: hashed.append(Path(p).name) or real(p))
    assert rd.finish(Status.completed, exit_code=0)
    assert "rng_rank_00000.pt" not in hashed and "rng_rank_00001.pt" not in hashed and "meta.json" in hashed
    sealed = json.loads((rd.path / "manifest.json").read_text())["checkpoint_files"]
    assert sealed["checkpoints/step_00000002/rng_rank_00001.pt"] == "sha256:" + recorded["rng_rank_00001.pt"]["sha256"]
    assert rd.verify() == []
    os.chmod(ck / "rng_rank_00001.pt", 0o644)
    (ck / "rng_rank_00001.pt").write_bytes(b"rngX")  # same size, another byte
    assert rd.verify() == ["checkpoints/step_00000002/rng_rank_00001.pt changed"]


def test_a_job_started_for_an_ended_run_writes_nothing_into_it(tmp_path, monkeypatch):
    """A point cancelled while queued is sealed at once; its job can still start before the scheduler
    drops it (the README's sweep, `launcher cancel` then `launcher retry --failed`: retry refused the
    point as tampered, its ranks/master_addr.json written after the seal). Such a job reads and leaves."""
    from unittest import mock

    from launcher.runtime import attempt as attempt_mod

    rd = sealed_run(tmp_path / "runs")
    asked = {}
    detect = attempt_mod.dist_env.detect

    def recording_detect(**kw):
        asked.update(kw)
        return detect(**kw)

    monkeypatch.setattr(attempt_mod.dist_env, "detect", recording_detect)
    job = dict(SUBMITIT_EXECUTOR="local", SUBMITIT_LOCAL_JOB_ID="4242", SUBMITIT_LOCAL_NTASKS="1",
               SUBMITIT_LOCAL_JOB_NUM_NODES="1", SUBMITIT_LOCAL_NODEID="0", SUBMITIT_LOCAL_GLOBALID="0",
               SUBMITIT_LOCAL_LOCALID="0")  # rank 0 of a local job
    with mock.patch.dict(os.environ, job):  # (the attempt exports RANK, WORLD_SIZE, ... into this process)
        with attempt_mod.attempt(rd) as a:
            assert a.ended
    assert asked["addr_file"] is None  # rank 0 leaves no address for the others in the sealed dir
    assert rd.verify() == []
