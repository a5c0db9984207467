"""Spreading a launch's per-run writes: over threads where the file system makes each wait (a network
file system's round trips), over two processes where the work is the interpreter's (a local disk)."""
from __future__ import annotations

import json
import os
import signal
import time
from typing import Any, Callable

_PROBE = 16  # items timed before deciding
_WAIT_S = 0.5e-3  # waited per item (not computing) past which threads overlap the waits
_FORK_MIN = 64  # fewer items than this: a fork (~10 ms) costs more than half their work saves


def in_threads(fn: Callable[[Any], Any], items: list) -> list:
    """``[fn(x) for x in items]``; in a few threads when the first items show each waiting on the file
    system (a network file system's round trips: milliseconds a file), so that the waits overlap. On a
    local disk the work is the interpreter's, and threads only contend for it (sequential was ~20%
    faster at 1,000 runs)."""
    out = [fn(x) for x in items[:_PROBE]]  # the first ones warm caches
    wall, cpu = time.perf_counter(), time.thread_time()
    out += [fn(x) for x in items[_PROBE:2 * _PROBE]]
    waited = (time.perf_counter() - wall) - (time.thread_time() - cpu)
    rest = items[2 * _PROBE:]
    if not rest or waited < _PROBE * _WAIT_S:
        return out + [fn(x) for x in rest]
    # threads only when submitting or archiving for real, not on a dry run
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=4) as pool:
        return out + list(pool.map(fn, rest))


def in_processes(fn: Callable[[Any], Any], items: list) -> list:
    """``[fn(x) for x in items]`` where ``fn`` writes files and returns what JSON holds: the second half
    in a forked child (its results come back through a pipe) while this process does the first, on a
    host with a second core. ``fn`` must be safe to run again on an item: where the child fails, this
    process does its half itself. Otherwise as ``in_threads``."""
    if len(items) < _FORK_MIN or not hasattr(os, "fork") or len(os.sched_getaffinity(0)) < 2:
        return in_threads(fn, items)
    half = len(items) // 2
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child never returns from here
        os.close(read)
        code = 0
        try:
            signal.signal(signal.SIGINT, signal.SIG_DFL)  # Ctrl-C ends it; the parent redoes or undoes
            data = json.dumps([fn(x) for x in items[half:]], default=str).encode()
        except BaseException:
            data, code = b"", 1
        try:
            with os.fdopen(write, "wb") as f:
                f.write(data)
        finally:
            os._exit(code)  # no atexit handler, no buffered output of the parent's written twice
    os.close(write)
    try:
        mine = in_threads(fn, items[:half])
        with os.fdopen(read, "rb") as f:
            data = f.read()
        _, status = os.waitpid(pid, 0)
        pid = 0
    finally:
        if pid:  # interrupted (Ctrl-C, a write that failed here): the child stops before anything is undone
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    if status != 0 or not data:
        return mine + [fn(x) for x in items[half:]]
    return mine + json.loads(data)
