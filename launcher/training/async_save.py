"""A checkpoint's asynchronous save (``train.checkpoint.async_save``): the copy of the state to host
memory, its writer thread, and the optimizer step's wait for the copy; the Checkpointer
(launcher.training.checkpoint) inherits it (AsyncSaver).

The step loop is not blocked by the write: the state is copied into reused host buffers while the
next forward and backward run, and a background thread then serialises and writes it (one save in
flight at a time). GPU tensors: the main thread enqueues their copies (to pinned buffers) on a side
stream that waits for the compute stream, and records an event; the next optimizer step's stream
waits for that event on the device, the writer thread (bound to the rank's GPU: CUDA's current
device is per thread) waits for it before writing, never for the whole device. Host tensors: the
thread copies them, and the next optimizer step waits for that. A rank with no GPU tensor to copy
makes no CUDA call at all (no context on GPU 0). DeepSpeed's own save is synchronous; so is a save
of an engine (or a ``Checkpoint``) that names no optimizer.
"""
from __future__ import annotations

import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch

# Every CUDA call of this module goes through this name (a unit test puts a fake CUDA module here).
cuda = torch.cuda


def _device_index(t: torch.Tensor) -> Optional[int]:
    """The CUDA device a tensor lives on (None: host memory)."""
    return t.device.index if t.is_cuda else None


def _host_buffer(src: torch.Tensor, pinned: bool) -> torch.Tensor:
    return torch.empty(src.shape, dtype=src.dtype, device="cpu", pin_memory=pinned)


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    """The tensors of a state (nested dicts, lists, tuples), in order (a DTensor's local part)."""
    if is_dtensor(obj):
        yield obj._local_tensor
        return
    if torch.is_tensor(obj):
        yield obj
        return
    for v in obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ():
        yield from _tensors(v)


def pinned_bytes(obj: Any) -> int:
    """Bytes of the pinned host tensors in a (nested) state."""
    return sum(t.numel() * t.element_size() for t in _tensors(obj) if t.is_pinned())


_TAKEN = object()  # host_copy's ``seen``: the key of the buffers already filled


def is_dtensor(obj: Any) -> bool:
    return type(obj).__name__ == "DTensor" and hasattr(obj, "_local_tensor")


def tensor_identity(t: torch.Tensor) -> Tuple[Any, ...]:
    """What makes two references the same tensor (one copy for both: DDP's universal state names the
    very parameters and moments its native state holds)."""
    return (t.device, t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride()), t.storage_offset())


