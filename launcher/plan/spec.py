"""The planner's inputs as plain frozen dataclasses: a layout choice and the cluster's hardware.

Built once from a composed run config (``from_cfg``), then every estimator works on these: the
search evaluates thousands of layouts per second without touching OmegaConf.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional, Tuple

from launcher.schema import enum_value

GIB = 1 << 30
HEADROOM = 0.10  # of the device memory, kept free for the CUDA context, NCCL and fragmentation

# Used where the cluster config leaves hardware unknown (0), so a search on cluster=local still ranks;
# every estimate made with them lists the keys in ``ClusterSpec.assumed``.
DEFAULT_PEAK_TFLOPS = 100.0
DEFAULT_INTRA_GBPS = 100.0
DEFAULT_INTER_GBPS = 10.0


def implied_engine(tp: int, pp: int, zero: int) -> str:
    """The engine a layout needs: megatron for tp or pp > 1, deepspeed for ZeRO > 0, else ddp
    (the same choice as ``parallelism.engine=auto``)."""
    if tp > 1 or pp > 1:
        return "megatron"
    return "deepspeed" if zero > 0 else "ddp"


def engine_allows(engine: str, tp: int, pp: int, zero: int, offload: bool = False) -> bool:
    """Whether ``engine`` runs this layout (the rules of launcher.layout's engine checks)."""
    if engine == "ddp":
        return tp == 1 and pp == 1 and zero == 0
    if engine == "deepspeed":
        return tp == 1 and pp == 1
    if engine == "megatron":
        return zero <= 1 and not offload
    return False


@dataclass(frozen=True)
class LayoutSpec:
    """One way to run the model: degrees, batch split, ZeRO, recompute, precision and engine."""

    dp: int
    tp: int = 1
    pp: int = 1
    zero: int = 0
    micro_batch_size: int = 1
    grad_accum: int = 1
    recompute: str = "none"
    sequence_parallel: bool = False
    dtype: str = "bf16"
    engine: str = ""  # "" = implied by the layout
    offload_optimizer: bool = False
    offload_params: bool = False

    def __post_init__(self) -> None:
        if not self.engine:
            object.__setattr__(self, "engine", implied_engine(self.tp, self.pp, self.zero))

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def global_batch_size(self) -> int:
        return self.dp * self.micro_batch_size * self.grad_accum

    def with_(self, **changes: Any) -> "LayoutSpec":
        return replace(self, **changes)

    @classmethod
    def from_cfg(cls, cfg: Any) -> "LayoutSpec":
        """The layout a (valid) run config names; ``parallelism.engine=auto`` becomes the implied one."""
        par, tr, z, cl = cfg.parallelism, cfg.train, cfg.zero, cfg.cluster
        tp, pp = int(par.tp), int(par.pp)
        world = int(cl.nodes) * int(cl.gpus_per_node)
        dp = world // (tp * pp)
        mb = int(tr.micro_batch_size)
        engine = enum_value(par.engine)
        return cls(
            dp=dp,
            tp=tp,
            pp=pp,
            zero=int(z.stage),
            micro_batch_size=mb,
            grad_accum=max(1, int(tr.global_batch_size) // max(1, dp * mb)),
            recompute=enum_value(tr.recompute),
            sequence_parallel=bool(par.sequence_parallel),
            dtype=enum_value(cfg.precision.dtype),
            engine="" if engine == "auto" else engine,
            offload_optimizer=bool(z.offload_optimizer),
            offload_params=bool(z.offload_params),
        )


@dataclass(frozen=True)
class ClusterSpec:
    """Hardware per GPU (bytes, FLOP/s, bytes/s) and the node shape."""

    name: str
    nodes: int
    gpus_per_node: int
    memory_bytes: int = 0  # device memory per process; 0 = unknown (no memory check)
    memory_source: str = "cluster.gpu.memory_gb"  # what memory_bytes was read from
    peak_flops: float = DEFAULT_PEAK_TFLOPS * 1e12
    intra_bw: float = DEFAULT_INTRA_GBPS * 1e9  # bytes/s per GPU, one direction
    inter_bw: float = DEFAULT_INTER_GBPS * 1e9
    node_memory_bytes: int = 0  # host memory per node (cluster.mem_gb); 0 = unknown
    assumed: Tuple[str, ...] = ()  # config keys that were unknown and replaced by defaults

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def usable_bytes(self) -> int:
        return int(self.memory_bytes * (1.0 - HEADROOM))

    @property
    def peak_known(self) -> bool:
        return "cluster.gpu.peak_tflops" not in self.assumed

    @classmethod
    def from_cfg(cls, cl: Any, meminfo_path: str = "/proc/meminfo") -> "ClusterSpec":
        """From a ClusterConfig. ``cluster.gpu.memory_gb`` is read as GiB (what nvidia-smi shows:
        an "80 GB" A100 has 81920 MiB). With memory_gb = 0 on the local backend the processes share
        this host's memory: MemAvailable / gpus_per_node; on Slurm it stays unknown."""
        gpu = cl.gpu
        assumed = []
        mem_gb = float(gpu.memory_gb or 0)
        memory, source = int(mem_gb * GIB), "cluster.gpu.memory_gb"
        if mem_gb <= 0 and enum_value(cl.backend) == "local":
            avail = host_available_bytes(meminfo_path)
            if avail:
                memory = avail // max(1, int(cl.gpus_per_node))
                source = f"host MemAvailable / cluster.gpus_per_node={int(cl.gpus_per_node)} (cluster.gpu.memory_gb=0)"
        peak = float(gpu.peak_tflops or 0)
        if peak <= 0:
            peak = DEFAULT_PEAK_TFLOPS
            assumed.append("cluster.gpu.peak_tflops")
        intra = float(cl.intra_node_bandwidth or 0)
        if intra <= 0:
            intra = DEFAULT_INTRA_GBPS
            assumed.append("cluster.intra_node_bandwidth")
        inter = float(cl.inter_node_bandwidth or 0)
        if inter <= 0:
            inter = DEFAULT_INTER_GBPS
            assumed.append("cluster.inter_node_bandwidth")
        return cls(
            name=str(cl.name),
            nodes=int(cl.nodes),
            gpus_per_node=int(cl.gpus_per_node),
            memory_bytes=memory,
            memory_source=source,
            peak_flops=peak * 1e12,
            intra_bw=intra * 1e9,
            inter_bw=inter * 1e9,
            node_memory_bytes=int(float(cl.mem_gb) * GIB) if cl.mem_gb else 0,
            assumed=tuple(assumed),
        )


def host_available_bytes(path: str = "/proc/meminfo") -> Optional[int]:
    """MemAvailable of this host in bytes (None where /proc/meminfo is missing)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
