"""A launch from a tree unchanged since its last snapshot links that snapshot's files; any change (a
file's bytes, the secrets the launch knows, the cache entry itself) takes a full copy again."""
import json
import os

import pytest

from launcher.archive import snapshot, snapshot_reuse


@pytest.fixture
def tree(tmp_path, monkeypatch):
    monkeypatch.setenv("LAUNCHER_BYTECODE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    # the files here were written a moment ago: trusted at once (the racy rule has its own test)
    monkeypatch.setattr(snapshot_reuse, "RACY_NS", 0)
    snapshot.cache_secret.cache_clear()
    root = tmp_path / "repo"
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "train.py").write_text("LR = 0.1\n")
    (root / "conf.yaml").write_text("lr: 0.1\n")
    yield root
    snapshot.cache_secret.cache_clear()


def _take(root, n, known=None):
    dest = root.parent / f"sweep{n}" / "code"
    info = snapshot.take(root, dest, known=known or {}, exclude=[root.parent / f"sweep{n}"], tree_included=True)
    return dest, info


def _inode(path):
    return os.stat(path).st_ino


def test_an_unchanged_tree_is_linked_and_its_records_written_afresh(tree):
    first, info1 = _take(tree, 1)
    second, info2 = _take(tree, 2)
    assert _inode(second / "pkg" / "train.py") == _inode(first / "pkg" / "train.py")
    pyc = next((second / "pkg" / "__pycache__").glob("train.*.pyc"))  # its bytecode linked with it
    assert _inode(pyc) == _inode(next((first / "pkg" / "__pycache__").glob("train.*.pyc")))
    assert _inode(second / snapshot.INFO_FILE) != _inode(first / snapshot.INFO_FILE)
    assert (info2["sha256"], info2["files"]) == (info1["sha256"], info1["files"])
    assert json.loads((second / snapshot.INFO_FILE).read_text())["sha256"] == info1["sha256"]


def test_a_changed_file_is_copied_with_its_new_bytes(tree):
    first, info1 = _take(tree, 1)
    (tree / "pkg" / "train.py").write_text("LR = 0.25\n")
    second, info2 = _take(tree, 2)
    assert (second / "pkg" / "train.py").read_text() == "LR = 0.25\n"
    assert _inode(second / "conf.yaml") != _inode(first / "conf.yaml")  # a full copy
    assert info2["sha256"] != info1["sha256"]
    third, _ = _take(tree, 3)  # and that snapshot is the next one's to link
    assert _inode(third / "pkg" / "train.py") == _inode(second / "pkg" / "train.py")


def test_another_known_secret_a_tampered_entry_or_a_deleted_snapshot_takes_a_copy(tree):
    import shutil

    (tree / "pkg" / "keys.py").write_text("TOKEN = 'hunter22'\n")
    first, info1 = _take(tree, 1)
    assert "pkg/keys.py" not in info1["held_secret"]
    second, info2 = _take(tree, 2, known={"env.API_TOKEN": "hunter22"})  # the file holds it now: left out
    assert "pkg/keys.py" in info2["held_secret"] and not (second / "pkg" / "keys.py").exists()
    assert _inode(second / "conf.yaml") != _inode(first / "conf.yaml")

    entry = next((tree.parent / "cache" / "snapshots").glob("*.json"))
    data = json.loads(entry.read_text())
    entry.write_text(json.dumps({**data, "dest": str(first)}))  # pointed elsewhere, its signature stale
    third, _ = _take(tree, 3, known={"env.API_TOKEN": "hunter22"})
    assert _inode(third / "conf.yaml") not in (_inode(first / "conf.yaml"), _inode(second / "conf.yaml"))

    shutil.rmtree(third.parent)  # the snapshot the entry names is gone: copied again, nothing half made
    fourth, info4 = _take(tree, 4, known={"env.API_TOKEN": "hunter22"})
    assert (fourth / "conf.yaml").read_text() == "lr: 0.1\n" and info4["sha256"] == info2["sha256"]


def test_no_cache_no_reuse(tree, monkeypatch):
    monkeypatch.setenv("LAUNCHER_BYTECODE_CACHE", "off")
    first, _ = _take(tree, 1)
    second, _ = _take(tree, 2)
    assert _inode(second / "conf.yaml") != _inode(first / "conf.yaml")
    assert snapshot_reuse.previous(snapshot.cache_base(), tree, snapshot.cache_secret()) is None


def test_a_tree_changed_a_moment_before_its_snapshot_is_not_named_for_reuse(tree, monkeypatch):
    """A file changed within RACY_NS of the snapshot's stat could change again with the same timestamps
    (coarse clocks): that snapshot is not offered to the next launch, which copies."""
    monkeypatch.setattr(snapshot_reuse, "RACY_NS", 3600 * 10**9)  # everything here is that fresh
    first, _ = _take(tree, 1)
    assert not (tree.parent / "cache" / "snapshots").exists()
    second, _ = _take(tree, 2)
    assert _inode(second / "conf.yaml") != _inode(first / "conf.yaml")
