"""Signals during a launch: SIGTERM and SIGHUP handled as SIGINT is, and the few steps that must not
be cut in two (an ``sbatch`` and the record of the job it queued; publishing) shielded from all three.

SIGTERM is what ``timeout``, CI runners and batch systems send; SIGHUP, a closed terminal. Left at
their default action they end the process where it stands, with jobs queued that no run dir names.
``install`` makes each raise ``Terminated`` (a KeyboardInterrupt: every path that already cleans up
after Ctrl-C cleans up after these too); inside ``shielded()`` a signal is held until the block ends.
"""
from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Iterator, List, Optional

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
