"""One warm process per host and environment that cluster=local's job controllers are forked from.

A local job's controller imports torch, ``torch._dynamo`` and the rest of warm_start.PRELOAD (~2.5 s
of CPU) before it forks its processes (launcher.runtime.warm_start), and its one process of a
single-process job starts a new interpreter that imports them again. Each local run, each point of a
local sweep, each `launcher resume`, `reproduce` or `verify-resume` paid that again. This server
imports them once and forks each controller from itself; a controller forked from it finds them
loaded and forks its processes, one or several, at once. It is a process of its own (its own session,
no terminal, no inherited pipes) that exits after ``LAUNCHER_WARM_IDLE_S`` (default 300) without a
request, or at the first request that finds a file it loaded changed (a pip install, an edited
checkout): that request, and any the server cannot serve exactly as a new interpreter would run, is
refused and the caller starts the controller as a new interpreter (``subprocess``), as without it
(``LAUNCHER_WARM_SERVER=0``: always).

Exactly as a new interpreter: the server loads no module of the product (it runs as a file, and the
product's modules are imported by each controller from its own ``sys.path``: a run's code snapshot
first); the controller gets the caller's environment, working dir, umask, standard streams (passed over
the socket) and the ``sys.path`` ``python -m`` would give it there; a request whose path would find
another copy of a loaded module (torch from a ``PYTHONPATH`` entry, say) is refused; variables read as
an interpreter starts (``PYTHONHASHSEED``, ``TORCH_*``, ``OMP_*``...) pick the server (``key``). Its
controller leads a process group of its own: a Ctrl-C in the caller is passed to that group, as the
terminal did when the controller was the caller's child.

Only stdlib at the top of this file: it runs as the server's main file. ``LAUNCHER_LOCAL_FORK=0``
turns it off with the rest of the warm start (docs/performance.md).
"""
from __future__ import annotations

import fcntl
import hashlib
import io
import json
import os
import runpy
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence

IDLE_ENV = "LAUNCHER_WARM_IDLE_S"
OFF_ENV = "LAUNCHER_WARM_SERVER"  # "0": each controller a new interpreter (its processes still forked)
IDLE_S = 300.0
START_WAIT_S = 60.0  # a first request waits this long for the server's imports (a loaded host)
# what an interpreter reads as it starts or as torch loads: servers differ by these
KEY_PREFIXES = ("PYTHON", "LD_", "TORCH", "PYTORCH", "OMP_", "MKL_", "KMP_", "OPENBLAS_", "GOMP_")
# ... except these: applied to each controller (sys.path, bytecode, stream buffering)
PER_REQUEST = ("PYTHONPATH", "PYTHONDONTWRITEBYTECODE", "PYTHONUNBUFFERED")
_MAX_MSG = 1 << 22


def key(environ: Mapping[str, str], executable: str, modules: Sequence[str]) -> str:
    """The server a caller uses: its interpreter, the modules loaded and the start-time variables."""
    fixed = sorted((k, v) for k, v in environ.items() if k.startswith(KEY_PREFIXES) and k not in PER_REQUEST)
    raw = json.dumps([os.path.realpath(executable), list(modules), fixed])
    return hashlib.sha256(raw.encode()).hexdigest()[:20]


def socket_dir() -> Path:
    """A directory of this user's only (the servers' sockets, locks and logs)."""
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    d = Path(base) / f"launcher-warm-{os.getuid()}"
    d.mkdir(mode=0o700, exist_ok=True)
    st = d.stat()
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise PermissionError(f"{d} is not this user's alone")
    return d


def child_path(cwd: str, pythonpath: str, base: Sequence[str]) -> List[str]:
    """The ``sys.path`` of ``python -m MODULE`` started in ``cwd`` with ``PYTHONPATH``: the working dir,
    then the variable's entries, then the interpreter's own (``base``: site-packages and the stdlib)."""
    extra = [os.path.abspath(os.path.join(cwd, p)) for p in pythonpath.split(os.pathsep) if p]
    return [cwd, *extra, *[p for p in base if p not in extra and p != cwd]]


# ---- the caller's side ----

_FORWARDED: List[int] = []  # process groups a Ctrl-C in this process is passed to


class Controller:
    """What submitit's LocalJob and the launch's wait use of a ``subprocess.Popen`` for a process that
    is the server's child: ``pid``, ``poll()`` (an exit status is not known here: 0 once it is gone)
    and ``send_signal()``."""

    def __init__(self, pid: int, start: Optional[str]) -> None:
        self.pid = pid
        self._start = start
        self.returncode: Optional[int] = None

    def poll(self) -> Optional[int]:
        if self.returncode is None and _start_time(self.pid) != self._start:
            self.returncode = 0
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)


