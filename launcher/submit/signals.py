"""Signals during a launch: SIGTERM and SIGHUP handled as SIGINT is, and the few steps that must not
be cut in two (an ``sbatch`` and the record of the job it queued; publishing) shielded from all three.

SIGTERM is what ``timeout``, CI runners and batch systems send; SIGHUP, a closed terminal. Left at
their default action they end the process where it stands, with jobs queued that no run dir names.
``install`` makes each raise ``Terminated`` (a KeyboardInterrupt: every path that already cleans up
after Ctrl-C cleans up after these too); inside ``shielded()`` a signal is held until the block ends.
"""
from __future__ import annotations

import os
import signal
import threading
from contextlib import contextmanager
from typing import Callable, Iterator, List, Optional

HANDLED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP arrived: the launch stops as it does on Ctrl-C."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"{signal.Signals(signum).name} received")
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


_depth = 0  # how many shielded() blocks are open (main thread only: signals are delivered there)
_held: List[int] = []  # signals that arrived inside one, raised when the outermost ends


def interrupt_for(signum: int) -> KeyboardInterrupt:
    return KeyboardInterrupt() if signum == signal.SIGINT else Terminated(signum)


def _handler(signum: int, _frame) -> None:
    if _depth > 0:
        _held.append(signum)
        return
    raise interrupt_for(signum)


def install() -> None:
    """SIGTERM and SIGHUP raise Terminated, SIGINT KeyboardInterrupt (as Python's default does), each
    held inside shielded(). Main thread only (elsewhere Python refuses signal handlers): a no-op."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in HANDLED:
        current = signal.getsignal(sig)
        # a handler someone else installed (a test runner's), or SIGHUP ignored (nohup): theirs to keep
        if current in (signal.SIG_DFL, signal.default_int_handler, _handler):
            signal.signal(sig, _handler)


@contextmanager
def handled(resend: Callable[[int, int], None] = os.kill) -> Iterator[None]:
    """``install`` for the block only, the handlers it found put back after it: for a launch inside
    someone else's process (a Hydra app's multirun on this project's launcher plugin). A SIGTERM or
    SIGHUP that stopped the block (Terminated: what was queued published, the rest cancelled) is
    sent again once the process's own handlers are back, so the process then ends, or goes on, as it
    would have without us; Terminated is raised if it goes on."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.getsignal(sig) for sig in HANDLED}
    install()
    try:
        yield
    except Terminated as e:
        _restore(previous)
        resend(os.getpid(), e.signum)  # by default: the process ends by that signal, as it would have
        raise
    finally:
        _restore(previous)


def _restore(previous: dict) -> None:
    _held.clear()
    for sig, handler in previous.items():
        if handler is not None:  # None: a handler not installed from Python, nothing to put back
            signal.signal(sig, handler)


@contextmanager
def shielded() -> Iterator[None]:
    """Hold SIGINT/SIGTERM/SIGHUP until the block ends, then raise the first that came. For steps whose
    halves alone leave a lie on disk: the sbatch of an array and the record of its job id."""
    global _depth
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        if _depth == 0 and _held:
            first = _held[0]
            _held.clear()
            raise interrupt_for(first)


def pending() -> Optional[int]:
    """The signal held so far inside the open shielded() block (None: none)."""
    return _held[0] if _held else None
