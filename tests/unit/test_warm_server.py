"""The warm server's pure parts (launcher.runtime.warm_server): which server a caller's environment
picks, the sys.path a forked controller gets, the staleness and other-copy checks, the socket dir's
permissions. The server itself, forking real controllers: tests/integration/test_warm_server.py."""
from __future__ import annotations

import os
import sys

import pytest

from launcher.runtime import warm_server, warm_start

BASE = {"PATH": "/usr/bin", "HOME": "/root", "PYTHONUNBUFFERED": "1"}


def test_a_server_is_shared_by_runs_that_differ_only_in_what_each_controller_applies_itself():
    k = warm_server.key(BASE, sys.executable, warm_start.SERVER_PRELOAD)
    per_run = dict(BASE, PYTHONPATH="/runs/a/code", PYTHONDONTWRITEBYTECODE="1", LAUNCHER_RUNS="/r",
                   CUDA_VISIBLE_DEVICES="0,1", WANDB_DIR="/w", HOME="/other")
    assert warm_server.key(per_run, sys.executable, warm_start.SERVER_PRELOAD) == k


@pytest.mark.parametrize("change", [
    {"PYTHONHASHSEED": "0"},  # set as the interpreter starts
    {"TORCH_SHOW_CPP_STACKTRACES": "1"}, {"OMP_NUM_THREADS": "4"}, {"LD_PRELOAD": "/x.so"},
])
def test_variables_read_as_an_interpreter_starts_pick_another_server(change):
    k = warm_server.key(BASE, sys.executable, warm_start.SERVER_PRELOAD)
    assert warm_server.key(dict(BASE, **change), sys.executable, warm_start.SERVER_PRELOAD) != k
    assert warm_server.key(BASE, "/usr/bin/python3", warm_start.SERVER_PRELOAD) != k
    assert warm_server.key(BASE, sys.executable, warm_start.PRELOAD) != k


def test_two_virtual_environments_of_one_interpreter_never_share_a_server(tmp_path):
    """A venv's python links to the base interpreter: resolved alone, another checkout's environment
    (its own launcher, its own packages) would be served this one's modules."""
    for venv in ("a", "b"):
        (tmp_path / venv / "bin").mkdir(parents=True)
        (tmp_path / venv / "bin" / "python").symlink_to(os.path.realpath(sys.executable))
    keys = {warm_server.key(BASE, str(tmp_path / v / "bin" / "python"), warm_start.SERVER_PRELOAD) for v in "ab"}
    assert len(keys) == 2


def test_the_controllers_path_is_python_dash_m_s_in_its_working_dir():
    base = ["/lib/python311.zip", "/venv/site-packages", "/work"]
    assert warm_server.child_path("/work", "/code:rel:", base) == [
        "/work", "/code", "/work/rel", "/lib/python311.zip", "/venv/site-packages"]
    assert warm_server.child_path("/w", "", base) == ["/w", *base]


def test_a_changed_or_removed_file_is_named(tmp_path):
    a, b = tmp_path / "a.py", tmp_path / "b"
    a.write_text("x = 1\n")
    b.mkdir()
    fp = {str(a): os.stat(a).st_mtime_ns, str(b): os.stat(b).st_mtime_ns}
    assert warm_server._changed(fp) is None
    (b / "new.pth").write_text("")  # an install adds a file to site-packages
    assert warm_server._changed(fp) == str(b)
    fp[str(b)] = os.stat(b).st_mtime_ns
    a.unlink()
    assert warm_server._changed(fp) == str(a)


def test_a_path_that_finds_another_copy_of_a_loaded_module_is_named(tmp_path):
    """Of the modules named and of every third-party module loaded beside them (a user's ``yaml`` where
    the controller starts would be imported by a new interpreter, not the server's yaml); stdlib modules
    and modules no path finds (made in memory, loaded from a file by name) are not asked."""
    import json
    import types

    import yaml

    loaded = {"yaml": yaml, "json": json, "made_in_memory": types.ModuleType("made_in_memory")}
    assert warm_server._other_copy(list(sys.path), ["yaml"], loaded) is None
    (tmp_path / "yaml").mkdir()
    (tmp_path / "yaml" / "__init__.py").write_text("")
    (tmp_path / "json.py").write_text("")  # the stdlib's: not asked
    (tmp_path / "made_in_memory.py").write_text("")
    assert warm_server._other_copy([str(tmp_path), *sys.path], ["yaml.loader"], loaded) == "yaml"
    assert warm_server._other_copy([str(tmp_path), *sys.path], ["json"], loaded) == "yaml"  # loaded, not named
    (tmp_path / "yaml").rename(tmp_path / "not_yaml")
    assert warm_server._other_copy([str(tmp_path), *sys.path], ["json"], loaded) is None


def test_a_path_that_finds_what_the_servers_imports_missed_is_refused(tmp_path):
    """torch imported on a path without numpy runs without its NumPy bridge in every child forked from
    it: a controller whose path finds numpy (PYTHONPATH holding carried wheels) starts a new interpreter.
    A bare folder of that name (a namespace package) is not such a module."""
    import json

    loaded = {"json": json}
    missed = warm_server._Misses()
    missed.find_spec("numpy_for_this_test")  # a top-level import no finder found
    missed.find_spec("numpy_for_this_test.core", path=["x"])  # a submodule's: not a top-level miss
    assert missed.names == {"numpy_for_this_test"}
    assert warm_server._other_copy([str(tmp_path)], [], loaded, missed=sorted(missed.names)) is None
    (tmp_path / "numpy_for_this_test").mkdir()
    assert warm_server._other_copy([str(tmp_path)], [], loaded, missed=sorted(missed.names)) is None
    (tmp_path / "numpy_for_this_test" / "__init__.py").write_text("")
    assert warm_server._other_copy([str(tmp_path)], [], loaded, missed=sorted(missed.names)) == "numpy_for_this_test"


def test_the_socket_dir_is_this_users_alone(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    d = warm_server.socket_dir()
    assert d.parent == tmp_path and (d.stat().st_mode & 0o777) == 0o700
    d.chmod(0o777)
    with pytest.raises(PermissionError, match="not this user's alone"):
        warm_server.socket_dir()


def test_either_switch_turns_it_off(monkeypatch):
    for off in ({"LAUNCHER_LOCAL_FORK": "0"}, {warm_server.OFF_ENV: "0"}):
        assert warm_server.start_controller(["m"], dict(BASE, **off), warm_start.SERVER_PRELOAD) is None
    assert warm_server.start_controller(["m"], BASE, ()) is None
