"""Spreading a launch's per-point work: its per-run writes over threads where the file system makes each
wait (a network file system's round trips), over two processes where the work is the interpreter's (a
local disk); its points' checks over two processes (launcher.submit.pipeline.validate)."""
from __future__ import annotations

import json
import os
import pickle
import signal
import time
from typing import Any, Callable, Optional

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


def in_processes(fn: Callable[[Any], Any], items: list, pickled: bool = False) -> list:
    """``[fn(x) for x in items]`` where ``fn`` writes files and returns what JSON holds: the first few
    here (they load what ``fn`` imports lazily, before a fork), then half of the rest in a forked child
    (its results come back through a pipe) while this process does the other half, on a host with a
    second core. ``fn`` must be safe to run again on an item: where the child fails, or has not answered
    in ``_CHILD_S`` plus ``_ITEM_S`` an item, it is ended and this process does its half itself.
    ``pickled``: ``fn`` computes (no file to wait on: no threads) and its results come back pickled
    (any object of this program: the child runs the same code)."""
    each = (lambda xs: [fn(x) for x in xs]) if pickled else (lambda xs: in_threads(fn, xs))
    if len(items) < _FORK_MIN or not hasattr(os, "fork") or len(os.sched_getaffinity(0)) < 2:
        return each(items)
    out = [fn(x) for x in items[:_PROBE]]
    rest = items[_PROBE:]
    half = len(rest) // 2
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child never returns from here
        os.close(read)
        code = 0
        try:
            signal.signal(signal.SIGINT, signal.SIG_DFL)  # Ctrl-C ends it; the parent redoes or undoes
            done = each(rest[half:])  # (its waits overlap as ours)
            data = pickle.dumps(done, protocol=pickle.HIGHEST_PROTOCOL) if pickled else \
                json.dumps(done, default=str).encode()
        except BaseException:
            data, code = b"", 1
        try:
            with os.fdopen(write, "wb") as f:
                f.write(data)
        finally:
            os._exit(code)  # no atexit handler, no buffered output of the parent's written twice
    os.close(write)
    status, data = 1, b""
    try:
        out += each(rest[:half])
        data = _read_all(read, time.monotonic() + _CHILD_S + _ITEM_S * len(rest))
        if data is not None:
            status = os.waitpid(pid, 0)[1]
            pid = 0
    finally:
        os.close(read)
        if pid:  # interrupted (Ctrl-C, a write that failed here) or too slow: ended before anything is undone
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    if status != 0 or not data:
        return out + [fn(x) for x in rest[half:]]
    return out + (pickle.loads(data) if pickled else json.loads(data))


_CHILD_S = 60.0  # the child's answer is awaited this long, plus _ITEM_S an item
_ITEM_S = 0.05


def _read_all(fd: int, deadline: float) -> Optional[bytes]:
    """Everything the child writes to ``fd`` until it closes it; None past ``deadline``."""
    import select

    chunks = []
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return None
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
