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
to host memory while the next forward and backward run, and a thread writes it (AsyncSaver:
launcher.training.async_save). Resume, and resharding on another layout: CheckpointResume
(launcher.training.checkpoint_resume); the files and RNG states: launcher.training.checkpoint_files.
"""
from __future__ import annotations

import copy
import json
import os
import shutil
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional, Protocol, Tuple

import torch
import torch.distributed as dist

from launcher.config.faults import faults
from launcher.run import checkpoint_manifest
from launcher.training import universal, universal_links
from launcher.training.async_save import AsyncSaver, gpu_of, host_copy
from launcher.training.checkpoint_files import (
    DONE_FILE,
    META_FILE,
    RANK_STATE_FILE,
    RNG_FILE,
    STATE_FILE,
    reseed,
    rng_state,
    set_rng_state,
)
from launcher.training.checkpoint_resume import CheckpointResume

if TYPE_CHECKING:
    from launcher.config.schema import RunConfig

# (the names importers use from here, whose homes are the modules above)
__all__ = ["Checkpoint", "CheckpointResume", "Checkpointer", "DONE_FILE", "Engine", "META_FILE", "Objects",
           "RANK_STATE_FILE", "RNG_FILE", "STATE_FILE", "gpu_of", "host_copy", "load_on_one_rank", "reseed",
           "rng_state", "set_rng_state"]


class Engine(Protocol):
    """What the Checkpointer needs of the thing it saves (a recipe's engine; Objects)."""

    def save_native(self, path: Path) -> Optional[List[Path]]:
        """Write a collective, synchronous save of its own into ``path`` (or nothing); the files this
        rank wrote (None: none, or not known: the committing rank hashes them)."""

    def checkpoint_files(self) -> Dict[str, Any]:
        """File name -> the live state this rank writes (copied to host memory before it changes)."""

    def load_checkpoint(self, path: Path) -> None:
        """Restore this rank's state from the checkpoint directory ``path``."""

    def optimizers(self) -> List[Any]:
        """The optimizers whose step is the only change to the saved state (none: saves are synchronous)."""

    # optional, for resuming on another layout (launcher.training.universal): ``universal_state()`` (its
    # state by parameter name, as torch.distributed.checkpoint saves it) and ``load_universal(path)``



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


def load_on_one_rank(path: Path, device: Any, src: int = 0, group: Any = None) -> Any:
    """``torch.load(path)`` (weights only, onto ``device``) of a file every rank of ``group`` needs whole
    (ddp's replicated model and optimizer; a megatron stage's shard, which its data-parallel replicas
    share): read by rank ``src`` (a global rank, in ``group``) alone, then its tensors broadcast to the
    group (default: every rank), bit for bit. One read of the file per group instead of one per rank
    (a 1.3B model: 15.6 GB); every rank of the group calls it. Without a process group: a plain load."""
    device = torch.device(device)
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return torch.load(path, map_location=device, weights_only=True)
    tensors: List[torch.Tensor] = []
    box: List[Any] = [None]
    if dist.get_rank() == src:
        tree = _slots(torch.load(path, map_location=device, weights_only=True), tensors, {})
        box = [(tree, [(tuple(t.shape), t.dtype) for t in tensors])]
    dist.broadcast_object_list(box, src=src, group=group)  # the structure and the plain values (small)
    tree, specs = box[0]
    if dist.get_rank() != src:
        tensors = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in specs]
    for t in tensors:  # (bool as bytes: not every backend reduces or sends bool)
        dist.broadcast(t.view(torch.uint8) if t.dtype == torch.bool else t, src=src, group=group)
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


# the key of the universal form's state among an async save's host copies (no file of that name)
UNIVERSAL_STAGED = "\0universal"


