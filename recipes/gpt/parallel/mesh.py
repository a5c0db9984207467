"""The dp x pp x tp rank mesh: which rank holds which piece of the model.

    world = dp * pp * tp
    rank  = dp_idx * (pp * tp) + pp_idx * tp + tp_idx

Tensor-parallel ranks are adjacent (so with one task per GPU and Slurm's block distribution they
sit inside one node, where the per-layer collectives use the fast link), pipeline stages come next
(their point-to-point sends may cross nodes), data parallelism is outermost. This is the row-major
order of ``torch.arange(world).view(dp, pp, tp)``, i.e. exactly the layout of
``init_device_mesh(device, (dp, pp, tp), mesh_dim_names=("dp", "pp", "tp"))``.

``rank_coords``, ``coords_rank`` and ``groups`` are pure functions (no torch import) so they can
be unit tested and used on the login node; ``build_mesh`` creates the torch DeviceMesh and the
extra process groups inside a running job.
"""
from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

AXES = ("dp", "pp", "tp")
Coords = Tuple[int, int, int]


def _check_sizes(dp: int, pp: int, tp: int) -> None:
    for name, value in (("dp", dp), ("pp", pp), ("tp", tp)):
        if int(value) < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")


def rank_coords(rank: int, dp: int, pp: int, tp: int) -> Coords:
    """(dp_idx, pp_idx, tp_idx) of ``rank`` in a dp x pp x tp mesh."""
    _check_sizes(dp, pp, tp)
    world = dp * pp * tp
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside a world of dp*pp*tp = {dp}*{pp}*{tp} = {world}")
    return rank // (pp * tp), (rank // tp) % pp, rank % tp


def coords_rank(dp_idx: int, pp_idx: int, tp_idx: int, dp: int, pp: int, tp: int) -> int:
    """Inverse of ``rank_coords``."""
    _check_sizes(dp, pp, tp)
    if not (0 <= dp_idx < dp and 0 <= pp_idx < pp and 0 <= tp_idx < tp):
        raise ValueError(f"coordinates ({dp_idx}, {pp_idx}, {tp_idx}) outside mesh ({dp}, {pp}, {tp})")
    return dp_idx * pp * tp + pp_idx * tp + tp_idx


def groups(dp: int, pp: int, tp: int) -> Dict[str, List[List[int]]]:
    """Every process group of the mesh, as lists of global ranks (each list ordered by its axis index):

    - ``tp``: ranks differing only in tp_idx (one tensor-parallel group per (dp, pp));
    - ``pp``: ranks differing only in pp_idx (one pipeline per (dp, tp)); position = stage;
    - ``dp``: ranks differing only in dp_idx (gradient all-reduce / ZeRO group per (pp, tp));
    - ``mp``: the model-parallel group of one replica (all pp x tp ranks of a dp_idx);
    - ``embedding``: first and last stage of each pipeline (tied word embedding / head grads);
      empty when pp == 1 (the head then shares the embedding's parameter).
    """
    _check_sizes(dp, pp, tp)
    r = lambda d, p, t: coords_rank(d, p, t, dp, pp, tp)  # noqa: E731
    out: Dict[str, List[List[int]]] = {
        "tp": [[r(d, p, t) for t in range(tp)] for d in range(dp) for p in range(pp)],
        "pp": [[r(d, p, t) for p in range(pp)] for d in range(dp) for t in range(tp)],
        "dp": [[r(d, p, t) for d in range(dp)] for p in range(pp) for t in range(tp)],
        "mp": [[r(d, p, t) for p in range(pp) for t in range(tp)] for d in range(dp)],
        "embedding": [],
    }
    if pp > 1:
        out["embedding"] = [[r(d, 0, t), r(d, pp - 1, t)] for d in range(dp) for t in range(tp)]
    return out


def group_of(rank: int, axis_groups: List[List[int]]) -> List[int]:
    """The group in ``axis_groups`` that contains ``rank`` ([] if none)."""
    for g in axis_groups:
        if rank in g:
            return g
    return []


def node_of(rank: int, procs_per_node: int) -> int:
    """Node index of ``rank`` under block placement (Slurm's default: consecutive ranks per node)."""
    return rank // int(procs_per_node)


@dataclass
class ParallelMesh:
    """This rank's place in the mesh and its process groups (built by ``build_mesh``)."""

    dp: int
    pp: int
    tp: int
    rank: int
    device_mesh: Any = None  # torch.distributed.device_mesh.DeviceMesh
    tp_group: Any = None
    pp_group: Any = None
    dp_group: Any = None
    embedding_group: Any = None  # None when pp == 1
    ranks: Dict[str, List[int]] = field(default_factory=dict)

    @property
    def coords(self) -> Coords:
        return rank_coords(self.rank, self.dp, self.pp, self.tp)

    @property
    def dp_rank(self) -> int:
        return self.coords[0]

    @property
    def pp_rank(self) -> int:
        return self.coords[1]

    @property
    def tp_rank(self) -> int:
        return self.coords[2]

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1


def build_mesh(dp: int, pp: int, tp: int, rank: int, device_type: str) -> ParallelMesh:
    """The torch DeviceMesh over the already initialised default process group, plus the
    embedding group. Every rank must call it (group creation is collective)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if world != dp * pp * tp:
        raise ValueError(f"world size {world} != dp*pp*tp = {dp}*{pp}*{tp}")
    device_mesh = init_device_mesh(device_type, (dp, pp, tp), mesh_dim_names=AXES)
    coords = rank_coords(rank, dp, pp, tp)
    if tuple(device_mesh.get_coordinate()) != coords:  # our arithmetic must be torch's layout
        raise RuntimeError(f"DeviceMesh puts rank {rank} at {device_mesh.get_coordinate()}, expected {coords}")
    all_groups = groups(dp, pp, tp)
    mesh = ParallelMesh(
        dp=dp, pp=pp, tp=tp, rank=rank, device_mesh=device_mesh,
        tp_group=device_mesh.get_group("tp"), pp_group=device_mesh.get_group("pp"),
        dp_group=device_mesh.get_group("dp"),
        ranks={axis: group_of(rank, all_groups[axis]) for axis in ("tp", "pp", "dp", "mp", "embedding")},
    )
    if pp == 2:
        mesh.embedding_group = mesh.pp_group  # first and last stage are the whole pipeline
    elif pp > 2:
        # collective: every rank creates every embedding group, in the same order
        mesh.embedding_group, _ = dist.new_subgroups_by_enumeration(all_groups["embedding"])
    return mesh


def placement_record(mesh: ParallelMesh, extra: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    dp_idx, pp_idx, tp_idx = mesh.coords
    return {
        "rank": mesh.rank,
        "dp": dp_idx,
        "pp": pp_idx,
        "tp": tp_idx,
        "sizes": {"dp": mesh.dp, "pp": mesh.pp, "tp": mesh.tp},
        "groups": mesh.ranks,
        "hostname": socket.gethostname(),
        "slurmd_nodename": os.environ.get("SLURMD_NODENAME"),
        **(extra or {}),
    }


def write_placement(run_dir: Path, mesh: ParallelMesh, extra: Optional[Dict[str, Any]] = None) -> Path:
    """Write ``run_dir/ranks/mesh_<rank>.json`` (atomically) and return its path."""
    path = Path(run_dir) / "ranks" / f"mesh_{mesh.rank}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(placement_record(mesh, extra), indent=1, sort_keys=True))
    os.replace(tmp, path)
    return path
