"""Checkpoints that let a run continue bit for bit, written aside and made visible by one rename.

Public API (docs/training-api.md): ``Checkpoint(cfg, ctx, {"model": model, "optimizer": opt})`` for
any named objects with ``state_dict``/``load_state_dict``; ``Checkpointer(cfg, ctx, engine)`` for an
engine with its own files (a recipe's engines: the ``Engine`` protocol below). Both resume from
``latest`` and rewind the run's metrics file to the resumed step (``resume``).

A checkpoint after step n is the directory ``checkpoints/step_<n>/`` of the run dir (names: RunDir):

- each engine's own state: ``Engine.save_native`` (DeepSpeed's save_checkpoint: model, optimizer,
  ZeRO partitions, loss scaler) and/or ``Engine.checkpoint_files`` (ddp: one model+optimizer file
  from data-parallel rank 0; megatron: one file per (pp, tp) shard, plus one per rank for ZeRO-1's
  optimizer partitions; ``Checkpoint``'s objects: ``state.pt`` from rank 0, ``state_rank_<r>.pt``
  from every rank for the per-rank ones);
- ``rng_rank_<r>.pt``: every RNG state of every rank (torch, CUDA, Python, NumPy, and the engine's
  dropout streams: ``engine.rng_tracker``, e.g. a tensor-parallel engine's RNG tracker);
- ``meta.json`` (rank 0): the step (the data position: a step's batch is a pure function of the
  step, as in recipes.common.data, or a per-rank sampler's state is saved too) and the metrics rows
  so far.

Every rank writes its part into ``checkpoints/.step_<n>.partial/``, drops a ``done_rank_<r>``
marker (with the sha256 of each file it wrote) and adds 1 to the save's counter in the process
group's store (no rank lists the directory); the rank whose add completes the count writes
``checkpoint.json`` (every file's size and sha256: launcher.run.checkpoint_manifest), renames the
directory into place and only then points ``checkpoints/latest`` at it, so ``latest`` only ever
names a complete checkpoint. A crash mid-write leaves a partial directory, which the next attempt
deletes. The last ``train.checkpoint.keep`` complete checkpoints are kept (that rank deletes older
ones in a thread: ``wait`` joins it). ``resume`` loads only a
checkpoint that rank 0 verified against its manifest (a corrupt ``latest``: the newest earlier
intact one, or ``CheckpointCorrupt`` on every rank).

With ``train.checkpoint.async_save`` the step loop is not blocked by the write: the state is copied
into reused host buffers while the next forward and backward run, and a background thread then
serialises and writes it (one save in flight at a time). GPU tensors: the main thread enqueues their
copies (to pinned buffers) on a side stream that waits for the compute stream, and records an event;
the next optimizer step's stream waits for that event on the device, the writer thread (bound to
the rank's GPU: CUDA's current device is per thread) waits for it before writing, never for the
whole device. Host tensors: the thread copies them, and the next optimizer step waits for that. A
rank with no GPU tensor to copy makes no CUDA call at all (no context on GPU 0). DeepSpeed's own
save is synchronous; so is a save of an engine (or a ``Checkpoint``) that names no optimizer.
"""
from __future__ import annotations

import copy
import json
import os
import random
import shutil
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Protocol, Tuple

import torch
import torch.distributed as dist

from launcher.config.schema import enum_value
from launcher.config.seeding import derive_seed
from launcher.run import checkpoint_manifest
from launcher.run.checkpoint_manifest import CheckpointCorrupt
from launcher.training import universal

RNG_FILE = "rng_rank_{rank:05d}.pt"
META_FILE = "meta.json"
DONE_FILE = "done_rank_{rank:05d}"
STATE_FILE = "state.pt"  # a Checkpoint's objects (rank 0)
RANK_STATE_FILE = "state_rank_{rank:05d}.pt"  # a Checkpoint's per-rank objects (every rank)


