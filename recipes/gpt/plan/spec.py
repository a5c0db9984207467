"""The planner's inputs as plain frozen dataclasses: a layout choice and the cluster's hardware.

``LayoutSpec`` is ``launcher.config.layout.Layout`` plus recompute and dtype: the planner estimates the
same layout object a launch archives, and which layouts are valid is launcher.config.rules' table.

Built once from a composed run config (``from_cfg``), then every estimator works on these: the
search evaluates thousands of layouts per second without touching OmegaConf.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Dict, Optional, Tuple

from launcher import backends
from launcher.config.layout import Facts, Layout
from launcher.config.rules import layout_of
from launcher.config.schema import enum_value

if TYPE_CHECKING:
    from recipes.gpt.schema import GPTRunConfig

GIB = 1 << 30
HEADROOM = 0.10  # of the device memory, kept free for the CUDA context, NCCL and fragmentation

# Used where the cluster config leaves hardware unknown (0), so a search on cluster=local still ranks;
# every estimate made with them lists the keys in ``ClusterSpec.assumed``.
DEFAULT_PEAK_TFLOPS = 100.0
DEFAULT_INTRA_GBPS = 100.0
DEFAULT_INTER_GBPS = 10.0


@dataclass(frozen=True)
class LayoutSpec(Layout):
    """A ``launcher.config.layout.Layout`` (degrees, ZeRO, batch split, engine, offload, node shape) plus what
    the estimators read beyond it: activation recomputation and the training precision."""

    recompute: str = "none"
    dtype: str = "bf16"

    @classmethod
    def of(cls, layout: Layout, recompute: str = "none", dtype: str = "bf16") -> LayoutSpec:
        """``layout`` (any Layout) with the planner's recompute and dtype."""
        own = vars(layout) if type(layout) is Layout else {name: getattr(layout, name) for name in _LAYOUT_FIELDS}
        return cls(**own, recompute=recompute, dtype=dtype)

    @classmethod
    def from_cfg(cls, cfg: GPTRunConfig) -> LayoutSpec:
        """The layout a run config names (``launcher.config.rules.layout_of``: ``parallelism.engine=auto`` becomes the
        implied engine), with its ``train.recompute`` and ``precision.dtype``. Raises
        ``launcher.config.errors.ConfigErrors`` when the config names no whole layout (see ``buildable``)."""
        f = Facts.from_cfg(cfg)
        return cls.of(layout_of(f), enum_value(cfg.train.recompute), f.dtype)


_LAYOUT_FIELDS = tuple(f.name for f in fields(Layout))


@dataclass(frozen=True)
class Calibration:
    """The planner's correction for one cluster, fitted from measured runs (``cluster.calibration``,
    launcher/config/schema.py CalibrationConfig; recipes/gpt/plan/calibrate.py fits it). The defaults change
    nothing: predicted step time = compute_scale x compute + comm_scale x communication + offload
    + step_overhead_s, activation bytes x activation_scale."""

    compute_scale: float = 1.0
    comm_scale: float = 1.0
    step_overhead_s: float = 0.0
    activation_scale: float = 1.0

    @property
    def is_default(self) -> bool:
        return self == Calibration()

    @classmethod
    def from_cfg(cls, node: Any) -> Calibration:
        """From a ``cluster.calibration`` node (None, or a config without one: the defaults)."""
        if node is None:
            return cls()
        get = node.get if hasattr(node, "get") else lambda k, d=None: getattr(node, k, d)
        out = {}
        for f in fields(cls):
            v = get(f.name, None)
            if v is not None:
                out[f.name] = float(v)
        return cls(**out)

    def as_dict(self) -> Dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


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
    calibration: Calibration = Calibration()  # cluster.calibration: applied by every estimate

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
    def from_cfg(cls, cl: Any, meminfo_path: str = "/proc/meminfo") -> ClusterSpec:
        """From a ClusterConfig. ``cluster.gpu.memory_gb`` is read as GiB (what nvidia-smi shows:
        an "80 GB" A100 has 81920 MiB). With memory_gb = 0 on a backend whose processes share this
        host's memory (``Backend.shares_host_memory``: local) each gets MemAvailable / gpus_per_node;
        elsewhere (Slurm) it stays unknown."""
        gpu = cl.gpu
        assumed = []
        mem_gb = float(gpu.memory_gb or 0)
        memory, source = int(mem_gb * GIB), "cluster.gpu.memory_gb"
        if mem_gb <= 0 and backends.get(enum_value(cl.backend)).shares_host_memory:
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
            calibration=Calibration.from_cfg(_get(cl, "calibration")),
        )


def _get(node: Any, key: str) -> Any:
    """``node.key``, None where the node has no such key (a config archived before the key existed)."""
    try:
        return node.get(key) if hasattr(node, "get") else getattr(node, key, None)
    except Exception:  # OmegaConf struct mode refusing an unknown key
        return None


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
