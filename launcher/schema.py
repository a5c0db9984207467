"""Structured config schema: every key, its type and its default, defined once.

Hydra validates the composed config against these dataclasses, so an unknown key or a
wrong type fails at composition time with Hydra's own message naming the key.
Nothing here imports torch: the login-node path loads this module.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Dict, List, Optional

from omegaconf import MISSING


class Dtype(str, Enum):
    fp32 = "fp32"
    fp16 = "fp16"
    bf16 = "bf16"


class Recompute(str, Enum):
    none = "none"
    selective = "selective"
    full = "full"


class Engine(str, Enum):
    auto = "auto"  # ddp, deepspeed (zero.stage > 0) or megatron (tp or pp > 1), from the layout
    ddp = "ddp"  # torch DistributedDataParallel (data parallel only)
    deepspeed = "deepspeed"  # DeepSpeed ZeRO 0-3
    megatron = "megatron"  # Megatron-style TP/PP/DP mesh


@dataclass
class ModelConfig:
    name: str = MISSING
    num_layers: int = MISSING
    hidden_size: int = MISSING
    num_heads: int = MISSING
    ffn_hidden_size: int = MISSING
    vocab_size: int = MISSING
    seq_len: int = MISSING
    dropout: float = 0.0
    tie_embeddings: bool = True


@dataclass
class ParallelConfig:
    name: str = "dp"
    engine: Engine = Engine.auto
    tp: int = 1
    pp: int = 1
    dp: Optional[int] = None  # derived as world / (tp * pp) when null
    sequence_parallel: bool = False


@dataclass
class PrecisionConfig:
    dtype: Dtype = Dtype.fp32
    # fp16 loss scaling; 0 means dynamic scaling starting at 2**initial_scale_power
    loss_scale: float = 0.0
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    min_loss_scale: float = 1.0


@dataclass
class ZeroConfig:
    stage: int = 0
    offload_optimizer: bool = False
    offload_params: bool = False


@dataclass
class GPUConfig:
    name: str = "cpu"
    memory_gb: float = 0.0  # per device; 0 = unknown (skips the memory check)
    peak_tflops: float = 0.0  # dense bf16/fp16 peak per device, for MFU


@dataclass
class ClusterConfig:
    name: str = MISSING
    backend: str = "local"  # a module of launcher/backends: local (processes here), slurm (sbatch)
    nodes: int = 1
    gpus_per_node: int = 1  # processes per node (one task per GPU; on CPU, processes)
    cpus_per_task: int = 1
    mem_gb: Optional[int] = None
    partition: Optional[str] = None
    account: Optional[str] = None
    qos: Optional[str] = None
    constraint: Optional[str] = None
    time_min: int = 60
    # true when the nodes have GPUs Slurm should allocate (--gpus-per-node)
    use_gpus: bool = False
    # shell lines run in the sbatch script before the job starts (module load, conda activate...)
    setup: List[str] = field(default_factory=list)
    # environment set for every task (NCCL_*, OMP_NUM_THREADS...)
    env: Dict[str, str] = field(default_factory=dict)
    # extra sbatch options, name -> value (e.g. {exclusive: ""}, {reservation: big})
    sbatch_extra: Dict[str, str] = field(default_factory=dict)
    array_parallelism: int = 256
    gpu: GPUConfig = field(default_factory=GPUConfig)
    intra_node_bandwidth: float = 0.0  # GB/s per GPU, one direction
    inter_node_bandwidth: float = 0.0  # GB/s per GPU, one direction


@dataclass
class OptimConfig:
    name: str = "adamw"
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 0
    weight_decay: float = 0.01
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # 0 disables clipping


@dataclass
class DataConfig:
    name: str = "synthetic"
    # successors per token in the synthetic bigram language: lower = more learnable
    branching: int = 4
    seed: Optional[int] = None  # data-order seed; null derives it from the run seed


@dataclass
class TrainConfig:
    micro_batch_size: int = 4
    global_batch_size: int = 16
    steps: int = 60
    recompute: Recompute = Recompute.none
    log_interval: int = 5
    # seconds a collective may block before the process group gives up (a hang fails the run)
    dist_timeout_s: int = 600
    # fault injection for drills and tests: raise at this step on this rank
    fail_at_step: Optional[int] = None
    fail_rank: int = 0


@dataclass
class RecipeConfig:
    # dotted path of the training function: fn(cfg, ctx) -> summary dict
    _target_: str = "recipes.gpt.train.main"


@dataclass
class WandbConfig:
    # rank 0 logs every step's metrics to wandb too; offline (files in the run dir) needs no network
    enabled: bool = True
    mode: str = "offline"
    project: str = "launcher"


@dataclass
class SubmitConfig:
    # null: wait for local runs (shows progress), return at once for Slurm
    wait: Optional[bool] = None
    dry_run: bool = False
    force: bool = False  # launch despite warnings (never despite errors)
    runs_root: str = "${oc.env:LAUNCHER_RUNS,runs}"
    job_name: str = "${name}"
    # seconds to wait for a local run before giving up on it (0 = forever)
    wait_timeout_s: int = 0


@dataclass
class RunConfig:
    name: str = "${model.name}"
    seed: int = 1234
    tags: List[str] = field(default_factory=list)
    model: ModelConfig = field(default_factory=ModelConfig)
    parallelism: ParallelConfig = field(default_factory=ParallelConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    recipe: RecipeConfig = field(default_factory=RecipeConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    submit: SubmitConfig = field(default_factory=SubmitConfig)


def register_configs() -> None:
    """Register the schema with Hydra's ConfigStore (config.yaml lists it first)."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="base_config", node=RunConfig)
    cs.store(
        group="hydra/launcher",
        name="launcher",
        node={"_target_": "hydra_plugins.launcher_plugin.plugin.LauncherPlugin"},
    )


def typed(cfg: Any):
    """Merge a plain (e.g. loaded from YAML) config onto the schema so types are enforced."""
    from omegaconf import OmegaConf

    base = OmegaConf.structured(RunConfig)
    return OmegaConf.merge(base, cfg)


def enum_value(x: Any) -> str:
    """An Enum member or a plain string -> the string (configs loaded untyped hold strings)."""
    return str(getattr(x, "value", x))