def host_copy(obj: Any, reuse: Any = None, deferred: Optional[List[Tuple[torch.Tensor, torch.Tensor]]] = None,
              seen: Optional[Dict[Any, torch.Tensor]] = None) -> Any:
    """A copy of a state (nested dicts, lists, tuples of tensors and plain values) whose tensors are
    host-memory copies: training may change the originals while the copy is written. ``reuse`` (the
    previous copy of the same state, already written) lends its buffers: no fresh allocation (and
    page faults) per save; buffers of GPU tensors are pinned, so the copy runs at full link speed and
    is enqueued (non-blocking) on the caller's current CUDA stream. ``deferred``: host tensors are not
    copied here but their (buffer, source) pairs appended, for a thread to copy later. ``seen``: the
    copies made so far in this save, by source tensor: a tensor the state names twice is copied once.
    A DTensor (FSDP2's shard, a tensor-parallel slice) becomes a DTensor of the same placement over a
    host copy of this rank's local part (what torch.distributed.checkpoint writes): no gather."""
    if seen is None:
        seen = {}
    if is_dtensor(obj):
        old = reuse._local_tensor if is_dtensor(reuse) else None
        local = host_copy(obj._local_tensor, old, deferred, seen)
        return type(obj)(local, obj._spec, requires_grad=False)
    if torch.is_tensor(obj):
        src = obj.detach()
        key = tensor_identity(src)
        if key in seen:
            return seen[key]
        on_gpu = _device_index(src) is not None
        taken = seen.setdefault(_TAKEN, set())  # (ids of the buffers this save already fills)
        if torch.is_tensor(reuse) and reuse.shape == src.shape and reuse.dtype == src.dtype and not reuse.is_cuda \
                and id(reuse) not in taken:
            buf = reuse
        else:
            buf = _host_buffer(src, on_gpu)
        if deferred is not None and not on_gpu:
            deferred.append((buf, src))
        else:
            buf.copy_(src, non_blocking=on_gpu)
        seen[key] = buf
        taken.add(id(buf))
        return buf
    if isinstance(obj, dict):
        old = reuse if isinstance(reuse, dict) else {}
        return {k: host_copy(v, old.get(k), deferred, seen) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        old = reuse if isinstance(reuse, (list, tuple)) and len(reuse) == len(obj) else [None] * len(obj)
        return type(obj)(host_copy(v, o, deferred, seen) for v, o in zip(obj, old))
    return obj


def gpu_of(obj: Any) -> Optional[int]:
    """The CUDA device of the first GPU tensor in a state (None: every tensor is in host memory)."""
    return next((d for d in map(_device_index, _tensors(obj)) if d is not None), None)


@dataclass
class _Copy:
    """One save's copy to host memory, as the main thread started it. ``staged`` None: nothing is on a
    GPU, a thread copies it all (host_copy). Else the GPU tensors' copies are enqueued on a side stream
    of ``device`` and land when ``event`` completes; the host tensors' copies are ``deferred``."""

    staged: Optional[Dict[str, Any]] = None
    deferred: List[Tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    event: Any = None
    device: Optional[int] = None


RETURN_WAIT_S = 1.0  # the most a writer thread waits for save() to return (a save that raised: it goes on)
SETTLE_S = 60.0  # how long a rank that failed gives its save in flight to be written and committed
_LIVE: weakref.WeakSet[AsyncSaver] = weakref.WeakSet()  # this process's savers (settle_in_flight)


def settle_in_flight(timeout_s: float = SETTLE_S) -> None:
    """A rank whose step raised: each save it has in flight (its state already in host memory) written
    and committed before the rank reports its failure and ends, which would end the other ranks' writer
    threads with it; at most ``timeout_s`` each."""
    for saver in list(_LIVE):
        saver.settle(timeout_s)


class AsyncSaver:
    """The Checkpointer's asynchronous save: the host copies of its engine's state (whose buffers the
    next save reuses), the writer thread, and the optimizer pre-hooks that wait for the copy. Uses the
    Checkpointer's ``engine``, ``blocked_s`` and ``_write`` (writes and commits a rank's part)."""

    engine: Any
    blocked_s: float
    rd: Any

    def _init_async_save(self) -> None:
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self._staged: Dict[str, Any] = {}  # the last save's host copies (their buffers are reused)
        self._copied = threading.Event()
        self._copied.set()
        self._hooks: Optional[List[Any]] = None
        self._stream: Any = None  # the side CUDA stream the device->host copies run on (made once)
        self._event: Any = None  # the copies in flight on it: the next optimizer step's stream waits for it
        self._event_device: Optional[int] = None
        self._in_flight_step: Optional[int] = None  # the step of the save the writer thread writes
        # set once save() has returned to the training loop: the writer's Python work (the host copy's
        # walk, a first save's links) waits for it rather than take the GIL from save()'s last lines
        self._returned = threading.Event()
        _LIVE.add(self)

    def _write(self, partial: Path, staged: Dict[str, Any], step: int, feed: bool = False) -> None:
        raise NotImplementedError  # the Checkpointer's

    def _write_in_background(self, partial: Path, live: Dict[str, Any], small: Dict[str, Any], step: int) -> None:
        """Start the copy of ``live`` and the thread that finishes it and writes it with ``small``
        (already host values); returns at once (save's asynchronous case)."""
        started = self._start_copy(live)  # GPU tensors: enqueued now, behind this step's kernels
        self._copied.clear()
        self._returned.clear()
        self._in_flight_step = step
        if started.event is not None:
            self._event, self._event_device = started.event, started.device
        self._thread = threading.Thread(target=self._copy_and_write, args=(partial, live, small, step, started),
                                        name="checkpoint-writer", daemon=True)
        self._thread.start()

    def _hooked(self) -> bool:
        """Make every optimizer of the engine wait for a copy in flight before it steps (once)."""
        if self._hooks is None:
            opts = list(getattr(self.engine, "optimizers", lambda: [])())
            self._hooks = [opt.register_step_pre_hook(lambda *_: self.wait_copied()) for opt in opts]
        return bool(self._hooks)

    def _start_copy(self, live: Dict[str, Any]) -> _Copy:
        """In the main thread (its current device is the rank's): enqueue the GPU tensors' copies to
        pinned host buffers on a side stream that first waits for the compute stream (the copies read
        the state this step left), then record an event after them. A state with no GPU tensor (an
        empty part included) makes no CUDA call at all."""
        device = gpu_of(live)  # (a rank's GPU tensors are all on its one GPU)
        if device is None:
            return _Copy()
        compute = cuda.current_stream(device)
        if self._stream is None:
            self._stream = cuda.Stream(device=device)
        self._stream.wait_stream(compute)
        deferred: List[Tuple[torch.Tensor, torch.Tensor]] = []
        first = not self._staged
        seen: Dict[Any, torch.Tensor] = {}
        with cuda.stream(self._stream):
            staged = {name: host_copy(state, self._staged.get(name), deferred, seen) for name, state in live.items()}
        if first:  # held for the whole run: the job's host memory (cluster.mem_gb) must leave room for it
            print(f"[checkpoint] {pinned_bytes(staged) / 2 ** 30:.2f} GiB of pinned host memory hold this rank's "
                  "async-save copies (GPU state), reused by every save", flush=True)
        event = cuda.Event()
        event.record(self._stream)
        return _Copy(staged, deferred, event, device)

    def _finish_copy(self, live: Dict[str, Any], started: _Copy) -> Dict[str, Any]:
        """The host part of a copy (all of it when nothing is on a GPU); the GPU part may still be in
        flight (``started.event``)."""
        if started.staged is None:
            seen: Dict[Any, torch.Tensor] = {}
            staged = {name: host_copy(state, self._staged.get(name), None, seen) for name, state in live.items()}
        else:
            for buf, src in started.deferred:
                buf.copy_(src)
            staged = started.staged
        self._staged = staged
        return staged

    def _copy(self, live: Dict[str, Any]) -> Dict[str, Any]:
        """The whole copy, in the calling (main) thread: returns once every copy has landed."""
        started = self._start_copy(live)
        staged = self._finish_copy(live, started)
        if started.event is not None:
            started.event.synchronize()  # this save's copies only, not the whole device
        return staged

    def _before_copy(self, live: Dict[str, Any], small: Dict[str, Any]) -> Tuple[Dict[str, Any], Dict[str, Any]]:
        """In the writer thread, before the copy: what to copy and which small files to write (the
        Checkpointer's: decides a first save's universal links there)."""
        return live, small

    def _copy_and_write(self, partial: Path, live: Dict[str, Any], small: Dict[str, Any], step: int,
                        started: _Copy) -> None:
        try:
            self._returned.wait(RETURN_WAIT_S)
            if started.device is not None:  # CUDA's current device is per thread: a new one starts on 0
                cuda.set_device(started.device)
            live, small = self._before_copy(live, small)  # (the state is still the save's: the step waits)
            staged = self._finish_copy(live, started)
            staged = {k: v for k, v in staged.items() if k in live}  # (a GPU copy started holds them all)
        except BaseException as e:  # surfaced by the next wait()
            self._error = e
            return
        finally:
            self._copied.set()
        try:
            if started.event is not None:
                started.event.synchronize()  # the pinned buffers hold this save's state (``live``, held
                # by this thread until here, kept the GPU tensors from being freed and reused meanwhile)
        except BaseException as e:
            self._error = e
            return
        self._write_guarded(partial, {**staged, **small}, step)

    def settle(self, timeout_s: float = SETTLE_S) -> bool:
        """Until the save in flight (if any) is written by this rank and committed by the last rank to
        finish it, at most ``timeout_s``; whether it is committed (nothing in flight: True)."""
        thread, step = self._thread, self._in_flight_step
        if thread is None or step is None:
            return True
        t0 = time.monotonic()
        thread.join(timeout_s)
        # the other ranks write their parts beside this one: as long again as this save has taken so far
        # (at least 5 s) is their time to commit it (a rank that died never will: no longer than that)
        deadline = min(t0 + timeout_s, time.monotonic() + max(5.0, time.monotonic() - t0 + self._took()))
        final = self.rd.checkpoint_dir(step)
        while not final.exists() and self._error is None and not thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.1)  # (another rank's writer thread still writing its part)
        return final.exists()

    def _took(self) -> float:
        """Seconds since the save in flight started (the Checkpointer's clock)."""
        return max(0.0, time.perf_counter() - float(getattr(self, "_save_t0", time.perf_counter())))

    def wait_copied(self) -> None:
        """Until the state of the save in flight is in host memory (the training state may change):
        the host copies are waited for here; the GPU copies by the current stream (the optimizer
        step's kernels wait on the device, the host does not block)."""
        if not self._copied.is_set():
            t0 = time.perf_counter()
            self._copied.wait()
            self.blocked_s += time.perf_counter() - t0
        if self._event is not None:
            cuda.current_stream(self._event_device).wait_event(self._event)
            self._event = None

    def _write_guarded(self, partial: Path, staged: Dict[str, Any], step: int) -> None:
        try:
            self._write(partial, staged, step)
        except BaseException as e:  # surfaced by the next wait()
            self._error = e
