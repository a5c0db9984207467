"""Layout-independent checkpoints: what lets a run resume on another layout (docs/fault-tolerance.md,
"Resuming on another layout").

Beside its engine's own files, a checkpoint of an engine that offers ``universal_state()`` holds
``universal/``, written by torch.distributed.checkpoint (DCP): every tensor of the model and of the
optimizer under its parameter's name (``model.<fqn>``, ``optim.<fqn>.exp_avg``...), each rank writing
only the slices it holds (a DTensor's shard; a tensor several ranks hold whole, as DDP's replicas do, is
written once, DCP spreading such tensors over the ranks), and rank 0 the global index of every slice
(``.metadata``). No rank gathers the model, so the save scales with the world as the engine's own does.
DeepSpeed ZeRO-1/2/3 (flat partitions) joins through ``deepspeed_state``: each tensor assembled whole once
per save, one at a time, and each rank keeping its Shard(0) slice of it.

A job whose layout differs from the one the checkpoint was saved on (its meta.json records it) loads
this instead of the engine's files: each rank asks for its own slices under its own placement and DCP
reads just those (no offline conversion). Then ``verify`` gathers every tensor once, after the load,
and rank 0 compares it bit for bit with what was saved (reading the checkpoint a tensor batch at a
time): the equivalence record of the reshard.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from launcher.config.layout import RESHARD_DEEPSPEED_STAGES, UNIVERSAL_DIR, UNIVERSAL_INDEX, moved
from launcher.training.plain_state import plain_state

__all__ = ["DIR", "INDEX", "Piece", "SCALER", "deepspeed_pieces", "deepspeed_state", "load_deepspeed_state",
           "load_module_state", "module_state", "moved", "present", "save", "scaler_state", "scaler_target",
           "set_scaler", "tensors_by_name", "verify", "with_scaler"]

DIR, INDEX = UNIVERSAL_DIR, UNIVERSAL_INDEX  # DCP's files, and its global index (rank 0)
# per rank, one file (single_file_per_rank, one writer thread): FileSystemWriter's name for it
RANK_FILE = "__{rank}_0.distcp"
VERIFY_BATCH_BYTES = 1 << 30  # what rank 0 reads of the saved checkpoint at a time while verifying


def module_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scaler: Any = None) -> Dict[str, Any]:
    """A module and its optimizer as DCP saves them, by parameter name: plain tensors (a whole module,
    DDP's replicas) or DTensors (FSDP2's shards, tensor-parallel slices); with fp16, the loss scaler
    (``scaler_state``). A fresh optimizer gets its state created (zeros), so the same call gives the
    target a load fills."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    plain = plain_state(model, optimizer)
    msd, osd = plain if plain is not None else get_state_dict(model, optimizer)
    return {"model": msd, "optim": osd["state"], **with_scaler(scaler)}