class Checkpointer(CheckpointResume, AsyncSaver):
    """Save, resume and prune the checkpoints of one rank of a run (see the module doc): the save, its
    commit and the pruning here; the resume (CheckpointResume) and the asynchronous save's copy and
    writer thread (AsyncSaver) inherited."""

    def __init__(self, cfg: RunConfig, ctx: Any, engine: Engine, *, every: Optional[int] = None,
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
        self._own_files: List[str] = []  # the universal and native files this rank wrote in the save in flight
        self.resharded: Optional[Dict[str, Any]] = None  # the reshard record, when resume loaded another layout's
        self.steps = int(cfg.train.steps)
        self.ctx, self.rd, self.engine = ctx, ctx.rundir, engine
        self.rank, self.world = int(ctx.rank), int(ctx.world_size)
        self._init_async_save()  # the copy thread, its host buffers, side stream and event (AsyncSaver)
        self._store = store
        self._group: Any = None  # the writer thread's process group (_saves_group)
        self._link_cache: Optional[Tuple[Any, Dict[str, Any]]] = None  # (native tensors' identity, links)
        self._pending_links: Optional[Tuple[Dict[str, Any], Dict[str, Any]]] = None  # (state, files): _before_copy's
        self._saves = 0  # saves so far: with the step, the store key the ranks count one save under
        self._pruner: Optional[threading.Thread] = None
        self._latest_meta: Optional[Dict[str, Any]] = None  # meta.json of the checkpoint resumed, as rank 0 read it
        self.blocked_s = 0.0  # time the training loop spent waiting for saves (benchmarks read it)
        self._save_t0 = 0.0  # when the save being written started
        drills = [f for f in faults(cfg.train) if f.mode == "kill_in_save"]
        # every rank saves at a drill's step; the drilled rank (on the drilled attempt) dies in it
        self.kill_steps = frozenset(f.at_step for f in drills)
        self.kill_at = frozenset(f.at_step for f in drills if f.rank == self.rank and f.on(ctx.attempt))

    # ---- save --------------------------------------------------------------------------------------
    def due(self, step: int) -> bool:
        return (self.every > 0 and step % self.every == 0) or step == self.steps or step in self.kill_steps

    def save(self, step: int, metrics: List[Dict[str, Any]], block: bool = False) -> None:
        """Checkpoint the state after ``step`` (every rank calls it at the same step).

        Synchronous (``block``, or async_save off, or an engine that names no optimizer): returns once
        written. Asynchronous: returns at once; a background thread copies the state to host memory
        and writes it, and the next optimizer step (the first thing to change that state) waits until
        the copy is done, so the copy overlaps the next forward and backward."""
        t0 = time.perf_counter()
        self.wait()
        self._pending_links = None
        self._save_t0 = time.perf_counter()  # to its commit: what the time limit's margin must hold
        partial = self.rd.checkpoint_partial(step)
        partial.mkdir(parents=True, exist_ok=True)
        native = self.engine.save_native(partial)  # collective, synchronous (DeepSpeed): this rank's files
        live = self.engine.checkpoint_files()  # references to the live state (a loss scaler's values are copied)
        background = self.async_save and not block and self._hooked()
        # where the native files hold every tensor of it whole (DDP's): named (links), not written twice
        shared, links = self._universal_or_links(live, defer=background) if self.universal else (None, None)
        # each rank writes its own slices (no gather): here, collectively, when the save blocks; else
        # from the host copy in the writer thread, over a process group of the saves' own
        universal_files = universal.save(shared, partial / universal.DIR, self.rank) if shared and not background \
            else []
        # hashed by the rank that wrote them (in the writer thread when async), not all by the committing one
        self._own_files = [*universal_files, *_under(native, partial)]
        small = {RNG_FILE.format(rank=self.rank): rng_state(self._tracker())}
        if links:  # (written with the small files: in the writer thread when async)
            small[universal_links.file_name(self.rank)] = links
        if self.rank == 0:
            small[META_FILE] = {"step": step, "world_size": self.world, "metrics": list(metrics),
                                "layout": self._layout(),
                                "universal": "linked" if links is not None else bool(shared)}
        self._saves += 1
        if background:
            if shared:
                live = {**live, UNIVERSAL_STAGED: shared}
                self._saves_group()  # (made here: every rank's main thread, at the same save)
            try:
                self._write_in_background(partial, live, small, step)
                self.ctx.heartbeat()
            finally:
                self._returned.set()  # the writer thread starts its Python work once this thread has left
        else:
            self._write(partial, {**self._copy(live), **small}, step, feed=True)
            self.ctx.heartbeat()
        self.blocked_s += time.perf_counter() - t0

    def _universal_or_links(self, live: Dict[str, Any], defer: bool = False
                            ) -> Tuple[Optional[Dict[str, Any]], Optional[Dict[str, Any]]]:
        """(the universal state to write, or None; this rank's links where the ranks agreed to name it in
        the native files, or None). The last save's links again, without building the universal state,
        where every rank's native files hold the very tensors they held then (and no value is kept by
        value: the loss scaler's changes) — one all-reduce of a flag on the saves' group. ``defer`` (an
        async save): a state of plain tensors (DDP's) is linked or not by the writer thread (_before_copy:
        the agreement, ~3 ms for a 124M-parameter model, off the training thread)."""
        cached = self._link_cache
        files = self._native_files(live)
        reuse = cached is not None and not universal_links.has_values(cached[1]) \
            and cached[0] == universal_links.identity(files)
        group = self._saves_group()
        if group is not None:
            flag = torch.tensor([int(reuse)])
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
            reuse = bool(flag.item())
        if reuse:
            return None, cached[1]
        # an engine whose tensors are sharded over ranks (tensor parallel) names each rank's pieces: no
        # gather, unless the ranks cannot link them (then its whole tensors are written)
        pieces = getattr(self.engine, "universal_pieces", None)
        shared = pieces() if pieces is not None else self._universal_state()
        if defer and pieces is None and shared and universal_links.plain(shared):
            self._pending_links = (shared, files)
            return shared, None
        links = self._agree(shared, files) if shared or pieces is not None else None
        if links is None and pieces is not None:
            shared = self._universal_state()
        return (None if links is not None else shared), links

    def _agree(self, shared: Any, files: Dict[str, Any], group: Any = None) -> Optional[Dict[str, Any]]:
        """universal_links.agree, its links kept for the next save to reuse (by the files' identity)."""
        links = universal_links.agree(shared, files, group=group)
        self._link_cache = (universal_links.identity(files), links) if links is not None else None
        return links

    def _before_copy(self, live: Dict[str, Any], small: Dict[str, Any]) -> Tuple[Dict[str, Any], Dict[str, Any]]:
        """In the writer thread, a first async save's agreement (_universal_or_links): linked, the universal
        state is not copied and the links go with the small files (meta.json: "linked")."""
        pending, self._pending_links = self._pending_links, None
        if pending is None:
            return live, small
        links = self._agree(*pending, group=self._saves_group())
        if links is None:
            return live, small  # universal/ written from the copy, as before
        small = {**small, universal_links.file_name(self.rank): links}
        if META_FILE in small:
            small[META_FILE] = {**small[META_FILE], "universal": "linked"}
        return {k: v for k, v in live.items() if k != UNIVERSAL_STAGED}, small

    def _native_files(self, live: Dict[str, Any]) -> Dict[str, Any]:
        """Every file of this rank's save by name: the Checkpointer's, and those an engine's own save
        wrote (``native_saved``: DeepSpeed's, whose partitions the universal form's links name)."""
        return {**live, **(getattr(self.engine, "native_saved", None) or {})}

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

    def _write(self, partial: Path, staged: Dict[str, Any], step: int, feed: bool = False) -> None:
        """Write and hash this rank's files, then its done mark and the commit. ``feed``: on the training
        thread (a blocking save), each file written or hashed is progress for the hang watch; a writer
        thread never feeds it (a hung training thread must still be seen)."""
        written = {}
        shared = staged.pop(UNIVERSAL_STAGED, None)  # (the writer thread's: the universal form's host copy)
        if shared is not None:
            self._own_files += universal.save(shared, partial / universal.DIR, self.rank, group=self._saves_group())
        for i, (name, state) in enumerate(staged.items()):
            _write_file(partial / name, state)
            if i == 0 and step in self.kill_at:  # fault drill: die with the checkpoint half written
                os.kill(os.getpid(), signal.SIGKILL)
            written[name] = checkpoint_manifest.digest(partial / name)  # in the writer thread when async
            if feed:
                self.ctx.heartbeat()
        for rel in self._own_files:
            written[rel] = checkpoint_manifest.digest(partial / rel)
            if feed:
                self.ctx.heartbeat()
        checkpoint_manifest.mark_done(partial / DONE_FILE.format(rank=self.rank), written)
        self._commit(partial, step)
        getattr(self.ctx, "save_took", lambda _s: None)(time.perf_counter() - self._save_t0)

    def _saves_group(self) -> Any:
        """The process group a writer thread's collectives run on (the universal form's planning): a
        gloo group of the checkpoint's own, so that they never interleave with the training thread's
        collectives on the default group. Made once, by every rank's main thread at the same save."""
        if self._group is None and dist.is_initialized() and self.world > 1:
            self._group = dist.new_group(backend="gloo")
        return self._group

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

    def save_native(self, path: Path) -> Optional[List[Path]]:
        return None

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

    def load_universal(self, path: Path, checkpoint: Optional[Path] = None) -> None:
        """The module and the optimizer's moments by name; the optimizer's hyperparameters (a loop's
        scheduler changes its learning rate) and the other shared objects from rank 0's file (in
        ``checkpoint``: the universal form may have been written elsewhere from its links)."""
        model, optimizer = self._module_and_optimizer() or (None, None)
        universal.load_module_state(model, optimizer, path)
        state = torch.load((checkpoint or path.parent) / STATE_FILE, map_location=self.device, weights_only=False)
        for name, obj in self.shared.items():
            if obj is optimizer:
                for group, saved in zip(obj.param_groups, state[name]["param_groups"]):
                    group.update({k: v for k, v in saved.items() if k != "params"})
            elif obj is not model:
                obj.load_state_dict(state[name])


def _under(paths: Optional[List[Path]], root: Path) -> List[str]:
    """``paths`` inside ``root``, relative to it (an engine's files elsewhere are not the checkpoint's)."""
    out, root = [], root.resolve()
    for p in paths or ():
        try:
            out.append(str(Path(p).resolve().relative_to(root)))
        except ValueError:
            pass
    return out


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

    def __init__(self, cfg: RunConfig, ctx: Any, state: Mapping[str, Any], *,
                 per_rank: Optional[Mapping[str, Any]] = None, every: Optional[int] = None,
                 keep: Optional[int] = None, async_save: Optional[bool] = None, store: Any = None) -> None:
        objects = Objects(state, per_rank or {}, int(ctx.rank), ctx.device)
        super().__init__(cfg, ctx, objects, every=every, keep=keep, async_save=async_save, store=store)
