"""The universal form of a checkpoint whose engine's own files already hold each of its tensors whole
(DDP's replicated model and optimizer, one process's, a loop's ``Checkpoint`` of a module and its
optimizer): named, not written twice.

At a save the ranks agree (one small gather) that every tensor of the universal state (launcher.training
.universal) is a plain tensor that some rank's native file holds: the same tensor (storage, offset,
shape, stride, dtype), or, for a small one, a copy equal bit for bit (a module's buffers, which a save
copies at once); each rank that writes such a file then writes ``universal.links.<rank>.json`` (each
universal name -> the file and the keys down to the tensor; a scalar no file holds, the fp16 loss
scaler's, by value) instead of ``universal/``. The save writes each byte once:
``train.checkpoint.universal=true`` costs what ``false`` does. The resume that needs the universal
form (another layout) has rank 0 write it from those files into a scratch dir of the run's before any
rank loads it, and delete it once the load is checked (the checkpoint stays as its manifest lists it).
A tensor no rank holds whole is named by its pieces: an engine that offers ``universal_pieces()`` gives
each rank's own part as a ``universal.Piece`` (its tensor and its place in the full one: the megatron
engine's tensor-parallel shards, rows and columns as runs of indices; DeepSpeed ZeRO-1/2/3's fragments
of its flat fp32 partitions, a range of the flattened tensor, found in its optimizer file by storage); each
piece is linked to the file that holds it, and the resume's rank 0 assembles the full tensor from them
(checking that they cover it). No rank gathers anything at a save. An engine whose universal state
holds DTensors is linked alike where its files hold their local tensors (FSDP2's shards: each rank's
rows of each parameter and moment).
"""
from __future__ import annotations

import hashlib
import json
import shutil
import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from launcher.config.layout import UNIVERSAL_DIR, UNIVERSAL_LINKS, universal_links_of
from launcher.training import universal
from launcher.training.async_save import is_dtensor, tensor_identity

INLINE_NUMEL = 1  # a tensor no native file holds is kept in the links by value up to this size (a scaler's)
EQUAL_NUMEL = 1 << 16  # up to this size a copy equal bit for bit stands for the tensor (a buffer copied at the save)


def _held_tensors(files: Dict[str, Any]) -> List[Tuple[torch.Tensor, List[Any]]]:
    """(tensor, [file, keys...]) for each plain tensor of the files, depth first in their order; a
    tensor under a key JSON does not keep is left out. (One flat walk: on the first save's path.)"""
    out: List[Tuple[torch.Tensor, List[Any]]] = []
    stack: List[Tuple[List[Any], Any]] = [([name], tree) for name, tree in reversed(list(files.items()))]
    while stack:
        at, o = stack.pop()
        if isinstance(o, torch.Tensor):
            if not is_dtensor(o):
                out.append((o, at))
        elif isinstance(o, dict):
            stack.extend(([*at, k], v) for k, v in reversed(list(o.items())) if _keeps(k))
        elif isinstance(o, (list, tuple)):
            stack.extend(([*at, i], o[i]) for i in range(len(o) - 1, -1, -1))
    return out


def _keeps(k: Any) -> bool:
    return isinstance(k, (str, int)) and not isinstance(k, bool)


