"""Rank and rendezvous settings for torch.distributed, from the job's environment as its backend reads
it (launcher.backends: Backend.detect, place, node_name, address_hint, ask_address): no scheduler's
variable is named here.

MASTER_ADDR is the first host of the allocation; MASTER_PORT comes from the job id, so two jobs
(or two array tasks, which have distinct job ids) sharing a node never pick the same port.
"""
from __future__ import annotations

import json
import os
import re
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

from launcher import backends
from launcher.backends import Backend


def scheduler() -> Optional[Backend]:
    """The backend whose job this process is part of (None outside a job): it alone reads the
    scheduler's variables (launcher.backends, Backend.detect)."""
    return backends.running()


def scheduler_node_name() -> Optional[str]:
    """The name the scheduler gives this node, None outside a scheduler's job or where it names none.
    The one place it is read: nodes of one cluster can share a host (scripts/slurm-local.sh), so this,
    not the hostname, tells them apart."""
    backend = scheduler()
    return backend.node_name(os.environ) if backend is not None else None


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


STEP_STRIDE = 7919  # a prime: the steps of one pack spread over the span, away from the job's neighbours


def port_for_job(job_id: str, first_ephemeral: int = EPHEMERAL_START) -> int:
    """A rendezvous port derived from the job id ("1234", "1234_5" or a local pid), between
    PORT_BASE and the ephemeral range, so neither another job nor a client socket holds it, and
    outside RESERVED (a torchrun on the same node). Two jobs get the same port only when their ids
    differ by a multiple of the span (~17,500 ids apart: not side by side on one node). A pack's point
    ("<job>.<step>", launcher.features.pack.runner) adds its step times STEP_STRIDE: the points of one pack on
    one node never share a port."""
    job, _, step = str(job_id).partition(".")  # a pack's point: <job>.<step> (two on one node differ)
    digits = re.sub(r"\D", "", job) or "0"
    if step.isdigit():
        digits = str(int(digits) + (int(step) + 1) * STEP_STRIDE)
    span = max(1000, first_ephemeral - PORT_BASE - len(RESERVED))
    port = PORT_BASE + int(digits) % span
    return port + len(RESERVED) if port >= RESERVED.start else port


ADDR_ENV = "LAUNCHER_MASTER_ADDR"  # the rendezvous address, resolved once (a batch script may set it)
ADDR_WAIT_S = 120.0  # how long a rank waits for rank 0's address (tasks of one job start apart)


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
                 wait_s: float = ADDR_WAIT_S, backend: Optional[Backend] = None) -> str:
    """An address for `host`: the host itself where DNS knows it (or ADDR_ENV, where set); else the
    scheduler's (``backend``, default the detected one), asked once per job, not once per rank
    (thousands of questions at once would flood its controller): its environment's hint where it names
    the host (Slurm: its node aliases), else the ``leader`` (rank 0) asks it (Slurm: its controller) and
    leaves the answer in ``shared`` (a file of the run dir), which every other rank reads (waiting up
    to ``wait_s`` for it; asking itself only after that)."""
    if os.environ.get(ADDR_ENV):
        return os.environ[ADDR_ENV]
    try:
        socket.getaddrinfo(host, None)
        return host
    except socket.gaierror:
        pass
    backend = backend if backend is not None else scheduler()
    if backend is None:
        return host
    addr = backend.address_hint(host, os.environ)
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
    addr = backend.ask_address(host)
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
        """The variables torch.distributed's env:// rendezvous reads, and DeepSpeed's ``LOCAL_SIZE``."""
        env = {
            "RANK": str(self.rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(self.local_rank),
            "LOCAL_WORLD_SIZE": str(self.local_world_size),
            # what DeepSpeed's own launcher sets: its CPU accelerator takes it for device_count(), which
            # ZeRO-3 asks every step; unset, it counts NUMA nodes by running `numactl` (a fork of the rank
            # each step) and gets the node count, not the ranks on the node
            "LOCAL_SIZE": str(self.local_world_size),
            "GROUP_RANK": str(self.node_rank),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
        }
        os.environ.update(env)
        return env


class NotInAJob(RuntimeError):
    """No backend recognises this process's environment as one of its jobs."""


def detect(master_port: Optional[int] = None, addr_file: Optional[Path] = None,
           backend: Optional[Backend] = None) -> DistEnv:
    """This process's place in its job, as its backend reads it (``backend``: the detected one);
    ``master_port`` (cluster.master_port) overrides the port derived from the job id; ``addr_file``:
    where rank 0 leaves the rendezvous host's address for the others when only the scheduler knows
    it (resolve_addr)."""
    backend = backend if backend is not None else scheduler()
    if backend is None:
        raise NotInAJob("this process is not a task of any backend's job (launcher.backends: none detects "
                        "itself in the environment)")
    p = backend.place(os.environ)
    hosts = list(p.hostnames)
    nodes = max(1, p.num_nodes)
    return DistEnv(
        rank=p.rank,
        world_size=p.world_size,
        local_rank=p.local_rank,
        local_world_size=max(1, p.world_size // nodes),
        node_rank=p.node_rank,
        num_nodes=nodes,
        hostnames=hosts,
        job_id=p.job_id,
        raw_job_id=p.raw_job_id,
        array_job_id=p.array_job_id,
        array_task_id=p.array_task_id,
        master_addr=resolve_addr(hosts[0], leader=p.rank == 0, shared=addr_file, backend=backend)
        if hosts else "127.0.0.1",
        master_port=int(master_port) if master_port else port_for_job(p.raw_job_id, ephemeral_start()),
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


def deterministic_kernels() -> None:
    """train.deterministic, before the rank's first CUDA matmul: the same kernels, summing in the same
    order, on every run (CUBLAS_WORKSPACE_CONFIG is read when cuBLAS makes its handle)."""
    import torch  # torch: only on the node

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    if torch.cuda.is_available():  # flash attention's backward adds with atomics: another SDPA kernel
        torch.backends.cuda.enable_flash_sdp(False)