class Engine(Protocol):
    """What the Checkpointer needs of the thing it saves (a recipe's engine; Objects)."""

    def save_native(self, path: Path) -> None:
        """Write a collective, synchronous save of its own into ``path`` (or nothing)."""

    def checkpoint_files(self) -> Dict[str, Any]:
        """File name -> the live state this rank writes (copied to host memory before it changes)."""

    def load_checkpoint(self, path: Path) -> None:
        """Restore this rank's state from the checkpoint directory ``path``."""

    def optimizers(self) -> List[Any]:
        """The optimizers whose step is the only change to the saved state (none: saves are synchronous)."""

    # optional, for resuming on another layout (launcher.training.universal): ``universal_state()`` (its
    # state by parameter name, as torch.distributed.checkpoint saves it) and ``load_universal(path)``


def rng_state(tracker: Any = None) -> Dict[str, Any]:
    """This process's RNG states; ``tracker``: an RNG tracker whose streams are saved too (state_dict)."""
    state: Dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if tracker is not None:
        state["tracker"] = tracker.state_dict()
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:
        pass
    return state


def set_rng_state(state: Dict[str, Any], tracker: Any = None) -> None:
    """Restore ``rng_state``'s states (and ``tracker``'s streams, when saved: a checkpoint from before
    the engine had a tracker leaves it freshly seeded)."""
    torch.set_rng_state(state["torch"])
    if tracker is not None and "tracker" in state:
        tracker.load_state_dict(state["tracker"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])


def reseed(seed: int) -> None:
    """Seed torch (every device), Python's and NumPy's generators from ``seed``."""
    torch.manual_seed(seed)
    random.seed(seed)
    try:
        import numpy as np
    except ImportError:
        return
    np.random.seed(seed % 2**32)


# Every CUDA call of this module goes through this name (a unit test puts a fake CUDA module here).
cuda = torch.cuda


def _device_index(t: torch.Tensor) -> Optional[int]:
    """The CUDA device a tensor lives on (None: host memory)."""
    return t.device.index if t.is_cuda else None


def _host_buffer(src: torch.Tensor, pinned: bool) -> torch.Tensor:
    return torch.empty(src.shape, dtype=src.dtype, device="cpu", pin_memory=pinned)


