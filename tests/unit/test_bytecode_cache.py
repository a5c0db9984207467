"""A snapshot's bytecode comes from a content-addressed cache; the code a job imports is its own."""
import importlib._bootstrap_external as bootstrap
import importlib.util

import pytest

from launcher.archive import snapshot


def _import(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_second_snapshot_of_the_same_code_compiles_nothing_and_imports_as_itself(tmp_path, monkeypatch):
    monkeypatch.setenv("LAUNCHER_BYTECODE_CACHE", str(tmp_path / "cache"))
    src = "def where():\n    return where.__code__.co_filename\n"
    for name in ("a", "b"):
        (tmp_path / name / "pkg").mkdir(parents=True)
        (tmp_path / name / "pkg" / "m.py").write_text(src)
    assert snapshot.compile_tree(tmp_path / "a", tmp_path / "a") == 1
    assert snapshot.compile_tree(tmp_path / "b", tmp_path / "b") == 0  # from the cache
    (tmp_path / "b" / "pkg" / "n.py").write_text(src + "# changed\n")
    assert snapshot.compile_tree(tmp_path / "b", tmp_path / "b") == 1  # new content: compiled

    def no_compile(*a, **kw):
        raise AssertionError("compiled at import: the snapshot's bytecode was not used")

    monkeypatch.setattr(bootstrap.SourceLoader, "source_to_code", no_compile)
    mod = _import(tmp_path / "b" / "pkg" / "m.py", "snap_b_m")
    assert mod.where() == str(tmp_path / "b" / "pkg" / "m.py")  # its own path, not the first snapshot's


def test_off_compiles_every_time(tmp_path, monkeypatch):
    monkeypatch.setenv("LAUNCHER_BYTECODE_CACHE", "off")
    (tmp_path / "m.py").write_text("x = 1\n")
    assert snapshot.bytecode_cache() is None
    assert snapshot.compile_tree(tmp_path, tmp_path) == snapshot.compile_tree(tmp_path, tmp_path) == 1


def test_a_file_that_does_not_compile_is_left_to_the_job(tmp_path, monkeypatch):
    monkeypatch.setenv("LAUNCHER_BYTECODE_CACHE", str(tmp_path / "cache"))
    (tmp_path / "bad.py").write_text("def (:\n")
    assert snapshot.compile_tree(tmp_path, tmp_path) == 0
    with pytest.raises(SyntaxError):
        _import(tmp_path / "bad.py", "snap_bad")