def links(state: Optional[Dict[str, Any]], files: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """This rank's part (pure over its arguments): each name of the universal ``state`` -> [file, keys...]
    of the native ``files`` (name -> state this rank writes) holding the same tensor, or {"value":
    [...], "dtype", "shape"} for a tiny one none holds, or {"piece": [file, keys...], "shape", "rows",
    "cols"} (or "flat": a fragment of a flat tensor, ``_flat_link``) for this rank's part of a full tensor
    (a universal.Piece, a DTensor's local shard). None: a DTensor placed otherwise, or a larger tensor no
    file holds (the universal form is then written)."""
    if state is None:
        return None
    named = universal.tensors_by_name(state)
    held = _held_tensors(files)  # every plain tensor of the files, with its keys
    where: Dict[Any, List[Any]] = {}
    for leaf, at in held:
        where.setdefault(tensor_identity(leaf), at)
    # (the indexes below only where some name needs them: on a save's path, ~2 ms for a 124M-parameter model's files)
    flats: Dict[Any, List[Tuple[torch.Tensor, List[Any]]]] = {}  # 1-D ones by storage (a ZeRO partition)
    if any(isinstance(t, universal.Piece) and t.flat is not None for t in named.values()):
        for leaf, at in held:
            if leaf.dim() == 1 and leaf.is_contiguous():
                flats.setdefault((leaf.device, leaf.untyped_storage().data_ptr(), leaf.dtype), []).append((leaf, at))
    alike: Optional[Dict[Any, List[Tuple[torch.Tensor, List[Any]]]]] = None  # small ones by shape, dtype, device
    out: Dict[str, Any] = {}
    for key, t in named.items():
        if is_dtensor(t):  # its local shard, placed
            t = dtensor_piece(t)
            if t is None:
                return None
        if isinstance(t, universal.Piece) and t.flat is not None:
            out[key] = _flat_link(t, flats)
            continue
        if isinstance(t, universal.Piece):
            at = where.get(tensor_identity(t.local))
            out[key] = None if at is None else {
                "piece": at, "shape": list(t.shape), "rows": _runs(t.rows, t.shape[0]),
                "cols": _runs(t.cols, t.shape[1] if len(t.shape) > 1 else 0)}
            continue
        at = where.get(tensor_identity(t))
        if at is None and t.numel() <= EQUAL_NUMEL:
            if alike is None:
                alike = {}
                for leaf, held_at in held:
                    if leaf.numel() <= EQUAL_NUMEL:
                        alike.setdefault((tuple(leaf.shape), leaf.dtype, leaf.device), []).append((leaf, held_at))
            at = next((a for c, a in alike.get((tuple(t.shape), t.dtype, t.device), ()) if _bits_equal(c, t)), None)
        if at is not None:
            out[key] = at
        elif t.numel() <= INLINE_NUMEL:
            out[key] = {"value": t.detach().cpu().reshape(-1).tolist(), "dtype": str(t.dtype).split(".")[-1],
                        "shape": list(t.shape)}
        else:
            out[key] = None
    return out


def dtensor_piece(t: Any) -> Any:
    """A DTensor as this rank's piece of it (an FSDP2 shard: its rows), its local tensor where it is
    whole here (replicated); None where its placement is no box of rows and columns (a partial sum, a
    shard of a third dim)."""
    try:
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    except ImportError:
        return None
    if not all(isinstance(p, (Replicate, Shard)) for p in t.placements):
        return None
    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    full = tuple(t.shape)
    cut = [d for d in range(len(full)) if shape[d] != full[d]]
    if any(d > 1 for d in cut):
        return None
    if not cut:
        return t._local_tensor
    rows, cols = (slice(offset[d], offset[d] + shape[d]) if d in cut else None for d in (0, 1))
    return universal.Piece(t._local_tensor, full, rows, cols)


def _runs(index: Any, n: int) -> Optional[List[List[int]]]:
    """A piece's place along one dim as [start, stop) runs (None: the whole dim): a slice is one run,
    an index tensor (the fused qkv rows of a rank's heads) as few as it has contiguous stretches."""
    if index is None:
        return None
    if isinstance(index, slice):
        start, stop, step = index.indices(n)
        if step != 1:
            raise ValueError("a piece's slice must have step 1")
        return [[start, stop]]
    runs: List[List[int]] = []
    for i in torch.as_tensor(index).reshape(-1).tolist():
        if runs and runs[-1][1] == i:
            runs[-1][1] += 1
        else:
            runs.append([i, i + 1])
    return runs


def _index(runs: Optional[List[List[int]]]) -> Any:
    if runs is None:
        return slice(None)
    if len(runs) == 1:
        return slice(*runs[0])
    return torch.cat([torch.arange(a, b) for a, b in runs])


def _by_value(v: Any) -> bool:
    return isinstance(v, dict) and "value" in v


def _held(v: Any) -> bool:
    """Whether a link names a file (a whole tensor's or a piece's)."""
    return isinstance(v, list) or (isinstance(v, dict) and "piece" in v)


def _flat_link(piece: Any, flats: Dict[Any, List[Tuple[torch.Tensor, List[Any]]]]) -> Optional[Dict[str, Any]]:
    """A fragment of a flat tensor a file holds (a view into it: the same storage) as {"piece": [file,
    keys...], "shape", "flat": [its first element in the file's tensor, numel, its first element in the
    flattened full tensor]}; None where no file's flat tensor holds it."""
    t = piece.local
    if not t.is_contiguous():
        return None
    for base, at in flats.get((t.device, t.untyped_storage().data_ptr(), t.dtype), ()):
        start = t.storage_offset() - base.storage_offset()
        if 0 <= start and start + t.numel() <= base.numel():
            return {"piece": at, "shape": list(piece.shape), "flat": [start, t.numel(), int(piece.flat)]}
    return None


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    flat = [x.detach().contiguous().reshape(-1).view(torch.uint8) for x in (a, b)]
    return torch.equal(*flat)


def _digest(names: Any) -> str:
    return hashlib.sha256("\n".join(sorted(names)).encode()).hexdigest()


def plain(state: Dict[str, Any]) -> bool:
    """Whether every tensor of a universal state is a plain (local, whole) tensor: no DTensor, no piece."""
    return all(torch.is_tensor(t) and not is_dtensor(t) for t in universal.tensors_by_name(state).values())


def agree(state: Optional[Dict[str, Any]], files: Dict[str, Any], group: Any = None) -> Optional[Dict[str, Any]]:
    """Every rank at the same save (collective where there is a process group): this rank's links to
    write (possibly {}: it writes no file the others need) when the universal form is to be linked, or
    None when it is to be written. Linked when every rank's state is plain tensors or pieces and each
    rank either names all of its own (its files hold them, or it keeps them by value: a stage's, a
    shard's, a rank with nothing but the scaler) or has the very names some one rank's files hold (a
    data-parallel replica's, by rank 0's). ``group``: the process group to agree over (default: the
    world's; a writer thread's: the saves' own)."""
    mine = links(state, files)  # None: no state, or a DTensor in it
    offers = {k for k, v in (mine or {}).items() if _held(v)}
    own = mine is not None and all(v is not None for v in mine.values())
    given = {k for k, v in (mine or {}).items() if v is not None} if offers else set()
    vote = (mine is not None, own, _digest(mine or {}), _digest(given) if given else None)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        votes: List[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(votes, vote, group=group)
    else:
        votes = [vote]
    offered = {v[3] for v in votes if v[3] is not None}
    if not all(v[0] and (v[1] or v[2] in offered) for v in votes):
        return None
    # (every rank decided alike from the same votes; a name this rank's files miss is another rank's)
    return {k: v for k, v in mine.items() if v is not None} if offers else {}


def file_name(rank: int) -> str:
    """The name of ``rank``'s links in a checkpoint."""
    return UNIVERSAL_LINKS.format(rank=f"{rank:05d}")


def identity(files: Dict[str, Any]) -> Tuple[Any, ...]:
    """What the native files' tensors are (address, shape, dtype; in a fixed order): equal at two saves,
    the same tensors, and the links of the first still name them. (On the training path at every save:
    one flat walk, no more.)"""
    out: List[Any] = []
    stack: List[Any] = [files]
    while stack:
        o = stack.pop()
        if isinstance(o, torch.Tensor):
            t = o._local_tensor if is_dtensor(o) else o
            out.append((t.data_ptr(), t.shape, t.dtype))
        elif isinstance(o, dict):
            stack.extend(o.values())
        elif isinstance(o, (list, tuple)):
            stack.extend(o)
    return tuple(out)


def has_values(spec: Optional[Dict[str, Any]]) -> bool:
    """Whether links keep a tensor by value (a loss scaler's: it changes from save to save)."""
    return any(_by_value(v) for v in (spec or {}).values())


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} is no torch dtype")
    return dtype


def _state_of(ckpt: Path) -> Dict[str, torch.Tensor]:
    """The universal state the links name, read from the native files (memory-mapped: no file is
    read whole into memory; a tensor linked by pieces is assembled here, in memory)."""
    specs: Dict[str, Any] = {}
    pieces: Dict[str, List[Dict[str, Any]]] = {}
    for p in universal_links_of(ckpt):
        for key, at in json.loads(p.read_text()).items():
            if isinstance(at, dict) and "piece" in at:  # (a place two ranks name, tied copies: the first)
                same = pieces.setdefault(key, [])
                if all(_place(at) != _place(o) for o in same):
                    same.append(at)
            else:
                specs.setdefault(key, at)  # (a whole tensor several ranks name: the first)
    opened: Dict[str, Any] = {}

    def read(at: List[Any]) -> torch.Tensor:
        file, *path = at
        if file not in opened:
            opened[file] = torch.load(ckpt / file, map_location="cpu", weights_only=False, mmap=True)
        obj = opened[file]
        for k in path:
            obj = obj[k]
        return obj

    state: Dict[str, torch.Tensor] = {}
    for key, at in specs.items():
        if isinstance(at, dict):
            state[key] = torch.tensor(at["value"], dtype=_dtype(at["dtype"])).reshape(at["shape"])
        else:
            state[key] = read(at)
    for key, parts in pieces.items():
        state[key] = _assemble(key, [(read(at["piece"]), at) for at in parts])
    return state


def _place(at: Dict[str, Any]) -> Any:
    """Where a piece lies in its full tensor (two ranks naming the same place hold the same values)."""
    return ("flat", *at["flat"][1:]) if "flat" in at else (at["rows"], at["cols"])


def _assemble(key: str, parts: List[Tuple[torch.Tensor, Dict[str, Any]]]) -> torch.Tensor:
    """The full tensor ``key`` from its pieces; raises where they do not cover it exactly."""
    shape = parts[0][1]["shape"]
    full = torch.empty(shape, dtype=parts[0][0].dtype)
    covered = 0
    for local, at in parts:
        if "flat" in at:  # a fragment of a flat partition: its elements of the flattened tensor
            start, numel, to = at["flat"]
            full.view(-1)[to:to + numel] = local.reshape(-1)[start:start + numel]
            covered += numel
            continue
        rows, cols = _index(at["rows"]), _index(at["cols"])
        full[(rows, cols) if at["cols"] is not None else rows] = local
        covered += local.numel()
    if covered != full.numel():
        raise RuntimeError(f"the checkpoint's pieces of {key} cover {covered} of its {full.numel()} elements: "
                           "a rank's links file is missing")
    return full


def materialize(ckpt: Path, into: Path) -> None:
    """Write the universal form the links of ``ckpt`` name into ``into`` (one process, no collective)."""
    import torch.distributed.checkpoint as dcp

    shutil.rmtree(into, ignore_errors=True)
    writer = dcp.FileSystemWriter(str(into), single_file_per_rank=True, thread_count=1)
    with warnings.catch_warnings():  # (one process writes: DCP warns that it assumes one)
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(_state_of(ckpt), storage_writer=writer, no_dist=True)


def source(ckpt: Path, rank: int, scratch: Path) -> Path:
    """Where the universal form of ``ckpt`` is read from: its ``universal/``, or, where the save linked
    it, ``scratch`` (a dir of the run's own), which rank 0 writes now from the linked files; every rank
    calls it (the others wait at a barrier)."""
    written = ckpt / UNIVERSAL_DIR
    if universal.present(ckpt) or not universal_links_of(ckpt):
        return written
    if rank == 0:
        materialize(ckpt, scratch)
        print(f"launcher: wrote the layout-independent state of {ckpt.name} from its own files (linked at "
              f"the save) into {scratch}", flush=True)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
    return scratch


def release(path: Path, ckpt: Path, rank: int) -> None:
    """After every rank loaded and checked the state (``source``'s scratch copy): rank 0 deletes it."""
    if rank == 0 and path != ckpt / UNIVERSAL_DIR:
        shutil.rmtree(path, ignore_errors=True)
