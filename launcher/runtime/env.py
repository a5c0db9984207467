"""Rank and rendezvous settings for torch.distributed, from the submitit/Slurm job environment.

MASTER_ADDR is the first host of the allocation; MASTER_PORT comes from the job id, so two jobs
(or two array tasks, which have distinct job ids) sharing a node never pick the same port.
"""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional


def scheduler_node_name() -> Optional[str]:
    """The name the scheduler gives this node (Slurm: SLURMD_NODENAME), None outside a scheduler's job.
    The one place it is read: nodes of one cluster can share a host (scripts/slurm-local.sh), so this,
    not the hostname, tells them apart."""
    return os.environ.get("SLURMD_NODENAME") or None


def node_name() -> str:
    """This node: the scheduler's name for it, else the hostname."""
    return scheduler_node_name() or socket.gethostname()


PORT_BASE = 15000
EPHEMERAL_START = 32768  # Linux's default ip_local_port_range start


def ephemeral_start(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> int:
    """First port the kernel hands out for outgoing connections (never listen there: any client
    socket may hold it)."""
    try:
        return int(open(path).read().split()[0])
    except (OSError, ValueError, IndexError):
        return EPHEMERAL_START


# torchrun's and DeepSpeed's default rendezvous port (29500) and its neighbours: never derived
RESERVED = range(29400, 29600)


def port_for_job(job_id: str, first_ephemeral: int = EPHEMERAL_START) -> int:
    """A rendezvous port derived from the job id ("1234", "1234_5" or a local pid), between
    PORT_BASE and the ephemeral range, so neither another job nor a client socket holds it, and
    outside RESERVED (a torchrun on the same node). Two jobs get the same port only when their ids
    differ by a multiple of the span (~17,500 ids apart: not side by side on one node)."""
    digits = re.sub(r"\D", "", str(job_id)) or "0"
    span = max(1000, first_ephemeral - PORT_BASE - len(RESERVED))
    port = PORT_BASE + int(digits) % span
    return port + len(RESERVED) if port >= RESERVED.start else port


ADDR_ENV = "LAUNCHER_MASTER_ADDR"  # the rendezvous address, resolved once (a batch script may set it)
ADDR_WAIT_S = 120.0  # how long a rank waits for rank 0's address (tasks of one job start apart)


def _scontrol_addr(host: str) -> Optional[str]:
    """Slurm's NodeAddr of ``host`` (one RPC to slurmctld), or None."""
    try:
        out = subprocess.run(
            ["scontrol", "show", "node", host, "-o"], capture_output=True, text=True, timeout=30
        ).stdout
        m = re.search(r"\bNodeAddr=(\S+)", out)
        if m:
            return m.group(1)
    except (OSError, subprocess.SubprocessError):
        pass
    return None


def _alias_addr(host: str) -> Optional[str]:
    """``host``'s address from SLURM_NODE_ALIASES (``name:[addr]:host,...``, cloud nodes), or None."""
    for item in os.environ.get("SLURM_NODE_ALIASES", "").split(","):
        parts = item.split(":")
        if len(parts) >= 2 and parts[0] == host and parts[1].strip("[]"):
            return parts[1].strip("[]")
    return None


def _shared_addr(shared: Path, host: str) -> Optional[str]:
    try:
        found = json.loads(shared.read_text())
    except (OSError, ValueError):
        return None
    ok = isinstance(found, dict) and found.get("host") == host and isinstance(found.get("addr"), str)
    return found["addr"] if ok else None


def _share_addr(shared: Path, host: str, addr: str) -> None:
    tmp = shared.with_name(f".{shared.name}.{os.getpid()}.tmp")
    try:
        try:
            f = open(tmp, "w")
        except FileNotFoundError:
            shared.parent.mkdir(parents=True, exist_ok=True)
            f = open(tmp, "w")
        with f:
            f.write(json.dumps({"host": host, "addr": addr}) + "\n")
        os.replace(tmp, shared)
    except OSError:  # the others fall back to asking Slurm themselves
        pass


def resolve_addr(host: str, leader: bool = True, shared: Optional[Path] = None,
                 wait_s: float = ADDR_WAIT_S) -> str:
    """An address for `host`: the host itself where DNS knows it (or ADDR_ENV, where set); else
    Slurm's NodeAddr, asked once per job, not once per rank (thousands of scontrol calls at once
    would flood slurmctld): SLURM_NODE_ALIASES where it names the host, else the ``leader`` (rank 0)
    asks scontrol and leaves the answer in ``shared`` (a file of the run dir), which every other rank
    reads (waiting up to ``wait_s`` for it; asking itself only after that)."""
    if os.environ.get(ADDR_ENV):
        return os.environ[ADDR_ENV]
    try:
        socket.getaddrinfo(host, None)
        return host
    except socket.gaierror:
        pass
    addr = _alias_addr(host)
    if addr is not None:
        return addr
    if shared is not None and not leader:
        deadline = time.monotonic() + wait_s
        while True:
            addr = _shared_addr(shared, host)
            if addr is not None:
                return addr
            if time.monotonic() > deadline:
                break
            time.sleep(0.5)
    addr = _scontrol_addr(host)
    if addr is not None and shared is not None and leader:
        _share_addr(shared, host, addr)
    return addr or host


@dataclass
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    num_nodes: int
    hostnames: List[str]
    job_id: str
    raw_job_id: str
    array_job_id: Optional[str]
    array_task_id: Optional[str]
    master_addr: str
    master_port: int

    def export(self) -> Dict[str, str]:
        """The variables torch.distributed's env:// rendezvous reads."""
        env = {
            "RANK": str(self.rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(self.local_rank),
            "LOCAL_WORLD_SIZE": str(self.local_world_size),
            "GROUP_RANK": str(self.node_rank),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
        }
        os.environ.update(env)
        return env


def detect(master_port: Optional[int] = None, addr_file: Optional[Path] = None) -> DistEnv:
    """Read the running submitit job's environment (Slurm or local); ``master_port`` (cluster.master_port)
    overrides the port derived from the job id; ``addr_file``: where rank 0 leaves the rendezvous
    host's address for the others when only Slurm knows it (resolve_addr)."""
    import submitit  # submitit: only inside a job; login-side users of this module do without it

    je = submitit.JobEnvironment()
    hosts = list(je.hostnames)
    world = je.num_tasks
    nodes = max(1, je.num_nodes)
    return DistEnv(
        rank=je.global_rank,
        world_size=world,
        local_rank=je.local_rank,
        local_world_size=max(1, world // nodes),
        node_rank=je.node,
        num_nodes=nodes,
        hostnames=hosts,
        job_id=je.job_id,
        raw_job_id=je.raw_job_id,
        array_job_id=je.array_job_id,
        array_task_id=je.array_task_id,
        master_addr=resolve_addr(hosts[0], leader=je.global_rank == 0, shared=addr_file) if hosts else "127.0.0.1",
        master_port=int(master_port) if master_port else port_for_job(je.raw_job_id, ephemeral_start()),
    )


class DeviceError(RuntimeError):
    """This rank cannot get a GPU of its own: the job would crawl on CPU or NCCL would fail later."""


def device_index(local_rank: int, local_world: int, visible: int, visible_env: Optional[str]) -> int:
    """The CUDA device (among the ``visible`` this process sees) for the rank ``local_rank`` of
    ``local_world`` ranks on its node. Two binding styles:

    - every rank sees the node's GPUs (sbatch --gpus-per-node, the local executor): device =
      local rank; fewer GPUs than ranks would put two ranks on one GPU: refused;
    - every rank sees one GPU (--gpus-per-task=1, --gpu-bind=single:1 / map_gpu: Slurm sets a
      different CUDA_VISIBLE_DEVICES per task): device 0, whatever its local rank.

    One visible GPU and several ranks with no CUDA_VISIBLE_DEVICES set is one GPU shared."""
    if visible <= 0:
        raise DeviceError("no CUDA device is visible to this process")
    if visible == 1 and (local_world == 1 or visible_env not in (None, "")):
        return 0
    if local_world > visible:
        raise DeviceError(
            f"{local_world} ranks on this node but {visible} GPU(s) visible to each: ranks would share a GPU "
            f"(NCCL fails with 'Duplicate GPU detected'); set cluster.gpus_per_node={visible}, or bind one GPU per "
            "task (cluster.sbatch_extra: {gpus-per-task: 1})")
    return local_rank


def cuda_problem(expect_gpus: bool, cuda_available: bool, torch_cuda: Optional[str], visible_env: Optional[str],
                 why: str) -> Optional[str]:
    """Why a job that should compute on GPUs cannot (or None): never fall back to CPU silently.
    ``torch_cuda``: torch.version.cuda (None for a CPU build); ``why``: what promised GPUs."""
    if not expect_gpus or cuda_available:
        return None
    if torch_cuda is None:
        return (f"{why}, but torch is a CPU build (torch.version.cuda is None): install a CUDA build on the "
                "nodes (scripts/setup.sh does where nvidia-smi works)")
    if visible_env in ("", "-1"):
        return (f"{why}, but CUDA_VISIBLE_DEVICES={visible_env!r} hides every GPU: ask the scheduler for them "
                "(cluster.use_gpus=true: --gpus-per-node)")
    return (f"{why}, but torch (CUDA {torch_cuda}) finds no usable GPU: check the driver (nvidia-smi) against "
            "the CUDA version of the torch build")
