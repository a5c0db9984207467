"""cluster=local's processes forked from one warm process instead of each starting an interpreter.

Every rank imports torch (~2 s of CPU on a small host) and, through DDP and the optimizers,
``torch._dynamo`` (~1.5 s) and torch's checkpoint modules before its first step; on an 8-GPU host the
eight ranks pay that eight times, and again at every restart. The local job's controller imports
them once (``preload``) and forks each process from itself: the process then runs the command it
would have run as a new interpreter (``python -u -c BOOTSTRAP -m submitit.core._submit FOLDER``,
launcher.runtime.job_start), with the same environment, log files, held stop signals and exit status.
Forking before any CUDA call is what torch's own fork start method does (no CUDA context exists yet).

The backend names the modules (LocalBackend: ``PRELOAD_ENV``); an empty list, a single process or a
command of another shape starts interpreters as submitit does. ``LAUNCHER_LOCAL_FORK=0`` turns it
off (docs/performance.md).
"""
from __future__ import annotations

import importlib
import io
import os
import runpy
import signal
import sys
import traceback
from typing import IO, Dict, List, Optional, Sequence, Tuple

from launcher.runtime import job_start, warm_server

PRELOAD_ENV = "LAUNCHER_LOCAL_PRELOAD"  # comma-separated modules the controller imports before forking
OFF_ENV = "LAUNCHER_LOCAL_FORK"  # "0": every process a new interpreter
# what every rank imports before its first step: torch (the run's environment record, every recipe),
# and through DDP, the optimizers and the checkpoints of the training recipes the rest
PRELOAD = ("torch", "torch._dynamo", "torch.distributed", "torch.distributed.checkpoint")
# what the warm server (launcher.runtime.warm_server) loads for the controllers it forks: their
# processes' modules, and what rank 0 imports next (wandb: the default logger; submitit's job entry)
SERVER_PRELOAD = PRELOAD + ("submitit.core.submission", "wandb")
# recipe=script: each rank is the launcher's task, which starts the user's script as a process of its own
# (that process imports what it uses): the task's modules alone, no torch
SCRIPT_PRELOAD = ("launcher.runtime.task",)
_STOPS = (signal.SIGTERM, signal.SIGUSR2, signal.SIGINT, signal.SIGUSR1, signal.SIGHUP, signal.SIGCONT)


def preload_for(script: bool) -> Tuple[str, ...]:
    """What a local job's controller imports before forking its processes: PRELOAD, or for a
    recipe=script job SCRIPT_PRELOAD."""
    return SCRIPT_PRELOAD if script else PRELOAD


def preload_modules(environ: Optional[Dict[str, str]] = None) -> List[str]:
    env = os.environ if environ is None else environ
    if env.get(OFF_ENV, "1").strip() == "0":
        return []
    return [m.strip() for m in env.get(PRELOAD_ENV, "").split(",") if m.strip()]


def child_argv(command: Sequence[str]) -> Optional[List[str]]:
    """The ``sys.argv`` a new interpreter would have for ``command`` when it is this interpreter run as
    ``python -u -c BOOTSTRAP ARGS...`` (``['-c', *ARGS]``); None for any other command."""
    command = list(command)
    if command[:3] == ["/bin/sh", "-c", job_start.IGNORE_THEN_EXEC]:
        command = command[3:]
    if len(command) < 4 or command[1:3] != ["-u", "-c"] or command[3] != job_start.BOOTSTRAP:
        return None
    if os.path.realpath(command[0]) != os.path.realpath(sys.executable):
        return None
    return ["-c", *command[4:]]


def preload(modules: Sequence[str]) -> None:
    for name in modules:
        importlib.import_module(name)


def apply_thread_settings(environ: Dict[str, str]) -> None:
    """A forked process found torch loaded before the run's environment (cluster.env) was set: the
    thread counts it names (read by OpenMP and MKL as they load) are applied to torch now."""
    torch = sys.modules.get("torch")
    n = (environ.get("OMP_NUM_THREADS") or environ.get("MKL_NUM_THREADS") or "").strip()
    if torch is not None and n.isdigit() and int(n) > 0 and torch.get_num_threads() != int(n):
        torch.set_num_threads(int(n))


class ForkedProcess:
    """What submitit's controller uses of a ``subprocess.Popen``: ``pid``, ``poll()``, ``send_signal()``
    and ``returncode`` (a signal's death as minus its number, as Popen reports it)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: Optional[int] = None

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                return self.returncode
            if pid == self.pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)


def fork_process(argv: List[str], env: Dict[str, str], stdout: IO, stderr: IO) -> ForkedProcess:
    """A process forked from this one that runs ``python -u -c BOOTSTRAP`` with ``argv`` as its sys.argv.
    The stop signals stay blocked across the fork, so none reaches a handler of this process in the
    child: the child installs the bootstrap's holders first, then takes them."""
    sys.stdout.flush()
    sys.stderr.flush()
    old = signal.pthread_sigmask(signal.SIG_BLOCK, _STOPS)
    try:
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child never returns from here
            _child(argv, env, stdout, stderr, old)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
    return ForkedProcess(pid)


def _child(argv: List[str], env: Dict[str, str], stdout: IO, stderr: IO, mask) -> None:  # pragma: no cover
    code: object = 1
    try:
        # ps and pgrep -f show the command it would have run (the bootstrap left out where it does not fit)
        warm_server.set_cmdline([sys.executable, "-u", "-c", job_start.BOOTSTRAP, *argv[1:]],
                                shorter=[sys.executable, *argv[1:]])
        os.dup2(stdout.fileno(), 1)
        os.dup2(stderr.fileno(), 2)
        # what ``python -u`` gives a new interpreter: unbuffered, written through
        sys.stdout = sys.__stdout__ = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
        sys.stderr = sys.__stderr__ = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True,
                                                       errors="backslashreplace")
        os.environ.clear()
        os.environ.update(env)
        for s in _STOPS:
            signal.signal(s, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        # the bootstrap's holders (job_start.BOOTSTRAP), before any stop signal is taken
        for s in (signal.SIGUSR2, signal.SIGTERM):
            signal.signal(s, _hold)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        sys.argv = argv[argv.index("-m") + 1:]
        try:
            runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as e:
            code = e.code
        except BaseException:  # an uncaught error: the traceback and status 1, as the interpreter gives
            traceback.print_exc()
            code = 1
        warm_server.finish()
    finally:
        os._exit(warm_server.exit_status(code))


def _hold(signum, _frame) -> None:  # pragma: no cover - runs in the child
    os.environ[job_start.HELD_ENV] = os.environ.get(job_start.HELD_ENV, "") + f"{signum},"
