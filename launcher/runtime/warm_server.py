"""One warm process per host and environment that cluster=local's job controllers are forked from.

A local job's controller imported torch, ``torch._dynamo`` and the rest of warm_start.PRELOAD (~2.5 s
of CPU) before forking its processes, and a one-process job's process started a new interpreter: each
local run, sweep point, `launcher resume`, `reproduce` or `verify-resume` paid that again. This server
imports them once and forks each controller, which finds them loaded and forks its processes at once.
It is a process of its own (own session, no terminal, no inherited pipes) that exits after
``LAUNCHER_WARM_IDLE_S`` (300) without a request, or at the first request that finds a file it loaded
changed (an install, an edited checkout): that request, and any it cannot serve exactly as a new
interpreter would run, is refused, and the caller starts a new interpreter as without it
(``LAUNCHER_WARM_SERVER=0``: always; ``LAUNCHER_LOCAL_FORK=0`` turns the whole warm start off).

Exactly as a new interpreter: the server loads no module of the product (it runs as a file; each
controller imports the product from its own ``sys.path``, a run's code snapshot first); the controller
gets the caller's environment, working dir, umask, ulimits, nice value, CPU affinity, standard streams
(passed over the socket), the ``sys.path`` ``python -m`` gives there and its command line (``ps``); a
path that finds another copy of a loaded module is refused; start-time variables (``PYTHONHASHSEED``,
``TORCH_*``, ``OMP_*``...), the cgroup and the namespaces pick the server (``key``). The controller
leads a process group: a Ctrl-C in the caller is passed to it, as the terminal's was. Only stdlib here:
this file is the server's main file (docs/performance.md).
"""
from __future__ import annotations

import atexit
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
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence

IDLE_ENV = "LAUNCHER_WARM_IDLE_S"
OFF_ENV = "LAUNCHER_WARM_SERVER"  # "0": each controller a new interpreter (its processes still forked)
IDLE_S = 300.0
START_WAIT_S = 60.0  # a first request waits this long for the server's imports (a loaded host)
# what an interpreter reads as it starts or as torch loads: servers differ by these
KEY_PREFIXES = ("PYTHON", "LD_", "TORCH", "PYTORCH", "OMP_", "MKL_", "KMP_", "OPENBLAS_", "GOMP_")
# ... except these: applied to each controller (sys.path, bytecode, stream buffering)
PER_REQUEST = ("PYTHONPATH", "PYTHONDONTWRITEBYTECODE", "PYTHONUNBUFFERED")
_MAX_MSG = 1 << 22
# room on the server's command line for its children's (set_cmdline): a rank's is ~500 bytes
TITLE_ROOM = 2048


def key(environ: Mapping[str, str], executable: str, modules: Sequence[str], place: str = "") -> str:
    """The server a caller uses: its interpreter, the modules loaded, the start-time variables and its
    ``place`` (``where_am_i``: a process of another cgroup or namespace never forks from this one)."""
    fixed = sorted((k, v) for k, v in environ.items() if k.startswith(KEY_PREFIXES) and k not in PER_REQUEST)
    # the interpreter as called, not only the file it resolves to: a virtual environment's python is a
    # link to the base interpreter, and two environments (two checkouts, two versions) must not share
    raw = json.dumps([os.path.abspath(executable), os.path.realpath(executable), list(modules), fixed, place])
    return hashlib.sha256(raw.encode()).hexdigest()[:20]


def where_am_i() -> str:
    """This process's cgroup (a Slurm job's step, a systemd scope: its limits and its end are the
    job's) and namespaces (a container's files): a controller forked elsewhere would escape them."""
    parts = []
    try:
        parts.append(Path("/proc/self/cgroup").read_text())
    except OSError:
        pass
    for ns in ("mnt", "pid", "net", "user", "ipc", "uts", "cgroup"):
        try:
            parts.append(f"{ns}:{os.stat(f'/proc/self/ns/{ns}').st_ino}")
        except OSError:
            pass
    return "\n".join(parts)