def load_module_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: Path,
                      scaler: Any = None) -> None:
    """Fill ``model`` and ``optimizer`` (and an fp16 ``scaler``) from the universal checkpoint at
    ``path``, each rank reading its own slices; the optimizer keeps its own param groups (learning rate
    and the rest come from the run's config and schedule)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_state_dict

    target = module_state(model, optimizer, scaler)
    loading_scaler = scaler_target(target, path)
    dcp.load(target, checkpoint_id=str(path), no_dist=not dist.is_initialized())
    groups = get_optimizer_state_dict(model, optimizer)["param_groups"]
    set_state_dict(model, optimizer, model_state_dict=target["model"],
                   optim_state_dict={"state": target["optim"], "param_groups": groups})
    if loading_scaler:
        set_scaler(scaler, target[SCALER])


# ---- the fp16 loss scaler: the same numbers on every engine (torch's GradScaler, DeepSpeed's, a recipe's
# own with ``universal_values``), so that a scale grown on one layout goes on from there on another: the
# scale, the good steps since it last changed, and (a scaler with hysteresis, not torch's GradScaler,
# which halves at every overflow) the overflows left before the next halving. A scaler without that
# count loads none; one with it, loaded from one without, starts its count afresh ----------------------
SCALER = "scaler"


def scaler_block(scale: float, good_steps: int, overflows_left: Optional[int] = None) -> Dict[str, torch.Tensor]:
    block = {"scale": torch.tensor([float(scale)], dtype=torch.float64),
             "good_steps": torch.tensor([int(good_steps)], dtype=torch.int64)}
    if overflows_left is not None:
        block["overflows_left"] = torch.tensor([int(overflows_left)], dtype=torch.int64)
    return block


def scaler_state(scaler: Any) -> Optional[Dict[str, torch.Tensor]]:
    """``scaler``'s state as ``scaler_block`` names it (None: no scaler, or a disabled one). An object of
    a recipe's own gives ``universal_values()`` -> (scale, good steps, overflows left)."""
    if scaler is None:
        return None
    if hasattr(scaler, "universal_values"):
        return scaler_block(*scaler.universal_values())
    if isinstance(scaler, torch.amp.GradScaler):  # torch's (FSDP's ShardedGradScaler too): no hysteresis
        st = scaler.state_dict()
        return scaler_block(st["scale"], st["_growth_tracker"]) if st else None
    if hasattr(scaler, "cur_scale"):  # DeepSpeed's: good steps counted from the last overflow
        window = max(1, int(getattr(scaler, "scale_window", 1) or 1))
        good = ((int(scaler.cur_iter) - int(scaler.last_overflow_iter) - 1) % window
                if getattr(scaler, "dynamic", False) else 0)
        return scaler_block(scaler.cur_scale, good, int(getattr(scaler, "cur_hysteresis", 1) or 1))
    raise TypeError(f"no universal state for the loss scaler {type(scaler).__name__}")


def set_scaler(scaler: Any, block: Dict[str, torch.Tensor]) -> None:
    """Put ``block`` (loaded) into ``scaler``, whatever its kind (``scaler_state``'s inverse)."""
    scale, good = float(block["scale"].item()), int(block["good_steps"].item())
    left = int(block["overflows_left"].item()) if "overflows_left" in block else None
    if hasattr(scaler, "set_universal_values"):
        scaler.set_universal_values(scale, good, left)
    elif isinstance(scaler, torch.amp.GradScaler):
        scaler.load_state_dict({**scaler.state_dict(), "scale": scale, "_growth_tracker": good})
    else:  # DeepSpeed's
        scaler.cur_scale = scale
        if getattr(scaler, "dynamic", False):
            scaler.last_overflow_iter = int(scaler.cur_iter) - 1 - good
            scaler.cur_hysteresis = left if left is not None else scaler.delayed_shift


def with_scaler(scaler: Any) -> Dict[str, Any]:
    """{SCALER: its state}, or nothing: to spread into a universal state."""
    block = scaler_state(scaler)
    return {SCALER: block} if block is not None else {}


def scaler_target(target: Dict[str, Any], path: Path) -> bool:
    """Whether the load fills the target's scaler (with what the checkpoint holds of it: a count it has
    none of is dropped from the target): a checkpoint saved without one (another dtype) leaves the fresh
    scaler as it is (dropped from the target, said)."""
    if SCALER not in target:
        return False
    saved = saved_names(path)
    if f"{SCALER}.scale" in saved:
        target[SCALER] = {k: v for k, v in target[SCALER].items() if f"{SCALER}.{k}" in saved}
        return True
    del target[SCALER]
    print("launcher: the checkpoint holds no fp16 loss scaler (saved in another precision): the scale "
          "starts from precision.initial_scale_power", flush=True)
    return False


def saved_names(path: Path) -> set:
    """The names of the tensors the universal checkpoint at ``path`` holds (its index)."""
    import torch.distributed.checkpoint as dcp

    return set(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)


def save(state: Dict[str, Any], path: Path, rank: int, group: Any = None) -> List[str]:
    """Write ``state`` (every rank, collectively over ``group``, default the world's) into ``path``;
    the files this rank wrote, relative to ``path``'s parent (its done mark lists them with their
    digests). The save plan is cached (the same state's plan at every save: no planning over every
    rank each time)."""
    import torch.distributed.checkpoint as dcp

    path.mkdir(parents=True, exist_ok=True)
    writer = dcp.FileSystemWriter(str(path), single_file_per_rank=True, thread_count=1)
    dcp.save(state, storage_writer=writer, planner=_planner(), process_group=group,
             no_dist=not dist.is_initialized())
    mine = [RANK_FILE.format(rank=rank)] + ([INDEX] if rank == 0 else [])
    return [f"{path.name}/{n}" for n in mine if (path / n).exists()]  # (a rank with nothing to write: none)


