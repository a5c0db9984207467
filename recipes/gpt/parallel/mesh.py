"""The dp x pp x tp rank mesh of a running job: the torch DeviceMesh and process groups.

Where every rank sits is the run's ``Layout`` (``launcher.config.layout``: ``coords``, ``rank_of``,
``groups``, ``group_of``, ``node_of``; pure, also used on the login node):

    world = dp * pp * tp
    rank  = dp_idx * (pp * tp) + pp_idx * tp + tp_idx

Tensor-parallel ranks are adjacent (so with one task per GPU and Slurm's block distribution they
sit inside one node, where the per-layer collectives use the fast link), pipeline stages come next
(their point-to-point sends may cross nodes), data parallelism is outermost. This is the row-major
order of ``torch.arange(world).view(dp, pp, tp)``, i.e. exactly the layout of
``init_device_mesh(device, (dp, pp, tp), mesh_dim_names=("dp", "pp", "tp"))``.

``build_mesh`` creates that DeviceMesh and the extra process groups inside a running job;
``placement_record`` is what each rank records through ``ctx.rundir.write_mesh``.
"""
from __future__ import annotations

import socket
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from launcher.config.layout import AXES, Coords, Layout
from launcher.runtime.env import scheduler_node_name


@dataclass
class ParallelMesh:
    """This rank's place in the layout's mesh and its process groups (built by ``build_mesh``)."""

    layout: Layout
    rank: int
    device_mesh: Any = None  # torch.distributed.device_mesh.DeviceMesh
    tp_group: Any = None
    pp_group: Any = None
    dp_group: Any = None
    embedding_group: Any = None  # None when pp == 1
    ranks: Dict[str, List[int]] = field(default_factory=dict)

    @property
    def dp(self) -> int:
        return self.layout.dp

    @property
    def pp(self) -> int:
        return self.layout.pp

    @property
    def tp(self) -> int:
        return self.layout.tp

    @property
    def coords(self) -> Coords:
        return self.layout.coords(self.rank)

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


def build_mesh(layout: Layout, rank: int, device_type: str) -> ParallelMesh:
    """The torch DeviceMesh of ``layout`` over the already initialised default process group, plus
    the embedding group. Every rank must call it (group creation is collective)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dp, pp, tp = layout.dp, layout.pp, layout.tp
    world = dist.get_world_size()
    if world != layout.world_size:  # the job is not the one the layout was archived for
        raise ValueError(f"world size {world} != dp*pp*tp = {dp}*{pp}*{tp} of the run's layout")
    device_mesh = init_device_mesh(device_type, (dp, pp, tp), mesh_dim_names=AXES)
    coords = layout.coords(rank)
    if tuple(device_mesh.get_coordinate()) != coords:  # the layout's arithmetic must be torch's
        raise RuntimeError(f"DeviceMesh puts rank {rank} at {device_mesh.get_coordinate()}, expected {coords}")
    mesh = ParallelMesh(
        layout=layout, rank=rank, device_mesh=device_mesh,
        tp_group=device_mesh.get_group("tp"), pp_group=device_mesh.get_group("pp"),
        dp_group=device_mesh.get_group("dp"),
        ranks={axis: layout.group_of(rank, axis) for axis in ("tp", "pp", "dp", "mp", "embedding")},
    )
    if pp == 2:
        mesh.embedding_group = mesh.pp_group  # first and last stage are the whole pipeline
    elif pp > 2:
        # each first- and last-stage rank creates its own pair's group with its partner only: one call,
        # synchronized within the pair (every rank creating all dp x tp of them, each a call of the whole
        # world, was thousands of communicator creations at 512 nodes); a middle stage has none
        mine = layout.group_of(rank, "embedding")
        if mine:
            mesh.embedding_group = dist.new_group(ranks=sorted(mine), use_local_synchronization=True)
    return mesh


def placement_record(mesh: ParallelMesh, extra: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """This rank's coordinates, mesh sizes, groups and host (``ctx.rundir.write_mesh(rank, record)``)."""
    dp_idx, pp_idx, tp_idx = mesh.coords
    return {
        "rank": mesh.rank,
        "dp": dp_idx,
        "pp": pp_idx,
        "tp": tp_idx,
        "sizes": {"dp": mesh.dp, "pp": mesh.pp, "tp": mesh.tp},
        "groups": mesh.ranks,
        "hostname": socket.gethostname(),
        "slurmd_nodename": scheduler_node_name(),
        **(extra or {}),
    }
