"""launcher.training.jit_ops: DeepSpeed's JIT ops built and loaded node-locally, seeded from and
published to the shared cache, a dead builder's lock cleared, the user's TORCH_EXTENSIONS_DIR kept."""
from __future__ import annotations

import os
import time
from pathlib import Path

from launcher.training import jit_ops


def _build(root: Path, name: str = "cpu_adam", lock: bool = False) -> Path:
    op = root / name
    op.mkdir(parents=True)
    (op / f"{name}.so").write_bytes(b"\x7fELF op")
    (op / "build.ninja").write_text("rule cxx\n")
    if lock:
        (op / "lock").write_text("")
    return op


def test_the_users_extensions_dir_is_kept(tmp_path):
    env = {"TORCH_EXTENSIONS_DIR": "/scratch/mine"}
    assert jit_ops.prepare("cpu_adam", env, shared=tmp_path / "shared", local=tmp_path / "local") is None
    assert env == {"TORCH_EXTENSIONS_DIR": "/scratch/mine"}
    assert not (tmp_path / "local").exists()


def test_a_node_is_seeded_with_the_shared_build_and_builds_there(tmp_path):
    shared, local = tmp_path / "shared", tmp_path / "local"
    src = _build(shared)
    old = time.time() - 3600
    os.utime(src / "cpu_adam.so", (old, old))
    env: dict = {}
    assert jit_ops.prepare("cpu_adam", env, shared=shared, local=local) == local
    assert env["TORCH_EXTENSIONS_DIR"] == str(local)
    assert (local / "cpu_adam" / "cpu_adam.so").read_bytes() == b"\x7fELF op"
    # the mtimes come along, so ninja finds the copy up to date instead of building again
    assert int((local / "cpu_adam" / "cpu_adam.so").stat().st_mtime) == int(old)
    assert not [p for p in local.iterdir() if p.name.startswith(".")]  # no half copy left


def test_a_shared_build_in_progress_is_not_copied(tmp_path):
    shared, local = tmp_path / "shared", tmp_path / "local"
    _build(shared, lock=True)  # another node is building there
    env: dict = {}
    assert jit_ops.prepare("cpu_adam", env, shared=shared, local=local) == local
    assert not (local / "cpu_adam").exists()  # torch builds it here, under a node-local lock


def test_a_dead_builders_lock_is_cleared_a_live_ones_kept(tmp_path):
    op = _build(tmp_path / "local", lock=True)
    assert not jit_ops.clear_stale_lock(op)
    assert (op / "lock").exists()
    assert jit_ops.clear_stale_lock(op, now=time.time() + jit_ops.STALE_LOCK_S + 1)
    assert not (op / "lock").exists()


def test_a_nodes_build_is_published_once_never_over_anothers(tmp_path):
    shared, local = tmp_path / "shared", tmp_path / "local"
    _build(local)
    assert jit_ops.publish("cpu_adam", local, shared=shared)
    assert (shared / "cpu_adam" / "cpu_adam.so").is_file()
    assert not jit_ops.publish("cpu_adam", local, shared=shared)  # there already
    partial = tmp_path / "shared2" / "cpu_adam"
    partial.mkdir(parents=True)
    (partial / "lock").write_text("")
    assert not jit_ops.publish("cpu_adam", local, shared=tmp_path / "shared2")
    assert sorted(p.name for p in partial.iterdir()) == ["lock"]
    assert not jit_ops.publish("cpu_adam", None, shared=shared)  # the user's own dir: nothing published


def test_a_nodes_build_older_than_the_shared_one_of_the_same_install_is_replaced(tmp_path):
    # a venv made again at the same path: the node's build predates its headers, ninja would build again
    shared, local = tmp_path / "shared", tmp_path / "local"
    mine = _build(local)
    (mine / "cpu_adam.so").write_bytes(b"\x7fELF old")
    old = time.time() - 3600
    os.utime(mine / "cpu_adam.so", (old, old))
    _build(shared)
    assert jit_ops.prepare("cpu_adam", {}, shared=shared, local=local) == local
    assert (local / "cpu_adam" / "cpu_adam.so").read_bytes() == b"\x7fELF op"
    assert sorted(p.name for p in local.iterdir()) == ["cpu_adam"]  # the old one removed, no copy left


def test_a_nodes_build_is_kept_when_the_shared_one_is_older_or_of_another_install(tmp_path):
    shared, local = tmp_path / "shared", tmp_path / "local"
    mine = _build(local)
    (mine / "cpu_adam.so").write_bytes(b"\x7fELF mine")
    other = _build(shared)
    old = time.time() - 3600
    os.utime(other / "cpu_adam.so", (old, old))
    jit_ops.prepare("cpu_adam", {}, shared=shared, local=local)
    assert (local / "cpu_adam" / "cpu_adam.so").read_bytes() == b"\x7fELF mine"  # the shared one is older
    os.utime(other / "cpu_adam.so", None)
    os.utime(mine / "cpu_adam.so", (old, old))
    (other / "build.ninja").write_text("rule cxx -I/another/venv\n")  # built for another install's paths
    jit_ops.prepare("cpu_adam", {}, shared=shared, local=local)
    assert (local / "cpu_adam" / "cpu_adam.so").read_bytes() == b"\x7fELF mine"
