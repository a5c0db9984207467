"""The warm server (launcher.runtime.warm_server) forking real controllers: each runs as a new interpreter
would (its working dir, path, environment, streams, process group), a request it cannot serve that way
is refused for a new interpreter, a local run trains the same forked from it as started fresh, and a
Ctrl-C in a waiting `launch` reaches the run's processes as the terminal's did."""
from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import time
from pathlib import Path

import pytest

from helpers import BIN, launch, read_metrics, runs_json
from launcher.backends.local import ServerChild
from launcher.runtime import warm_server, warm_start

pytestmark = [pytest.mark.timeout(300)]

PROBE = """import json, os, resource, sys
seen = {"argv": sys.argv, "path": sys.path[:3], "cwd": os.getcwd(), "env": os.environ.get("PROBE_VALUE"),
        "loaded": sorted(m for m in ("torch", "wandb", "launcher") if m in sys.modules),
        "own_group": os.getpgid(0) == os.getpid(), "umask": os.umask(0o22),
        "cmdline": open("/proc/self/cmdline", "rb").read().rstrip(b"\\0").split(b"\\0")[1:],
        "nofile": resource.getrlimit(resource.RLIMIT_NOFILE)[0], "nice": os.getpriority(os.PRIO_PROCESS, 0)}
print(json.dumps({k: [x.decode() for x in v] if k == "cmdline" else v for k, v in seen.items()}), flush=True)
"""


@pytest.fixture
def own_servers(tmp_path, monkeypatch):
    """This test's servers in a socket dir of its own, stopped (by their pids) at its end."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "xdg"))
    (tmp_path / "xdg").mkdir()
    yield tmp_path / "xdg"
    for pid in warm_server.running(warm_server.socket_dir()).values():
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass


def _request(tmp_path, extra_path: str = "") -> tuple:
    """The probe module started through the server from ``tmp_path``; what it saw, and the server's pid."""
    (tmp_path / "probe_mod.py").write_text(PROBE)
    out = tmp_path / "probe.out"
    env = dict(os.environ, PROBE_VALUE="seen", PYTHONPATH=extra_path)
    cwd = os.getcwd()
    old_mask = os.umask(0o027)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (200, hard))  # what `ulimit -n 200` does to a shell's children
    try:
        os.chdir(tmp_path)
        with open(out, "w") as f:
            saved = os.dup(1)
            os.dup2(f.fileno(), 1)  # the caller's stdout: the controller's too
            try:
                pid = warm_server.start_controller(["probe_mod", "a1"], env, warm_start.SERVER_PRELOAD)
            finally:
                os.dup2(saved, 1)
                os.close(saved)
    finally:
        os.chdir(cwd)
        os.umask(old_mask)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    if pid is None:
        return None, None
    deadline = time.monotonic() + 60
    c = ServerChild(pid)  # what the local backend polls
    while c.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    (pid,) = warm_server.running().values()
    return json.loads(out.read_text()), pid


def test_a_controller_forked_from_the_server_sees_what_a_new_interpreter_would(tmp_path, own_servers):
    (tmp_path / "extra").mkdir()
    seen, server = _request(tmp_path, extra_path=str(tmp_path / "extra"))
    assert seen == {"argv": [str(tmp_path / "probe_mod.py"), "a1"], "path": [str(tmp_path), str(tmp_path / "extra"),
                    seen["path"][2]], "cwd": str(tmp_path), "env": "seen", "loaded": ["torch", "wandb"],
                    "own_group": True, "umask": 0o027, "cmdline": ["-m", "probe_mod", "a1"], "nofile": 200,
                    "nice": os.getpriority(os.PRIO_PROCESS, 0)}
    assert "extra" not in seen["path"][2]
    again, server_again = _request(tmp_path)
    assert again["loaded"] == ["torch", "wandb"] and server_again == server  # one server, kept warm


def test_a_path_holding_another_torch_is_refused_and_the_server_serves_the_next(tmp_path, own_servers):
    _, server = _request(tmp_path)
    shadow = tmp_path / "shadow"
    (shadow / "torch").mkdir(parents=True)
    (shadow / "torch" / "__init__.py").write_text("raise SystemExit('the shadowing torch')\n")
    assert _request(tmp_path, extra_path=str(shadow)) == (None, None)  # the caller starts a new interpreter
    seen, server_after = _request(tmp_path)
    assert server_after == server and seen["env"] == "seen"


@pytest.mark.parametrize("procs", [1, 2])
def test_a_local_run_trains_bitwise_the_same_forked_from_the_server(runs_root, own_servers, procs):
    args = ["train.steps=6", f"cluster.gpus_per_node={procs}"]  # a short run: the start is what differs
    fresh = launch(args, runs_root, extra_env={"LAUNCHER_LOCAL_FORK": "0"})
    assert fresh.returncode == 0, fresh.stdout + fresh.stderr
    assert warm_server.running() == {}
    warm = launch(args, runs_root)
    assert warm.returncode == 0, warm.stdout + warm.stderr
    assert len(warm_server.running()) == 1
    a, b = (read_metrics(Path(r["dir"])) for r in runs_json(runs_root))
    assert [r["loss"] for r in a] == [r["loss"] for r in b] and len(a) == 6


def test_a_ctrl_c_in_the_waiting_launch_ends_the_run_cancelled(runs_root, own_servers):
    env = dict(os.environ, LAUNCHER_RUNS=str(runs_root))
    proc = subprocess.Popen([str(BIN / "launch"), "train.steps=100000"], env=env, cwd=str(runs_root.parent),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # until the run has trained a step
            runs = runs_json(runs_root) if runs_root.exists() else []
            metrics = Path(runs[0]["dir"]) / "metrics.jsonl" if runs else None
            if metrics and metrics.exists() and metrics.stat().st_size:
                break
            time.sleep(0.2)
        assert warm_server.running(), "the run's controller was not forked from the server"
        proc.send_signal(signal.SIGINT)  # to the launch alone: the terminal would send it to the group
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and runs_json(runs_root)[0]["status"] in ("running", "pending"):
        time.sleep(0.2)
    assert runs_json(runs_root)[0]["status"] == "cancelled", runs_json(runs_root)[0]