def _planner() -> Any:
    """DCP's default planner, caching its plans where this torch offers it (2.6 and later)."""
    from torch.distributed.checkpoint import DefaultSavePlanner

    try:
        return DefaultSavePlanner(enable_plan_caching=True)
    except TypeError:
        return DefaultSavePlanner()


def present(ckpt: Path) -> bool:
    return (ckpt / DIR / INDEX).is_file()


@dataclass(frozen=True)
class Piece:
    """This rank's part of a full tensor of the universal state, named in place of the whole (a
    tensor-parallel shard: no gather at a save): ``local`` is ``full[rows][:, cols]`` of the full
    ``shape`` (None: the whole of that dim; ``rows`` a slice or an index tensor, ``cols`` a slice), or,
    with ``flat``, the flattened full tensor's ``local.numel()`` elements from ``flat`` on (a fragment
    of a ZeRO partition). Only the linked form takes pieces (launcher.training.universal_links)."""
    local: torch.Tensor
    shape: Tuple[int, ...]
    rows: Any = None
    cols: Optional[slice] = None
    flat: Optional[int] = None


def tensors_by_name(state: Dict[str, Any], prefix: str = "") -> Dict[str, Any]:
    """DCP's names: nested keys joined with dots (a Piece kept as it is)."""
    out: Dict[str, Any] = {}
    for k, v in state.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(tensors_by_name(v, key + "."))
        elif torch.is_tensor(v) or isinstance(v, Piece):
            out[key] = v
    return out


