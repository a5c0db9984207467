"""cluster=local's processes forked from the controller once it imported torch (launcher.runtime.warm_start):
which commands it takes over, the modules the backend names, the off switch, the exit statuses the child
reports, and the thread count a forked process applies once the run's environment names it."""
from __future__ import annotations

import shlex
import sys
import types

import pytest

from launcher.runtime import job_start, warm_server, warm_start


def test_the_backends_command_is_taken_over_with_the_interpreters_own_argv():
    words = shlex.split(job_start.python_command()) + ["-u", "-m", "submitit.core._submit", "/x/.submitit"]
    assert warm_start.child_argv(words) == ["-c", "-u", "-m", "submitit.core._submit", "/x/.submitit"]
    bare = shlex.split(job_start.python_command())[3:] + ["-u", "-m", "submitit.core._submit", "/x"]
    assert warm_start.child_argv(bare) == ["-c", "-u", "-m", "submitit.core._submit", "/x"]


@pytest.mark.parametrize("command", [
    ["/usr/bin/python3.9", "-u", "-c", job_start.BOOTSTRAP, "-m", "m"],  # another interpreter: its own start
    [sys.executable, "-u", "-c", "print(1)", "-m", "m"],  # another program
    [sys.executable, "-m", "submitit.core._submit", "/x"],  # submitit's plain command
    ["/bin/sh", "-c", "exec x", sys.executable, "-u", "-c", job_start.BOOTSTRAP],
])
def test_any_other_command_starts_as_a_new_interpreter(command):
    assert warm_start.child_argv(command) is None


def test_the_modules_come_from_the_backend_and_the_switch_turns_them_off():
    env = {warm_start.PRELOAD_ENV: "torch,torch._dynamo"}
    assert warm_start.preload_modules(env) == ["torch", "torch._dynamo"]
    assert warm_start.preload_modules({**env, warm_start.OFF_ENV: "0"}) == []
    assert warm_start.preload_modules({}) == []


def test_the_preload_is_what_every_rank_imports_and_nothing_the_login_path_may_not():
    assert warm_start.PRELOAD[0] == "torch" and "torch._dynamo" in warm_start.PRELOAD
    assert all(m.split(".")[0] == "torch" for m in warm_start.PRELOAD)  # no product module: ranks import those


def test_a_script_jobs_controller_imports_the_launchers_task_and_no_torch():
    """recipe=script: the ranks start the user's script as a process of its own (which imports what it
    uses); a controller holding torch would only cost its import and its memory."""
    assert warm_start.preload_for(script=False) == warm_start.PRELOAD
    assert warm_start.preload_for(script=True) == ("launcher.runtime.task",)
    import importlib.util

    assert importlib.util.find_spec(warm_start.SCRIPT_PRELOAD[0]) is not None


@pytest.mark.parametrize("code,status", [(None, 0), (0, 0), (3, 3), (144, 144), (256 + 7, 7), ("boom", 1)])
def test_the_childs_exit_status_is_the_interpreters(code, status, capsys):
    assert warm_server.exit_status(code) == status
    if isinstance(code, str):
        assert "boom" in capsys.readouterr().err


def test_a_forked_process_applies_the_runs_thread_count_to_the_torch_it_found_loaded(monkeypatch):
    calls = []
    fake = types.SimpleNamespace(get_num_threads=lambda: 2, set_num_threads=calls.append)
    monkeypatch.setitem(sys.modules, "torch", fake)
    warm_start.apply_thread_settings({"OMP_NUM_THREADS": "1"})
    warm_start.apply_thread_settings({"OMP_NUM_THREADS": "2"})  # already so
    warm_start.apply_thread_settings({})
    warm_start.apply_thread_settings({"OMP_NUM_THREADS": "auto"})
    assert calls == [1]