def host_copy(obj: Any, reuse: Any = None, deferred: Optional[List[Tuple[torch.Tensor, torch.Tensor]]] = None) -> Any:
    """A copy of a state (nested dicts, lists, tuples of tensors and plain values) whose tensors are
    host-memory copies: training may change the originals while the copy is written. ``reuse`` (the
    previous copy of the same state, already written) lends its buffers: no fresh allocation (and
    page faults) per save; buffers of GPU tensors are pinned, so the copy runs at full link speed and
    is enqueued (non-blocking) on the caller's current CUDA stream. ``deferred``: host tensors are not
    copied here but their (buffer, source) pairs appended, for a thread to copy later."""
    if torch.is_tensor(obj):
        src = obj.detach()
        on_gpu = _device_index(src) is not None
        if torch.is_tensor(reuse) and reuse.shape == src.shape and reuse.dtype == src.dtype and not reuse.is_cuda:
            buf = reuse
        else:
            buf = _host_buffer(src, on_gpu)
        if deferred is not None and not on_gpu:
            deferred.append((buf, src))
        else:
            buf.copy_(src, non_blocking=on_gpu)
        return buf
    more = () if deferred is None else (deferred,)  # (the plain two-argument call where none)
    if isinstance(obj, dict):
        old = reuse if isinstance(reuse, dict) else {}
        return {k: host_copy(v, old.get(k), *more) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        old = reuse if isinstance(reuse, (list, tuple)) and len(reuse) == len(obj) else [None] * len(obj)
        return type(obj)(host_copy(v, o, *more) for v, o in zip(obj, old))
    return obj


def gpu_of(obj: Any) -> Optional[int]:
    """The CUDA device of the first GPU tensor in a state (None: every tensor is in host memory)."""
    if torch.is_tensor(obj):
        return _device_index(obj)
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()
    for v in items:
        found = gpu_of(v)
        if found is not None:
            return found
    return None


@dataclass
class _Copy:
    """One save's copy to host memory, as the main thread started it. ``staged`` None: nothing is on a
    GPU, a thread copies it all (host_copy). Else the GPU tensors' copies are enqueued on a side stream
    of ``device`` and land when ``event`` completes; the host tensors' copies are ``deferred``."""

    staged: Optional[Dict[str, Any]] = None
    deferred: List[Tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    event: Any = None
    device: Optional[int] = None


@dataclass(frozen=True)
class _Slot:
    """Where the ``index``-th broadcast tensor goes in a state sent by load_on_one_rank."""

    index: int


def _slots(obj: Any, tensors: List[torch.Tensor], seen: Dict[Any, int]) -> Any:
    """``obj`` with each tensor replaced by a _Slot (appended to ``tensors``; one tensor named twice,
    e.g. tied weights, is sent once and arrives as one)."""
    if torch.is_tensor(obj):
        key = (obj.untyped_storage().data_ptr(), obj.storage_offset(), tuple(obj.shape), obj.stride(), obj.dtype)
        if key not in seen:
            seen[key] = len(tensors)
            tensors.append(obj.contiguous())
        return _Slot(seen[key])
    if isinstance(obj, dict):
        return {k: _slots(v, tensors, seen) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_slots(v, tensors, seen) for v in obj)
    return obj


def _filled(obj: Any, tensors: List[torch.Tensor]) -> Any:
    if isinstance(obj, _Slot):
        return tensors[obj.index]
    if isinstance(obj, dict):
        return {k: _filled(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_filled(v, tensors) for v in obj)
    return obj


def load_on_one_rank(path: Path, device: Any, src: int = 0) -> Any:
    """``torch.load(path)`` (weights only, onto ``device``) of a file every rank needs whole (ddp's
    replicated model and optimizer): read by rank ``src`` alone, then its tensors broadcast to every
    rank of the default group, bit for bit. One read of the file per job instead of one per rank
    (a 1.3B model: 15.6 GB); every rank calls it. Without a process group: a plain load."""
    device = torch.device(device)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return torch.load(path, map_location=device, weights_only=True)
    tensors: List[torch.Tensor] = []
    box: List[Any] = [None]
    if dist.get_rank() == src:
        tree = _slots(torch.load(path, map_location=device, weights_only=True), tensors, {})
        box = [(tree, [(tuple(t.shape), t.dtype) for t in tensors])]
    dist.broadcast_object_list(box, src=src)  # the structure and the plain values (small)
    tree, specs = box[0]
    if dist.get_rank() != src:
        tensors = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in specs]
    for t in tensors:  # (bool as bytes: not every backend reduces or sends bool)
        dist.broadcast(t.view(torch.uint8) if t.dtype == torch.bool else t, src=src)
    return _filled(tree, tensors)


def _write_file(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        if path.suffix == ".json":
            f.write(json.dumps(obj).encode())
        else:
            torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class Checkpointer:
    """Save, resume and prune the checkpoints of one rank of a run (see the module doc)."""

    def __init__(self, cfg: Any, ctx: Any, engine: Engine, *, every: Optional[int] = None,
                 keep: Optional[int] = None, async_save: Optional[bool] = None, store: Any = None) -> None:
        """``every``, ``keep``, ``async_save``: train.checkpoint's values unless given. ``store``: where
        the ranks count their written parts (a torch.distributed Store; default: the default process
        group's, or a store of this process's own where there is no group)."""
        ck = cfg.train.checkpoint
        self.every = int(ck.every if every is None else every)
        self.keep = int(ck.keep if keep is None else keep)
        self.async_save = bool(ck.async_save if async_save is None else async_save)
        self.seed = int(getattr(cfg, "seed", 0) or 0)
        self.universal = bool(getattr(ck, "universal", True))  # also write universal/ (any layout loads it)
        self._universal_files: List[str] = []  # the universal files this rank wrote in the save in flight
        self.resharded: Optional[Dict[str, Any]] = None  # the reshard record, when resume loaded another layout's
        self.steps = int(cfg.train.steps)
        self.ctx, self.rd, self.engine = ctx, ctx.rundir, engine
        self.rank, self.world = int(ctx.rank), int(ctx.world_size)
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self._staged: Dict[str, Any] = {}  # the last save's host copies (their buffers are reused)
        self._copied = threading.Event()
        self._copied.set()
        self._hooks: Optional[List[Any]] = None
        self._stream: Any = None  # the side CUDA stream the device->host copies run on (made once)
        self._event: Any = None  # the copies in flight on it: the next optimizer step's stream waits for it
        self._event_device: Optional[int] = None
        self._store = store
        self._saves = 0  # saves so far: with the step, the store key the ranks count one save under
        self._pruner: Optional[threading.Thread] = None
        self._latest_meta: Optional[Dict[str, Any]] = None  # meta.json of the checkpoint resumed, as rank 0 read it
        self.blocked_s = 0.0  # time the training loop spent waiting for saves (benchmarks read it)
        tr = cfg.train
        drill = tr.fail_at_step is not None and enum_value(tr.fail_mode) == "kill_in_save"
        # every rank saves at the drill's step; the drilled rank (on the drilled attempt) dies in it
        self.kill_step: Optional[int] = int(tr.fail_at_step) if drill else None
        fires = (drill and int(tr.fail_rank) == self.rank
                 and (tr.fail_attempt is None or int(tr.fail_attempt) == ctx.attempt))
        self.kill_at: Optional[int] = self.kill_step if fires else None

    # ---- resume ------------------------------------------------------------------------------------
    def resume(self) -> Tuple[int, List[Dict[str, Any]]]:
        """Load ``latest`` if there is one: (the step it was taken after, the metrics rows up to it);
        (0, []) for a fresh start. Partial checkpoints an earlier attempt left are deleted first. A
        restarted attempt's metrics file is rewound to those rows (rank 0): the steps after the
        checkpoint (all of them, without one) are redone and logged again, once each."""
        if self.rank == 0:
            for p in self.rd.stale_partials():
                shutil.rmtree(p, ignore_errors=True)
        latest = self._verified_latest()
        step, rows = 0, []
        if latest is not None:
            meta = self._latest_meta or json.loads((latest / META_FILE).read_text())
            moves = universal.moved(meta.get("layout"), self._layout())
            if moves:
                self._reshard(latest, int(meta["step"]), meta["layout"], moves)
            else:
                self.engine.load_checkpoint(latest)
                set_rng_state(torch.load(latest / RNG_FILE.format(rank=self.rank), weights_only=False),
                              self._tracker())
            self.ctx.heartbeat()
            step, rows = int(meta["step"]), list(meta["metrics"])
        if self.rank == 0 and (step or int(self.ctx.attempt) > 1):
            self.rd.rewrite_metrics(rows)  # before this attempt logs a row (ctx appends to the file)
        return step, rows

    def _universal_state(self) -> Optional[Dict[str, Any]]:
        """The engine's layout-independent state (None: it has none; an engine may omit the method)."""
        get = getattr(self.engine, "universal_state", None)
        return get() if get is not None else None

    def _layout(self) -> Dict[str, Any]:
        layout = getattr(self.ctx, "layout", None)
        return layout.to_json() if layout is not None else {}

    def _reshard(self, ckpt: Path, step: int, saved: Dict[str, Any], moves: Dict[str, List[Any]]) -> None:
        """Resume from a checkpoint saved on another layout: every rank reads its own slices of the
        universal state, the load is checked bit for bit against what was saved (gathered), the RNG
        streams are re-derived for the new ranks (the saved ones belong to the old ranks), and rank 0
        records it all (reshard.jsonl) and says so."""
        what = ", ".join(f"{k} {a} -> {b}" for k, (a, b) in moves.items())
        if not universal.present(ckpt):
            raise RuntimeError(f"the checkpoint {ckpt.name} was saved on another layout ({what}) and has no "
                               f"layout-independent state ({universal.DIR}/: train.checkpoint.universal was off, or "
                               "its engine writes none): resume it on its own layout")
        ok = getattr(self.engine, "universal_ok", None)  # asked without building the state (a gather)
        if not (ok() if ok is not None else self._universal_state() is not None):
            raise RuntimeError(f"the checkpoint {ckpt.name} was saved on another layout ({what}), and this "
                               f"engine ({type(self.engine).__name__}) does not load layout-independent "
                               "checkpoints: resume it on its own layout")
        t0 = time.perf_counter()
        self.engine.load_universal(ckpt / universal.DIR)
        loaded_s = time.perf_counter() - t0
        check = universal.verify(self._universal_state(), ckpt / universal.DIR, self.rank,
                                 owned=bool(getattr(self.engine, "universal_owned", False)))
        # the engine's dropout streams (its tracker) stay as its new layout seeded them
        reseed(derive_seed(self.seed, "resharded", step, self.rank))
        record = {"step": step, "checkpoint": ckpt.name, "from": saved, "to": self._layout(), "moved": moves,
                  "load_s": round(loaded_s, 3), "verify": check, "rng": "torch, python and numpy generators "
                  "re-derived per rank: derive_seed(seed, 'resharded', step, rank); the engine's dropout "
                  "streams as its new layout seeds them", "bitwise_equal": not check["mismatched"]
                  and not check["missing"]}
        self.resharded = record
        if self.rank == 0:
            self.rd.record_reshard(record)
            print(f"launcher: resharded the checkpoint of step {step} ({what}): {check['tensors']} tensors, "
                  f"{check['bytes'] / 2**20:.1f} MiB gathered and "
                  + ("bitwise equal to the saved state" if record["bitwise_equal"] else
                     f"NOT equal to the saved state: {', '.join((check['mismatched'] + check['missing'])[:5])}"),
                  flush=True)
        if not record["bitwise_equal"]:
            raise RuntimeError(f"the resharded state differs from the checkpoint of step {step}: "
                               f"{', '.join((check['mismatched'] + check['missing'])[:5])} (reshard.jsonl)")

    def _verified_latest(self) -> Optional[Path]:
        """The checkpoint every rank resumes from: rank 0 verifies ``latest`` against its manifest
        (falling back past a corrupt one: launcher.run.checkpoint_manifest) and tells the others, so all
        load the same one or all raise the same CheckpointCorrupt (none waits for a rank that failed)."""
        verdict: Dict[str, Any] = {}
        failed: Optional[BaseException] = None
        if self.rank == 0 or not dist.is_initialized():
            try:
                point = checkpoint_manifest.resume_point(self.rd)
                if self.rank == 0:
                    checkpoint_manifest.adopt(self.rd, point, int(self.ctx.attempt))
                verdict = {"path": str(point.path) if point.path is not None else None}
                if point.path is not None:  # its step and metrics rows: read here, not by every rank
                    verdict["meta"] = json.loads((point.path / META_FILE).read_text())
            except CheckpointCorrupt as e:
                failed, verdict = e, {"corrupt": e.problems}
            except Exception as e:  # told to the others, then raised here
                failed, verdict = e, {"error": f"rank 0 could not verify the checkpoint: {type(e).__name__}: {e}"}
        if dist.is_initialized():
            box = [verdict]
            dist.broadcast_object_list(box, src=0)
            verdict = box[0]
        if failed is not None:
            raise failed
        if "corrupt" in verdict:
            raise CheckpointCorrupt(verdict["corrupt"])
        if "error" in verdict:
            raise RuntimeError(verdict["error"])
        self._latest_meta = verdict.get("meta")
        return Path(verdict["path"]) if verdict["path"] else None

    def _tracker(self) -> Any:
        """The engine's dropout RNG streams (its ``rng_tracker``: state_dict/load_state_dict), or None."""
        return getattr(self.engine, "rng_tracker", None)

    # ---- save --------------------------------------------------------------------------------------
    def due(self, step: int) -> bool:
        return (self.every > 0 and step % self.every == 0) or step == self.steps or step == self.kill_step

    def save(self, step: int, metrics: List[Dict[str, Any]], block: bool = False) -> None:
        """Checkpoint the state after ``step`` (every rank calls it at the same step).

        Synchronous (``block``, or async_save off, or an engine that names no optimizer): returns once
        written. Asynchronous: returns at once; a background thread copies the state to host memory
        and writes it, and the next optimizer step (the first thing to change that state) waits until
        the copy is done, so the copy overlaps the next forward and backward."""
        t0 = time.perf_counter()
        self.wait()
        partial = self.rd.checkpoint_partial(step)
        partial.mkdir(parents=True, exist_ok=True)
        self.engine.save_native(partial)  # collective, synchronous (DeepSpeed)
        live = self.engine.checkpoint_files()  # references to the live state (a loss scaler's values are copied)
        shared = self._universal_state() if self.universal else None
        # collective and synchronous: each rank writes its own slices (no gather)
        self._universal_files = universal.save(shared, partial / universal.DIR, self.rank) if shared else []
        small = {RNG_FILE.format(rank=self.rank): rng_state(self._tracker())}
        if self.rank == 0:
            small[META_FILE] = {"step": step, "world_size": self.world, "metrics": list(metrics),
                                "layout": self._layout(), "universal": bool(shared)}
        self._saves += 1
        if self.async_save and not block and self._hooked():
            started = self._start_copy(live)  # GPU tensors: enqueued now, behind this step's kernels
            self._copied.clear()
            if started.event is not None:
                self._event, self._event_device = started.event, started.device
            self._thread = threading.Thread(target=self._copy_and_write, args=(partial, live, small, step, started),
                                            name="checkpoint-writer", daemon=True)
            self._thread.start()
        else:
            self._write(partial, {**self._copy(live), **small}, step)
        self.ctx.heartbeat()
        self.blocked_s += time.perf_counter() - t0

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
        with cuda.stream(self._stream):
            staged = {name: host_copy(state, self._staged.get(name), deferred) for name, state in live.items()}
        event = cuda.Event()
        event.record(self._stream)
        return _Copy(staged, deferred, event, device)

    def _finish_copy(self, live: Dict[str, Any], started: _Copy) -> Dict[str, Any]:
        """The host part of a copy (all of it when nothing is on a GPU); the GPU part may still be in
        flight (``started.event``)."""
        if started.staged is None:
            staged = {name: host_copy(state, self._staged.get(name)) for name, state in live.items()}
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

    def _copy_and_write(self, partial: Path, live: Dict[str, Any], small: Dict[str, Any], step: int,
                        started: _Copy) -> None:
        try:
            if started.device is not None:  # CUDA's current device is per thread: a new one starts on 0
                cuda.set_device(started.device)
            staged = self._finish_copy(live, started)
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

    def wait(self) -> None:
        """Until the save in flight (if any) is written and the pruning it started is done; re-raises
        its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._pruner is not None:
            self._pruner.join()
            self._pruner = None
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError(f"writing a checkpoint failed on rank {self.rank}: {err}") from err

    def finish(self) -> None:
        """Every save of every rank written and committed (call on all ranks before the job ends)."""
        self.wait()
        if dist.is_initialized():
            dist.barrier()

    def _write_guarded(self, partial: Path, staged: Dict[str, Any], step: int) -> None:
        try:
            self._write(partial, staged, step)
        except BaseException as e:  # surfaced by the next wait()
            self._error = e

    def _write(self, partial: Path, staged: Dict[str, Any], step: int) -> None:
        written = {}
        for i, (name, state) in enumerate(staged.items()):
            _write_file(partial / name, state)
            if i == 0 and step == self.kill_at:  # fault drill: die with the checkpoint half written
                os.kill(os.getpid(), signal.SIGKILL)
            written[name] = checkpoint_manifest.digest(partial / name)  # in the writer thread when async
        for rel in self._universal_files:
            written[rel] = checkpoint_manifest.digest(partial / rel)
        checkpoint_manifest.mark_done(partial / DONE_FILE.format(rank=self.rank), written)
        self._commit(partial, step)

    def _done_store(self) -> Any:
        if self._store is None:
            if dist.is_initialized():
                self._store = dist.distributed_c10d._get_default_store()
            elif self.world == 1:
                self._store = dist.HashStore()
            else:  # the ranks could never count each other: no checkpoint would ever be committed
                raise RuntimeError(f"a checkpoint of {self.world} ranks needs their process group "
                                   "(torch.distributed) or a shared store (Checkpointer(..., store=))")
        return self._store

    def _commit(self, partial: Path, step: int) -> None:
        """The rank that completes the set renames it into place, then moves ``latest``, then prunes
        (in a thread). Which rank completes it: each adds 1 to this save's counter in the store (one
        atomic request per rank, no listing of the partial dir); the one that brings it to the world
        size is the last (a counter reused by a second Checkpointer of the same group goes on counting,
        hence the modulo)."""
        done = int(self._done_store().add(f"launcher.checkpoint/{step}/{self._saves}", 1))
        if done % self.world:
            return
        marks = [partial / DONE_FILE.format(rank=r) for r in range(self.world)]
        checkpoint_manifest.write(partial, step, marks)  # every file's size and sha256, before it is visible
        final = self.rd.checkpoint_dir(step)
        if final.exists():  # committed by an earlier attempt that died before moving `latest`
            shutil.rmtree(final)
        os.replace(partial, final)
        self.rd.set_latest(final)
        # the rmtree of old checkpoints (thousands of files at scale) runs beside the training steps
        self._pruner = threading.Thread(target=self._prune, args=(final,), name="checkpoint-pruner", daemon=True)
        self._pruner.start()

    def _prune(self, final: Path) -> None:
        """Delete the checkpoints older than the last ``keep`` (no CUDA call: nothing to bind)."""
        for old in self.rd.checkpoints()[:-self.keep]:
            if old != final:
                shutil.rmtree(old, ignore_errors=True)


class Objects:
    """The Engine over named stateful objects (anything with ``state_dict``/``load_state_dict``):
    ``shared`` ones, equal on every rank (a DDP model, its optimizer, a scheduler), written once by
    rank 0 and loaded by every rank; ``per_rank`` ones (a rank's data sampler), written by each rank."""

    def __init__(self, shared: Mapping[str, Any], per_rank: Mapping[str, Any], rank: int, device: Any) -> None:
        for name, obj in {**shared, **per_rank}.items():
            if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise TypeError(f"checkpoint object {name!r} ({type(obj).__name__}) has no state_dict/load_state_dict")
        self.shared, self.per_rank = dict(shared), dict(per_rank)
        self.rank, self.device = rank, device

    def optimizers(self) -> List[Any]:
        return [o for o in (*self.shared.values(), *self.per_rank.values()) if isinstance(o, torch.optim.Optimizer)]

    def save_native(self, path: Path) -> None:
        pass

    def checkpoint_files(self) -> Dict[str, Any]:
        files: Dict[str, Any] = {}
        if self.rank == 0 and self.shared:
            files[STATE_FILE] = {name: _live_state(obj) for name, obj in self.shared.items()}
        if self.per_rank:
            own = RANK_STATE_FILE.format(rank=self.rank)
            files[own] = {name: _live_state(obj) for name, obj in self.per_rank.items()}
        return files

    def load_checkpoint(self, path: Path) -> None:
        for file, objs in ((STATE_FILE, self.shared), (RANK_STATE_FILE.format(rank=self.rank), self.per_rank)):
            if objs:
                state = torch.load(path / file, map_location=self.device, weights_only=False)
                for name, obj in objs.items():
                    obj.load_state_dict(state[name])

    # ---- another layout (launcher.training.universal): the loop's one module and its one optimizer by
    # parameter name, as the engines write them; the other shared objects (a scheduler, a loss scaler:
    # the same on every rank) come from rank 0's file as they are. A rank's own objects (a sampler's
    # position) belong to a rank of the old layout: a loop with any cannot move to another one.
    def _module_and_optimizer(self) -> Optional[Tuple[Any, Any]]:
        mods = [o for o in self.shared.values() if isinstance(o, torch.nn.Module)]
        opts = [o for o in self.shared.values() if isinstance(o, torch.optim.Optimizer)]
        return (mods[0], opts[0]) if len(mods) == 1 and len(opts) == 1 and not self.per_rank else None

    def universal_ok(self) -> bool:
        return self._module_and_optimizer() is not None

    def universal_state(self) -> Optional[Dict[str, Any]]:
        pair = self._module_and_optimizer()
        return universal.module_state(*pair) if pair is not None else None

    def load_universal(self, path: Path) -> None:
        """The module and the optimizer's moments by name; the optimizer's hyperparameters (a loop's
        scheduler changes its learning rate) and the other shared objects from rank 0's file."""
        model, optimizer = self._module_and_optimizer() or (None, None)
        universal.load_module_state(model, optimizer, path)
        state = torch.load(path.parent / STATE_FILE, map_location=self.device, weights_only=False)
        for name, obj in self.shared.items():
            if obj is optimizer:
                for group, saved in zip(obj.param_groups, state[name]["param_groups"]):
                    group.update({k: v for k, v in saved.items() if k != "params"})
            elif obj is not model:
                obj.load_state_dict(state[name])


def _live_state(obj: Any) -> Any:
    """The state an asynchronous save may copy later: an optimizer's and a module's parameters change
    only in the (hooked) optimizer step, so they are referenced; a module's buffers change in its
    forward (BatchNorm statistics) and other objects' states anywhere, so those are copied now."""
    state = obj.state_dict()
    if isinstance(obj, torch.optim.Optimizer):
        return state
    if isinstance(obj, torch.nn.Module):
        buffers = {name for name, _ in obj.named_buffers()}
        return {k: v.detach().clone() if k in buffers else v for k, v in state.items()}
    return copy.deepcopy(state)


class Checkpoint(Checkpointer):
    """The Checkpointer of any training loop: ``Checkpoint(cfg, ctx, {"model": model, "optimizer": opt})``
    saves those objects' state dicts, every rank's RNG states and the step; ``per_rank`` objects are
    saved by each rank. For async_save the saved objects must change only in an optimizer's step (or
    in a module's buffers); otherwise pass ``async_save=False``."""

    def __init__(self, cfg: Any, ctx: Any, state: Mapping[str, Any], *, per_rank: Optional[Mapping[str, Any]] = None,
                 every: Optional[int] = None, keep: Optional[int] = None, async_save: Optional[bool] = None,
                 store: Any = None) -> None:
        objects = Objects(state, per_rank or {}, int(ctx.rank), ctx.device)
        super().__init__(cfg, ctx, objects, every=every, keep=keep, async_save=async_save, store=store)