def start_controller(module_args: Sequence[str], env: Mapping[str, str],
                     modules: Sequence[str]) -> Optional[Controller]:
    """``python -m MODULE ARGS`` forked from the warm server for ``env`` (started here if none answers),
    or None: off, refused or unreachable, and the caller starts it as a new interpreter."""
    if any(env.get(k, "1").strip() == "0" for k in ("LAUNCHER_LOCAL_FORK", OFF_ENV)) or not modules:
        return None
    try:
        d = socket_dir()
        path = d / key(env, sys.executable, modules)  # named by it: its .lock, .pid and .log files
        conn = _connect(path) or _start_server(path, modules, env)
        if conn is None:
            return None
        with conn:
            conn.settimeout(START_WAIT_S)
            request = {"argv": list(module_args), "env": dict(env), "cwd": os.getcwd(), "umask": _umask()}
            socket.send_fds(conn, [json.dumps(request).encode()], [0, 1, 2])
            answer = json.loads(_recv_all(conn) or b"{}")
    except (OSError, ValueError):
        return None
    pid = answer.get("pid")
    if not isinstance(pid, int):
        return None
    _forward_sigint(pid)
    return Controller(pid, _start_time(pid))


def address(path: Path) -> str:
    """The server's socket, in Linux's abstract namespace: no length limit of a path under a deep
    TMPDIR, nothing left behind by a server that died. Anyone may connect to such a name, so each
    side checks the other's user (``_peer_uid``)."""
    return "\0launcher-warm-" + hashlib.sha256(str(path).encode()).hexdigest()[:32]


def _peer_uid(conn: socket.socket) -> int:
    return struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))[1]