def set_cmdline(argv: Sequence[str], shorter: Optional[Sequence[str]] = None) -> bool:
    """What ``ps``, ``pgrep -f`` and /proc/PID/cmdline show for this process: ``argv`` (or ``shorter``
    where ``argv`` does not fit), written over the command line's own bytes (as setproctitle does; cut
    to their length). A forked process would otherwise show the process it was forked from. False
    where it could not."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        start, end = int(fields[45]), int(fields[46])  # arg_start, arg_end (fields 48 and 49)
        data = b"\0".join(os.fsencode(a) for a in argv)
        if len(data) >= end - start and shorter is not None:
            data = b"\0".join(os.fsencode(a) for a in shorter)
        data = data[:end - start - 1]
        with open("/proc/self/mem", "r+b", buffering=0) as mem:
            mem.seek(start)
            mem.write(data.ljust(end - start, b"\0"))
        return True
    except (OSError, ValueError, IndexError):
        return False


def socket_dir() -> Path:
    """A directory of this user's only (the servers' locks, pids and logs)."""
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    d = Path(base) / f"launcher-warm-{os.getuid()}"
    d.mkdir(mode=0o700, exist_ok=True)
    if d.stat().st_uid != os.getuid() or d.stat().st_mode & 0o077:
        raise PermissionError(f"{d} is not this user's alone")
    return d


def child_path(cwd: str, pythonpath: str, base: Sequence[str]) -> List[str]:
    """The ``sys.path`` of ``python -m MODULE`` started in ``cwd`` with ``PYTHONPATH``: the working dir,
    then the variable's entries, then the interpreter's own (``base``: site-packages and the stdlib)."""
    extra = [os.path.abspath(os.path.join(cwd, p)) for p in pythonpath.split(os.pathsep) if p]
    return [cwd, *extra, *[p for p in base if p not in extra and p != cwd]]


# ---- the caller's side ----
_FORWARDED: List[int] = []  # process groups a Ctrl-C in this process is passed to


def start_controller(module_args: Sequence[str], env: Mapping[str, str], modules: Sequence[str]) -> Optional[int]:
    """``python -m MODULE ARGS`` forked from the warm server for ``env`` (started here if none answers):
    its pid (the server's child, not this process's), or None: off, refused or unreachable, and the
    caller starts it as a new interpreter."""
    if any(env.get(k, "1").strip() == "0" for k in ("LAUNCHER_LOCAL_FORK", OFF_ENV)) or not modules:
        return None
    try:
        d = socket_dir()
        path = d / key(env, sys.executable, modules, where_am_i())  # named by it: its .lock, .pid and .log files
        conn = _connect(path) or _start_server(path, modules, env)
        if conn is None:
            return None
        with conn:
            conn.settimeout(START_WAIT_S)
            request = {"argv": list(module_args), "env": dict(env), "cwd": os.getcwd(), "umask": _umask(),
                       "limits": _limits(), "nice": os.getpriority(os.PRIO_PROCESS, 0),
                       "cpus": sorted(os.sched_getaffinity(0))}
            socket.send_fds(conn, [json.dumps(request).encode()], [0, 1, 2])
            answer = json.loads(_recv_all(conn) or b"{}")
    except (OSError, ValueError):
        return None
    pid = answer.get("pid")
    if not isinstance(pid, int):
        return None
    _forward_sigint(pid)
    return pid


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
                [sys.executable, __file__, str(path), ",".join(modules), " " * TITLE_ROOM], env=server_env,
                cwd=str(path.parent),
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


def _limits() -> Dict[str, List[int]]:
    """This process's resource limits (``ulimit``), which a new interpreter would inherit."""
    import resource

    return {name: list(resource.getrlimit(getattr(resource, name))) for name in dir(resource)
            if name.startswith("RLIMIT_")}


def _unmatched(req: Mapping[str, Any]) -> Optional[str]:
    """What of the caller's process a child of this server cannot take (a higher hard limit, a lower
    nice value, CPUs outside this server's set); None: it can take all of it."""
    import resource

    for name, (_, hard) in dict(req.get("limits") or {}).items():
        have = resource.getrlimit(getattr(resource, name))[1]
        if have != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or hard > have):
            return f"{name} hard limit {hard} above this server's {have}"
    if int(req.get("nice", 0)) < os.getpriority(os.PRIO_PROCESS, 0):
        return "a lower nice value than this server's"
    if not set(req.get("cpus") or ()) <= os.sched_getaffinity(0):
        return "CPUs outside this server's affinity"
    return None


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _recv_all(conn: socket.socket) -> bytes:
    return b"".join(iter(lambda: conn.recv(65536), b""))


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


class _Misses:
    """Last on sys.meta_path while the server imports: the top-level names no finder found (numpy for a
    torch on a path without it: torch then runs without its NumPy bridge, in every child it forks)."""

    def __init__(self) -> None:
        self.names: set = set()

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if path is None:
            self.names.add(name)