def _whole(t: torch.Tensor) -> torch.Tensor:
    """The full tensor (a DTensor gathered: collective over its mesh), on the host."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t.full_tensor()
    return t.detach().cpu()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def verify(state: Dict[str, Any], path: Path, rank: int, owned: bool = False) -> Dict[str, Any]:
    """The equivalence check of a reshard (every rank calls it, with the engine's state after the
    load): each tensor gathered whole and compared bit for bit on rank 0 with the saved one. Returns
    (on every rank) {"tensors", "bytes", "mismatched": [names], "missing": [names]}. ``owned``: each
    rank's state holds whole tensors no other rank checks (the megatron engine's: each pipeline stage
    assembles its own), so every rank compares its own and the reports are summed."""
    import torch.distributed.checkpoint as dcp

    tensors = tensors_by_name(state)
    names = sorted(tensors)
    report: Dict[str, Any] = {"tensors": len(names), "bytes": 0, "mismatched": [], "missing": []}
    checker = rank == 0 or owned
    meta = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata if checker else {}
    batch: Dict[str, torch.Tensor] = {}

    def compare() -> None:
        saved = {k: torch.empty(tuple(meta[k].size), dtype=meta[k].properties.dtype) for k in batch}
        with warnings.catch_warnings():  # (rank 0 alone reads: DCP warns that it assumes one process)
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(saved, checkpoint_id=str(path), no_dist=True)
        for k, now in batch.items():
            report["bytes"] += now.numel() * now.element_size()
            if now.shape != saved[k].shape or now.dtype != saved[k].dtype or not torch.equal(_bits(now),
                                                                                               _bits(saved[k])):
                report["mismatched"].append(k)
        batch.clear()

    held = 0
    for name in names:
        whole = _whole(tensors[name])  # every rank: a DTensor's gather is collective
        if not checker:
            continue
        if name not in meta or not hasattr(meta[name], "size"):
            if not name.startswith(SCALER + "."):  # (a scaler the checkpoint had none of: scaler_target)
                report["missing"].append(name)
            continue
        batch[name] = whole
        held += whole.numel() * whole.element_size()
        if held >= VERIFY_BATCH_BYTES:
            compare()
            held = 0
    if checker and batch:
        compare()
    if dist.is_initialized() and owned:
        every: List[Dict[str, Any]] = [{} for _ in range(dist.get_world_size())]
        dist.all_gather_object(every, report)
        report = {"tensors": sum(r["tensors"] for r in every), "bytes": sum(r["bytes"] for r in every),
                  "mismatched": sorted({n for r in every for n in r["mismatched"]}),
                  "missing": sorted({n for r in every for n in r["missing"]})}
    elif dist.is_initialized():
        box = [report]
        dist.broadcast_object_list(box, src=0)
        report = box[0]
    return report


# ---- DeepSpeed ZeRO 1, 2 and 3: its fp32 masters and Adam moments are flat partitions; each tensor is
# assembled whole (DeepSpeed's safe_get_full_*: a collective per parameter, at save time one tensor at a
# time) and kept as this rank's Shard(0) slice of it, so the files and the index are those of any
# other engine ----------------------------------------------------------------------------------------
DEEPSPEED_STAGES = RESHARD_DEEPSPEED_STAGES
_MESHES: Dict[Any, Any] = {}


def _world_mesh(device: torch.device) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    key = (device.type, dist.get_world_size())
    if key not in _MESHES:
        _MESHES[key] = init_device_mesh(device.type, (dist.get_world_size(),))
    return _MESHES[key]


def _sharded(full: torch.Tensor, mesh: Any) -> Any:
    from torch.distributed.tensor import Shard, distribute_tensor

    if full.dim() == 0:
        return full.detach().clone()
    # every rank holds the whole: each keeps its slice, nothing is sent (src_data_rank=None)
    return distribute_tensor(full.detach(), mesh, [Shard(0)], src_data_rank=None)


def _adam_step(optimizer: Any) -> torch.Tensor:
    inner = getattr(optimizer, "optimizer", optimizer)
    for st in inner.state.values():
        if "step" in st:
            return torch.as_tensor(st["step"], dtype=torch.float32).detach().cpu().clone()
    return torch.zeros((), dtype=torch.float32)


def _adam_state(optimizer: Any) -> None:
    """A ZeRO optimizer that has not stepped yet has no Adam state (torch creates it at the first step,
    DeepSpeed links its per-parameter views to it after): created as AdamW's first step would (zeros),
    and linked, so a load has somewhere to go."""
    inner = getattr(optimizer, "optimizer", optimizer)
    host_adam = any(c.__name__ == "DeepSpeedCPUAdam" for c in type(inner).__mro__)  # offload: its step an int
    fresh = False
    # ZeRO-3 hands its flat fp32 partitions to the optimizer only for the step (its groups are empty now)
    flat = getattr(optimizer, "fp32_partitioned_groups_flat", None)
    groups = inner.param_groups if flat is None else [
        {**inner.param_groups[optimizer.sub_group_to_group_id[i]], "params": [f]} for i, f in enumerate(flat)]
    for group in groups:
        for p in group["params"]:
            st = inner.state[p]
            if not st:
                on = p.device if group.get("fused") or group.get("capturable") else torch.device("cpu")
                st.update(step=0 if host_adam else torch.zeros((), dtype=torch.float32, device=on),
                          exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
                fresh = True
    link = getattr(optimizer, "_lazy_init_hp_params_optimizer_state", None)
    if link is not None:
        # DeepSpeed links once, at its first step, possibly before torch created the state: link again now
        if hasattr(optimizer, "_hp_optimizer_states_linked"):
            optimizer._hp_optimizer_states_linked = False
        link()
    elif fresh and flat is None:  # (ZeRO-3 reads its state unlinked)
        raise RuntimeError(f"cannot create the Adam state of {type(optimizer).__name__} to load into")


def deepspeed_state(module: torch.nn.Module, optimizer: Any, stage: int, scaler: Any = None
                    ) -> Optional[Dict[str, Any]]:
    """A DeepSpeed ZeRO-1/2/3 engine's state as ``module_state`` names it (None for other stages: their
    checkpoints load only on their own layout), with fp16 its loss ``scaler``. ZeRO-3's weights are
    partitions too: each is assembled from the fp32 masters like the others."""
    if stage not in DEEPSPEED_STAGES or not dist.is_initialized():
        return None
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    _adam_state(optimizer)
    device = next(module.parameters()).device
    mesh = _world_mesh(device)
    names = {id(p): n for n, p in module.named_parameters()}
    model: Dict[str, Any] = {}
    for key, v in module.state_dict(keep_vars=True).items():  # (a tied weight under each of its names)
        full = safe_get_full_fp32_param(v) if isinstance(v, torch.nn.Parameter) else v.detach()
        model[key] = _sharded(full, mesh)
    step = _adam_step(optimizer)
    optim: Dict[str, Any] = {}
    for p in dict.fromkeys(module.parameters()):
        optim[names[id(p)]] = {k: _sharded(safe_get_full_optimizer_state(p, k), mesh)
                               for k in ("exp_avg", "exp_avg_sq")}
        optim[names[id(p)]]["step"] = step.clone()
    return {"model": model, "optim": optim, **with_scaler(scaler)}


def deepspeed_pieces(module: torch.nn.Module, optimizer: Any, stage: int, scaler: Any = None,
                     buffers: bool = True) -> Optional[Dict[str, Any]]:
    """``deepspeed_state``'s names, each this rank's fragment of DeepSpeed's flat fp32 partitions as a flat
    Piece, no collective: linked to the partitions its own optimizer file holds. ``buffers``: this rank
    saves the module's file (its buffers are named there). None before the first step (no moments yet),
    or where a partition is swapped out to NVMe: the universal form is then written."""
    if stage not in (1, 2, 3):
        return None
    frags = _zero3_fragment if stage == 3 else _zero12_fragment
    inner = getattr(optimizer, "optimizer", optimizer)
    # each flat partition the optimizer steps, by its storage: (the partition, its state)
    partitions = {p.untyped_storage().data_ptr(): (p, st) for p, st in inner.state.items() if torch.is_tensor(p)}
    names = {id(p): n for n, p in module.named_parameters()}
    found: Dict[int, Any] = {}
    for p in dict.fromkeys(module.parameters()):
        try:
            found[id(p)] = frags(p, optimizer, inner, partitions)
        except _NotMapped:
            return None
    model: Dict[str, Any] = {}
    for key, v in module.state_dict(keep_vars=True).items():  # (a tied weight under each of its names)
        if isinstance(v, torch.nn.Parameter):
            if found.get(id(v)) is not None:  # (none: all of it lies in other ranks' partitions)
                fragment, start, _ = found[id(v)]
                model[key] = Piece(fragment(None), _full_shape(v), flat=start)
        elif buffers:
            model[key] = v.detach()
    optim: Dict[str, Any] = {}
    for p in dict.fromkeys(module.parameters()):
        if found.get(id(p)) is None:
            continue
        fragment, start, state = found[id(p)]
        step = state.get("step")  # its partition's own
        if step is None:
            return None
        optim[names[id(p)]] = {k: Piece(fragment(k), _full_shape(p), flat=start) for k in ("exp_avg", "exp_avg_sq")}
        # the very tensor the optimizer file holds (an offloaded Adam's int step: kept by value)
        optim[names[id(p)]]["step"] = step if torch.is_tensor(step) and step.dtype == torch.float32 \
            else torch.tensor(float(step), dtype=torch.float32)
    return {"model": model, "optim": optim, **with_scaler(scaler)}


def _full_shape(p: torch.Tensor) -> Tuple[int, ...]:
    """A parameter's whole shape (ZeRO-3's partitioned ones hold an empty tensor: their ``ds_shape``)."""
    return tuple(p.ds_shape if hasattr(p, "ds_shape") else p.shape)


class _NotMapped(Exception):
    """A parameter's fp32 fragment or moments cannot be named in this rank's partitions."""


def _zero12_fragment(p: torch.Tensor, optimizer: Any, inner: Any, partitions: Dict[int, Any]
                     ) -> Optional[Tuple[Any, int, Dict[str, Any]]]:
    """ZeRO-1/2: the fragment DeepSpeed maps the parameter to (its ``_hp_mapping``, a view of the rank's
    flat fp32 partition): (the fragment of a state key, None for the weights; its start in the flat
    parameter; its partition's optimizer state), or None where it lies wholly in other ranks' partitions.
    A moment's fragment is the same range of its partition's moment where DeepSpeed maps none (CPU Adam
    keeps the moments: offload)."""
    m = getattr(p, "_hp_mapping", None)
    if m is None:
        return None
    flat, state = partitions.get(m.hp_fragment.untyped_storage().data_ptr(), (None, {}))
    if m.optim_fragment and "exp_avg" in m.optim_fragment:
        return (lambda k: m.hp_fragment if k is None else m.get_hp_fragment(k)), m.lp_fragment_address.start, state
    if flat is None or "exp_avg" not in state or "exp_avg_sq" not in state:
        raise _NotMapped(p)
    at, numel = m.hp_fragment.storage_offset() - flat.storage_offset(), m.hp_fragment.numel()
    return (lambda k: m.hp_fragment if k is None else state[k].view(-1).narrow(0, at, numel)), \
        m.lp_fragment_address.start, state


def _zero3_fragment(p: torch.Tensor, optimizer: Any, inner: Any, partitions: Dict[int, Any]
                    ) -> Optional[Tuple[Any, int, Dict[str, Any]]]:
    """ZeRO-3 (as ``_zero12_fragment``): the parameter's partition in its sub-group's flat fp32 tensor
    (``grad_position``, as DeepSpeed's own get_local_fp32_param finds it), less the padding past its last
    element; it starts at the rank's place in the parameter's partition group times the partition's size."""
    position = getattr(optimizer, "grad_position", {}).get(optimizer.get_param_id(p)) \
        if hasattr(optimizer, "get_param_id") else None
    if position is None or not hasattr(p, "ds_numel"):
        raise _NotMapped(p)
    group, offset, size = position
    if getattr(optimizer, "_swappable_optimizer_subgroup", lambda _g: False)(group):
        raise _NotMapped(p)  # (its partition is on NVMe between steps)
    flat = optimizer.fp32_partitioned_groups_flat[group]
    state = inner.state.get(flat, {})
    if "exp_avg" not in state or "exp_avg_sq" not in state:
        raise _NotMapped(p)
    start = size * dist.get_rank(group=p.ds_process_group)
    valid = min(size, int(p.ds_numel) - start)
    if valid <= 0:
        return None
    return (lambda k: (flat if k is None else state[k]).narrow(0, offset, valid)), start, state


def load_deepspeed_state(module: torch.nn.Module, optimizer: Any, stage: int, path: Path, scaler: Any = None
                         ) -> None:
    """Fill a DeepSpeed ZeRO-1/2/3 engine from the universal checkpoint at ``path``: each rank reads its
    slices, every tensor is assembled whole (a gather per tensor) and set into DeepSpeed's partitions
    (safe_set_full_*), the module's weights from the fp32 masters (ZeRO-3: each rank its partition)."""
    import torch.distributed.checkpoint as dcp
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    target = deepspeed_state(module, optimizer, stage, scaler)
    if target is None:
        raise RuntimeError(f"DeepSpeed ZeRO stage {stage} does not load layout-independent checkpoints "
                           f"(stages {', '.join(map(str, DEEPSPEED_STAGES))} do)")
    loading_scaler = scaler_target(target, path)
    dcp.load(target, checkpoint_id=str(path))
    if loading_scaler:
        set_scaler(scaler, target[SCALER])
    live = module.state_dict(keep_vars=True)
    names = {id(p): n for n, p in module.named_parameters()}
    with torch.no_grad():
        for key, v in target["model"].items():
            full = _whole(v).to(live[key].device)
            if isinstance(live[key], torch.nn.Parameter):
                safe_set_full_fp32_param(live[key], full)
            if hasattr(live[key], "ds_tensor"):  # ZeRO-3: this rank's partition of the flat weight (padded)
                part = live[key].ds_tensor
                at = optimizer._get_param_partition_rank(live[key]) * part.numel()
                flat = full.reshape(-1)[at:at + part.numel()]
                part.data.zero_()
                part.data[:flat.numel()].copy_(flat.to(part.dtype))
            else:
                live[key].data.copy_(full.to(live[key].dtype))  # ZeRO 1/2: every rank holds the whole weight
        for p in dict.fromkeys(module.parameters()):
            for k in ("exp_avg", "exp_avg_sq"):
                safe_set_full_optimizer_state(p, _whole(target["optim"][names[id(p)]][k]).to(p.device), k)
        step = next(iter(target["optim"].values()))["step"] if target["optim"] else None
        inner = getattr(optimizer, "optimizer", optimizer)
        for st in inner.state.values():
            if step is not None and "step" in st:
                # a tensor of its own per state (torch steps each in place: a shared one would count twice)
                st["step"] = step.to(st["step"].device, st["step"].dtype, copy=True) if torch.is_tensor(st["step"]) \
                    else type(st["step"])(step.item())