def _connect(path: Path) -> Optional[socket.socket]:
    """A connection to this user's server for ``path``; None if none listens (or another user does)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(address(path))
        if _peer_uid(s) == os.getuid():
            return s
    except OSError:
        pass
    s.close()
    return None


def _start_server(path: Path, modules: Sequence[str], env: Mapping[str, str]) -> Optional[socket.socket]:
    """One caller at a time starts the server (a lock beside the socket); the others find it up."""
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        conn = _connect(path)
        if conn is not None:
            return conn
        server_env = {k: v for k, v in env.items() if k not in PER_REQUEST}
        with open(path.with_suffix(".log"), "ab") as log:
            proc = subprocess.Popen(  # noqa: S603 - this interpreter, this file
                [sys.executable, __file__, str(path), ",".join(modules)], env=server_env, cwd=str(path.parent),
                stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True, close_fds=True)
        deadline = time.monotonic() + START_WAIT_S
        while time.monotonic() < deadline and proc.poll() is None:
            conn = _connect(path)
            if conn is not None:
                return conn
            time.sleep(0.05)
        return None


def _forward_sigint(pgid: int) -> None:
    """A Ctrl-C here reaches the controller's group too, as the terminal's did when it was our child."""
    _FORWARDED.append(pgid)
    if len(_FORWARDED) > 1:
        return
    try:
        previous = signal.getsignal(signal.SIGINT)
    except ValueError:
        return

    def forward(signum, frame):
        for g in _FORWARDED:
            try:
                os.killpg(g, signal.SIGINT)
            except OSError:
                pass
        if callable(previous):
            previous(signum, frame)
        elif previous != signal.SIG_IGN:
            raise KeyboardInterrupt

    try:
        signal.signal(signal.SIGINT, forward)
    except ValueError:  # not the main thread: nothing to forward from
        pass


def _start_time(pid: int) -> Optional[str]:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[-1].split()
    return None if fields[0] == "Z" else fields[19]


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _recv_all(conn: socket.socket) -> bytes:
    chunks = []
    while True:
        b = conn.recv(65536)
        if not b:
            return b"".join(chunks)
        chunks.append(b)


# ---- the server ----

def _fingerprint(extra: Sequence[str]) -> Dict[str, int]:
    """The mtime of every file the server loaded and every directory on its path: any change (an
    install, an edit) and a new interpreter would run something else."""
    out = {}
    files = [getattr(m, "__file__", None) for m in list(sys.modules.values())] + [*sys.path, *extra]
    for f in files:
        if f:
            try:
                out[f] = os.stat(f).st_mtime_ns
            except OSError:
                pass
    return out


def _changed(fingerprint: Dict[str, int]) -> Optional[str]:
    for f, mtime in fingerprint.items():
        try:
            if os.stat(f).st_mtime_ns != mtime:
                return f
        except OSError:
            return f
    return None


def _other_copy(path: List[str], modules: Sequence[str]) -> Optional[str]:
    """A loaded top-level module a new interpreter on ``path`` would find elsewhere."""
    from importlib.machinery import PathFinder

    for top in dict.fromkeys(m.split(".")[0] for m in modules if m in sys.modules):
        spec = PathFinder.find_spec(top, path)
        if spec is None or spec.origin != getattr(sys.modules[top], "__file__", None):
            return top
    return None


def serve(path: Path, modules: Sequence[str], idle_s: float) -> None:
    import importlib

    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as e:  # not installed: each controller imports what it needs as it would anyway
            print(f"warm server: {name}: {e!r}", file=sys.stderr, flush=True)
    base = list(sys.path)  # without this file's dir (__main__ below): a controller's own path comes first
    fingerprint = _fingerprint([__file__])
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the controllers are reaped as they end
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _exit_on)  # ends as when idle: its socket removed
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(address(path))  # EADDRINUSE: another is up (the lock makes that rare): this one ends
    pid_file = path.with_suffix(".pid")
    pid_file.write_text(f"{os.getpid()}\n")
    listener.listen(16)
    listener.settimeout(idle_s)
    try:
        while True:
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                return
            with conn:
                conn.settimeout(30)
                if not _serve_one(conn, listener, modules, base, fingerprint):
                    return
    finally:
        try:
            if pid_file.read_text().strip() == str(os.getpid()):
                pid_file.unlink()
        except OSError:
            pass


def _exit_on(signum, _frame) -> None:
    raise SystemExit(128 + signum)


def running(d: Optional[Path] = None) -> Dict[Path, int]:
    """The servers of this user: socket name -> pid (the test suite stops those it started)."""
    out = {}
    for pid_file in (d or socket_dir()).glob("*.pid"):
        try:
            out[pid_file.with_suffix("")] = int(pid_file.read_text())
        except (OSError, ValueError):
            pass
    return out


def _serve_one(conn: socket.socket, listener: socket.socket, modules: Sequence[str], base: List[str],
               fingerprint: Dict[str, int]) -> bool:
    """One request: a controller forked, or a refusal. False: the server ends (its files changed)."""
    uid = _peer_uid(conn)
    msg, fds, _, _ = socket.recv_fds(conn, _MAX_MSG, 3)
    try:
        if uid != os.getuid() or len(fds) != 3:
            conn.sendall(json.dumps({"refused": "another user, or no streams"}).encode())
            return True
        changed = _changed(fingerprint)
        if changed:
            conn.sendall(json.dumps({"refused": f"{changed} changed since the server loaded it"}).encode())
            return False
        req = json.loads(msg)
        env, cwd = dict(req["env"]), str(req["cwd"])
        path = child_path(cwd, env.get("PYTHONPATH", ""), base)
        other = _other_copy(path, modules)
        if other:
            conn.sendall(json.dumps({"refused": f"{other} would load from elsewhere on this path"}).encode())
            return True
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child never returns from here
            listener.close()
            conn.close()
            _run_controller(list(req["argv"]), env, cwd, int(req["umask"]), path, fds)
        conn.sendall(json.dumps({"pid": pid}).encode())
        return True
    finally:
        for fd in fds:
            os.close(fd)


def _run_controller(argv: List[str], env: Dict[str, str], cwd: str, umask: int, path: List[str],
                    fds: List[int]) -> None:  # pragma: no cover - runs in the forked controller
    code: object = 1
    try:
        os.setpgid(0, 0)
        for s in (signal.SIGCHLD, signal.SIGHUP, signal.SIGTERM):
            signal.signal(s, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        unbuffered = bool(env.get("PYTHONUNBUFFERED"))
        sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
        sys.stdout = sys.__stdout__ = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=unbuffered,
                                                       line_buffering=os.isatty(1))
        sys.stderr = sys.__stderr__ = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True,
                                                       errors="backslashreplace")
        os.umask(umask)
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        sys.path[:] = path
        sys.dont_write_bytecode = bool(env.get("PYTHONDONTWRITEBYTECODE"))
        import importlib

        importlib.invalidate_caches()
        sys.argv = argv
        try:
            runpy.run_module(argv[0], run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as e:
            code = e.code
        from launcher.runtime import warm_start  # the controller's own copy (its sys.path)

        warm_start.finish()
        code = warm_start.exit_status(code)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        os._exit(code if isinstance(code, int) else 1)


if __name__ == "__main__":
    # python warm_server.py SOCKET MODULES: run as a file, so no module of the product is loaded here
    sys.path.pop(0)  # this file's directory (launcher/runtime) holds no module to import by name
    serve(Path(sys.argv[1]), [m for m in sys.argv[2].split(",") if m],
          float(os.environ.get(IDLE_ENV) or IDLE_S))