_missed = _Misses()


def _other_copy(path: List[str], modules: Sequence[str], loaded: Optional[Mapping[str, Any]] = None,
                missed: Sequence[str] = ()) -> Optional[str]:
    """A loaded top-level module (``loaded``: sys.modules) that a new interpreter on ``path`` would find
    in another file: of ``modules`` and of what importing them loaded outside the stdlib (numpy, yaml...:
    a user's ``yaml.py`` in the working dir must not be served the server's). One the path does not find
    at all was not loaded from it (made in memory, or from a file by name): no path shadows it. Or one
    the server looked for and did not find (``missed``) that ``path`` finds: its imports went without it."""
    from importlib.machinery import PathFinder

    for name in missed:
        spec = PathFinder.find_spec(name, path)
        if spec is not None and spec.origin is not None:  # (any folder is a namespace package: not one)
            return name
    loaded = sys.modules if loaded is None else loaded
    std = set(sys.stdlib_module_names) | set(sys.builtin_module_names)
    tops = [m.split(".")[0] for m in (*modules, *list(loaded))]
    for top in dict.fromkeys(t for t in tops if t in loaded and t not in std and not t.startswith("__")):
        if not (getattr(loaded[top], "__file__", None) or hasattr(loaded[top], "__path__")):
            continue  # made in memory (Cython's cython_runtime): the same in a new interpreter
        spec = PathFinder.find_spec(top, path)
        if spec is not None and spec.origin != getattr(loaded[top], "__file__", None):
            return top
    return None


def serve(path: Path, modules: Sequence[str], idle_s: float) -> None:
    import importlib

    sys.meta_path.append(_missed)
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as e:  # not installed: each controller imports what it needs as it would anyway
            print(f"warm server: {name}: {e!r}", file=sys.stderr, flush=True)
    sys.meta_path.remove(_missed)
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


def finish() -> None:  # pragma: no cover - runs in a forked process
    """What the interpreter does at its end: wait for non-daemon threads, run the atexit functions,
    flush the streams."""
    try:
        threading._shutdown()  # type: ignore[attr-defined]
    except Exception:
        traceback.print_exc()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass


def exit_status(code: object) -> int:
    """sys.exit's argument as the interpreter turns it into an exit status."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    try:
        print(code, file=sys.stderr, flush=True)
    except Exception:
        pass
    return 1


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
        other = _other_copy(path, modules, missed=sorted(_missed.names))
        if other:
            conn.sendall(json.dumps({"refused": f"{other} would load from elsewhere on this path"}).encode())
            return True
        unmatched = _unmatched(req)
        if unmatched:
            conn.sendall(json.dumps({"refused": unmatched}).encode())
            return True
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child never returns from here
            listener.close()
            conn.close()
            _run_controller(req, env, cwd, path, fds)
        conn.sendall(json.dumps({"pid": pid}).encode())
        return True
    finally:
        for fd in fds:
            os.close(fd)


def _run_controller(req: Mapping[str, Any], env: Dict[str, str], cwd: str, path: List[str],
                    fds: List[int]) -> None:  # pragma: no cover - runs in the forked controller
    import resource

    code: object = 1
    argv = list(req["argv"])
    try:
        set_cmdline([sys.executable, "-m", *argv])
        os.setpgid(0, 0)
        for name, limits in dict(req.get("limits") or {}).items():  # the caller's ulimits, as a child has them
            resource.setrlimit(getattr(resource, name), tuple(limits))
        os.setpriority(os.PRIO_PROCESS, 0, int(req.get("nice", 0)))
        if req.get("cpus"):
            os.sched_setaffinity(0, req["cpus"])
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
        os.umask(int(req["umask"]))
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
        finish()
        code = exit_status(code)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        os._exit(code if isinstance(code, int) else 1)


if __name__ == "__main__":
    # python warm_server.py SOCKET MODULES ROOM: run as a file, so no module of the product is loaded here
    sys.path.pop(0)  # this file's directory (launcher/runtime) holds no module to import by name
    set_cmdline([sys.executable, "-m", "launcher.runtime.warm_server", sys.argv[1]])  # (ROOM: its children's)
    serve(Path(sys.argv[1]), [m for m in sys.argv[2].split(",") if m],
          float(os.environ.get(IDLE_ENV) or IDLE_S))
