"""The config's sections: every key, its type and its default (and a numeric key's bounds), defined once.

Dataclasses Hydra validates the composed config against (``RunConfig`` and its groups), and the
enums their keys take. Queries over them (the keys as leaves, a recipe's run schema, registering
with Hydra, typing a plain config) are launcher.config.schema's, which re-exports every name here;
import them from there (it also registers the resolvers the defaults name, e.g. ``recipe_run_name``).
Nothing here imports torch: the login-node path loads this module.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Dict, List, Optional

from omegaconf import MISSING

from launcher.config.bounds import INT64_MAX, num


class Dtype(str, Enum):
    fp32 = "fp32"
    fp16 = "fp16"
    bf16 = "bf16"


class ReduceDtype(str, Enum):
    fp32 = "fp32"
    bf16 = "bf16"


class Recompute(str, Enum):
    none = "none"
    selective = "selective"
    full = "full"


class WandbMode(str, Enum):
    online = "online"
    offline = "offline"  # files in the run dir, no network
    disabled = "disabled"

    def __str__(self) -> str:  # str(mode) is what wandb.init(mode=...) and WANDB_MODE take
        return self.value


class FailMode(str, Enum):
    """What an injected fault does (train.fail_mode), for drills and tests."""

    exception = "exception"  # raise RuntimeError in the step
    sleep = "sleep"  # sleep forever inside the step (a hang)
    kill = "kill"  # SIGKILL this rank mid-step (a lost process or node)
    kill_in_save = "kill_in_save"  # SIGKILL this rank while it writes the step's checkpoint
    oom = "oom"  # allocate until the memory limit raises (out of memory during the step)
    stop = "stop"  # SIGSTOP this rank mid-step (a wedged GPU or node: its sockets stay open, nothing exits)
    config_error = "config_error"  # raise a ConfigError (a failure no restart fixes)
    # stop after the step as a time-limit signal stops a run (checkpoint, stop, requeue, resume): every
    # rank decides it from the config, so all stop after the same step (launcher verify-resume's interruption)
    requeue = "requeue"
    # raise a CUDA-shaped error (an uncorrectable ECC error): the node's fault, not the program's; the node
    # ledger records the node and the requeue leaves it out (launcher.features.nodes)
    cuda_error = "cuda_error"
    # run out of GPU memory that other processes hold (torch's OutOfMemoryError as CUDA words it: another
    # job's process, a zombie of an earlier one): the node's fault too, recorded and left out alike
    gpu_held = "gpu_held"
    # from its step on, every step of this rank takes SLOW_S longer (a slow node: a throttled GPU, a bad
    # link); the straggler watch names it (cluster.health.straggler_ratio)
    slow = "slow"


SLOW_S = 0.25  # what FailMode.slow adds to each step of its rank


class FailPeers(str, Enum):
    """What the ranks the fault did not hit do when their collective fails (train.fail_peers)."""

    error = "error"  # the collective raises in Python (gloo; NCCL with TORCH_NCCL_ASYNC_ERROR_HANDLING=2)
    abort = "abort"  # the process aborts, no Python handler runs (NCCL's watchdog teardown)


class Engine(str, Enum):
    auto = "auto"  # ddp, deepspeed (zero.stage > 0) or megatron (tp or pp > 1), from the layout
    ddp = "ddp"  # torch DistributedDataParallel (data parallel only)
    deepspeed = "deepspeed"  # DeepSpeed ZeRO 0-3
    fsdp = "fsdp"  # torch FSDP2 (fully_shard per block; launcher.training.engines): parallelism=fsdp
    megatron = "megatron"  # Megatron-style TP/PP/DP mesh


@dataclass
class ParallelConfig:
    name: str = "dp"
    engine: Engine = Engine.auto
    tp: int = num(1, ge=1)
    pp: int = num(1, ge=1)
    dp: Optional[int] = num(None, ge=1, fix="set parallelism.dp=null to derive it")  # world / (tp * pp) when null
    sequence_parallel: bool = False
    # fsdp engine: free each block's gathered parameters after its forward (gathered again for the
    # backward); false keeps them until the backward (more memory, one all-gather less per block)
    reshard_after_forward: bool = True
    # fsdp engine: parameters, gradients and optimizer state in host memory (torch's CPUOffloadPolicy)
    cpu_offload: bool = False


@dataclass
class PrecisionConfig:
    dtype: Dtype = Dtype.fp32
    # on GPUs, fp32 matmuls and convolutions in TF32 (Ampere and later: ~8x the fp32 rate, 10-bit
    # mantissa); false for exact fp32
    tf32: bool = True
    # fp16 loss scaling; 0 means dynamic scaling starting at 2**initial_scale_power
    loss_scale: float = num(0.0, ge=0.0, why="(0 means dynamic scaling; a negative scale is not a way to ask for it)",
                            fix="set precision.loss_scale=0 for dynamic scaling, or a positive static scale")
    initial_scale_power: int = num(16, ge=0, le=40, why="(2**40 is already far beyond fp16's range, max 65504)")
    loss_scale_window: int = num(1000, ge=1)
    hysteresis: int = num(2, ge=1)
    min_loss_scale: float = num(1.0, gt=0.0)
    # the dtype data-parallel gradients are reduced in (DDP, the megatron engine's buckets, FSDP2,
    # DeepSpeed): fp32, the exact mean (as Megatron-LM and torchtitan under bf16); bf16 halves the
    # bytes on the wire at ~3 significant digits per sum (docs/performance.md)
    grad_reduce_dtype: ReduceDtype = ReduceDtype.fp32


@dataclass
class ZeroConfig:
    stage: int = num(0, ge=0, le=3, fix="choose zero=0..3")
    offload_optimizer: bool = False
    offload_params: bool = False


@dataclass
class GPUConfig:
    name: str = "cpu"
    memory_gb: float = num(0.0, ge=0.0)  # per device; 0 = unknown (skips the memory check)
    peak_tflops: float = num(0.0, ge=0.0)  # dense bf16/fp16 peak per device, for MFU; 0 = unknown


@dataclass
class CalibrationConfig:
    """The planner's calibration for this cluster (``launcher plan --calibrate RUN...`` fits it from
    measured runs and writes it into the cluster's YAML; docs/calibration.md). Every estimate made for
    the cluster applies it: step time = compute_scale x compute + comm_scale x communication (tp, pp,
    exposed dp) + offload + step_overhead_s; activation bytes x activation_scale. The defaults change
    nothing."""

    compute_scale: float = num(1.0, gt=0.0, why="(it multiplies the predicted compute time)")
    comm_scale: float = num(1.0, ge=0.0)
    step_overhead_s: float = num(0.0, ge=0.0)  # seconds added to every step
    activation_scale: float = num(1.0, gt=0.0, why="(it multiplies the predicted activation bytes)")
    runs: List[str] = field(default_factory=list)  # the run ids it was fitted on
    fitted_at: Optional[str] = None  # when (ISO 8601)


@dataclass
class ElasticConfig:
    """cluster.elastic (Slurm; docs/fault-tolerance.md "Keep going when a node is lost"): a run whose job
    ends for a lost node (NODE_FAIL) or a preemption that cancels, with no requeue to bring it back, goes
    on from its latest checkpoint on the nodes it can have now, with the best layout for them (the same
    global batch, more accumulation); it grows back at a later checkpoint when nodes return. A one-node
    job the run queues for itself (--dependency=afternotok) decides: nothing runs on the login node."""

    enabled: bool = False  # off: a lost node ends the run (or Slurm requeues it for the full node count)
    min_nodes: int = num(1, ge=1)  # fewer usable nodes than this: the run ends as it does when off
    grow: bool = True  # shrunk, grow back to target_nodes at a checkpoint once enough nodes are idle
    # the node count to grow back to; null: cluster.nodes as launched (a shrink records it here)
    target_nodes: Optional[int] = num(None, ge=1)


@dataclass
class HealthConfig:
    """cluster.health (docs/fault-tolerance.md "Bad and slow nodes"): a ledger of what jobs saw of each
    node (a CUDA or NCCL error raised on it, a rank on it that died without a word, the rank a hang
    waited for); a node with ``exclude_after`` events within ``window_h`` is left out of every later
    submission (sbatch --exclude) until ``expire_h`` after its last event or `launcher nodes --clear`;
    a job requeued after a failure attributed to a node leaves that node out at once."""

    enabled: bool = True
    # the ledger's directory; null: <submit.runs_root>/nodes (a team shares one by naming the same dir)
    ledger: Optional[str] = None
    exclude_after: int = num(2, ge=1)
    window_h: float = num(24.0, gt=0.0)
    expire_h: float = num(24.0, gt=0.0)
    # stragglers, from each rank's own step timings (they ride on the step's own all-reduce): a rank whose
    # own time (its step less its waits for the others) or data time stays this many times the other
    # ranks' median (the median of its ratios over straggler_window steps) is named, with its node, in
    # the log and the ledger; 0: off
    straggler_ratio: float = num(1.5, ge=0.0, fix="set cluster.health.straggler_ratio to 0 (off) or a ratio "
                                 "above 1, e.g. 1.5")
    # past this ratio the run saves, and its job is requeued without that node (within
    # train.max_restarts); 0: named only
    straggler_requeue_ratio: float = num(3.0, ge=0.0)
    straggler_window: int = num(20, ge=2)


@dataclass
class ClusterConfig:
    name: str = MISSING
    backend: str = "local"  # launcher.backends: local (processes here), slurm (sbatch), or a registered one
    nodes: int = num(1, ge=1)
    gpus_per_node: int = num(1, ge=1)  # processes per node (one task per GPU; on CPU, processes)
    cpus_per_task: int = num(1, ge=1)
    # CPUs of one node; set, gpus_per_node x cpus_per_task must fit in it (a rule)
    cpus_per_node: Optional[int] = num(None, ge=1, fix="set cluster.cpus_per_node to the node's core count, or null")
    # memory per node in GB (sbatch --mem); 0: all of each node's memory (--mem=0); null: the partition's default
    mem_gb: Optional[int] = num(None, ge=0, fix="set cluster.mem_gb to the GB each node gives the job, 0 for all of "
                                "each node's memory, or null for the partition's default")
    partition: Optional[str] = None
    account: Optional[str] = None
    qos: Optional[str] = None
    constraint: Optional[str] = None
    time_min: int = num(60, ge=1)
    # Slurm (and the local backend) signal USR2 this many seconds before the time limit: the run
    # saves a checkpoint at the next step boundary and requeues
    signal_delay_s: int = num(120, ge=0)
    # rendezvous port; null: derived from the job id (two jobs sharing a node never collide)
    master_port: Optional[int] = num(None, ge=1024, le=65535)
    # true when the nodes have GPUs Slurm should allocate (--gpus-per-node)
    use_gpus: bool = False
    # shell lines run in the sbatch script before the job starts (module load, conda activate...)
    setup: List[str] = field(default_factory=list)
    # environment set for every task (NCCL_*, OMP_NUM_THREADS...)
    env: Dict[str, str] = field(default_factory=dict)
    # sbatch --exclusive: the job's nodes run no other job (all their CPUs, memory and NICs)
    exclusive: bool = False
    # extra sbatch options, name -> value (e.g. {reservation: big}); true: a bare flag (e.g. {no-requeue: true})
    sbatch_extra: Dict[str, str] = field(default_factory=dict)
    array_parallelism: int = num(256, ge=1)
    # the most tasks one Slurm array may hold / jobs one user may have queued; null: read from
    # `scontrol show config` (MaxArraySize, MaxSubmitJobs) when submitting
    max_array_size: Optional[int] = num(None, ge=1)
    max_submit_jobs: Optional[int] = num(None, ge=1)
    # Slurm: the points of a sweep group go out as ONE job of cluster.pack_nodes nodes whose runner
    # starts each point as a job step (srun --exact), several per node when they fit, backfilling as
    # points end (launcher.features.pack.runner; docs/sweeps.md "Packing small points")
    pack: bool = False
    # the pack's nodes; null: min(points x cluster.nodes, PACK_NODES_DEFAULT)
    pack_nodes: Optional[int] = num(None, ge=1)
    gpu: GPUConfig = field(default_factory=GPUConfig)
    intra_node_bandwidth: float = num(0.0, ge=0.0)  # GB/s per GPU, one direction; 0 = unknown
    inter_node_bandwidth: float = num(0.0, ge=0.0)  # GB/s per GPU, one direction; 0 = unknown
    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)
    elastic: ElasticConfig = field(default_factory=ElasticConfig)
    health: HealthConfig = field(default_factory=HealthConfig)


@dataclass
class OptimConfig:
    name: str = "adamw"
    lr: float = num(1e-3, gt=0.0, fix="set optim.lr to e.g. 3e-4")
    min_lr_ratio: float = num(0.1, ge=0.0, le=1.0)
    # null: min(DEFAULT_WARMUP_STEPS, train.steps) (see warmup_steps()); set: <= train.steps (a rule)
    warmup_steps: Optional[int] = num(None, ge=0)
    weight_decay: float = num(0.01, ge=0.0)
    beta1: float = num(0.9, ge=0.0, lt=1.0)
    beta2: float = num(0.95, ge=0.0, lt=1.0)
    eps: float = num(1e-8, gt=0.0)
    grad_clip: float = num(1.0, ge=0.0)  # 0 disables clipping


@dataclass
class BlendSource:
    """One dataset of a blend: a prepared dataset directory and its share of the samples."""

    path: str = MISSING
    weight: float = 1.0  # relative: the weights are normalised over the blend (launch checks them > 0)


@dataclass
class DataConfig:
    name: str = "synthetic"
    # successors per token in the synthetic bigram language: lower = more learnable
    branching: int = num(4, ge=1)  # a recipe may bound it further (its contract's rules)
    # data-order seed; null derives it from the run seed
    seed: Optional[int] = num(None, ge=0, le=INT64_MAX, why="(numpy and torch seeds must be 0 <= seed < 2**63)")
    # data=tokens: a dataset directory `launcher data prepare` made (launcher/data/tokens.py reads it)
    path: Optional[str] = None
    # data=tokens: several prepared datasets sampled by weight; non-empty replaces `path`
    blend: List[BlendSource] = field(default_factory=list)
    # data=tokens: true = a split's documents as one stream cut into seq_len+1 windows; false = one
    # document per sample (shorter ones skipped, longer ones truncated)
    packing: bool = True
    eval_every: int = num(0, ge=0)  # steps between evaluations on the val split (0: off; always at the end when > 0)
    eval_batches: int = num(1, ge=1)  # global batches per evaluation, the same val samples every time
    # each rank writes the (dataset, epoch, window) of every sample it loads to samples/rank_<r>.jsonl
    log_samples: bool = False


@dataclass
class CheckpointConfig:
    # save every N steps (0: only at the end and when the job is signalled or requeued)
    every: int = num(0, ge=0)
    keep: int = num(2, ge=1)  # complete checkpoints kept (the oldest are deleted)
    # write in a background thread (ddp, megatron engines); the step loop only waits for the copy
    async_save: bool = True
    # also write universal/ (torch.distributed.checkpoint, each rank its own slices): lets `launcher resume RUN`
    # change dp, tp, pp, ZeRO stage, engine (ddp, fsdp, megatron, deepspeed ZeRO 1-3) or node count
    # (docs/fault-tolerance.md)
    universal: bool = True


@dataclass
class FaultConfig:
    """One more injected fault (train.faults): train.fail_*'s keys, on an attempt of its own."""

    at_step: int = num(1, ge=1)  # <= train.steps
    rank: int = num(0, ge=0)
    mode: FailMode = FailMode.exception
    attempt: Optional[int] = num(None, ge=1)  # null: every attempt
    node: Optional[str] = None  # null: wherever the rank runs; set: only where it runs on this node


@dataclass
class TrainConfig:
    micro_batch_size: int = num(4, ge=1)
    global_batch_size: int = num(16, ge=1)
    steps: int = num(60, ge=1)
    recompute: Recompute = Recompute.none
    log_interval: int = num(5, ge=0)  # 0 = no progress lines
    # seconds a collective may block before the process group gives up (a hang fails the run)
    dist_timeout_s: int = num(600, ge=1)
    # deterministic kernels (torch.use_deterministic_algorithms, cuBLAS's fixed workspace, cuDNN's
    # deterministic algorithms, no flash-attention backward): a rerun or a resume bitwise equal on a GPU,
    # at some speed; off: the fastest kernels, some of which sum in an order that varies run to run
    deterministic: bool = False
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    # restarts (requeues after a failure, hang, preemption or time limit) before the run is failed
    max_restarts: int = num(3, ge=0)
    # no step finished on a rank for this long: dump every rank's stack and requeue (0: off; null: off
    # on one node, on several nodes half of train.dist_timeout_s up to 300 s: hang_timeout_s())
    hang_timeout_s: Optional[int] = num(None, ge=0)
    # no start-up progress on a rank for this long before its first step (the process group, a first
    # collective, the resume): dump every rank's stack and requeue, as a hang (0: off; null: off on one
    # node, on several nodes train.dist_timeout_s: startup_timeout_s())
    startup_timeout_s: Optional[int] = num(None, ge=0)
    # fault injection for drills and tests: at this step (<= train.steps), on this rank, do fail_mode
    fail_at_step: Optional[int] = num(None, ge=1)
    fail_rank: int = num(0, ge=0)
    fail_mode: FailMode = FailMode.exception
    # what the other ranks do when their collective fails: error (raise in Python, gloo's way) or abort
    # the process at once, no Python handler run (ProcessGroupNCCL's teardown)
    fail_peers: FailPeers = FailPeers.error
    # the attempt (1 = first start, 2 = first restart, ...) the fault fires on; null: every attempt
    fail_attempt: Optional[int] = num(None, ge=1)
    # more faults, each with the keys above ('train.faults=[{at_step: 5, rank: 1, mode: stop, attempt: 1}]'):
    # a drill that holds a run on each of several attempts (launcher.config.faults)
    faults: List[FaultConfig] = field(default_factory=list)


@dataclass
class RecipeConfig:
    # dotted path of the training function: fn(cfg, ctx) -> summary dict (the default recipe group,
    # conf/config.yaml, names the shipped one)
    _target_: str = MISSING
    # the recipe's own settings (message sizes, iterations, ...), read by the recipe; any keys
    # (`launch recipe.params.max_bytes=1048576`); its contract's ``check`` may check them
    params: Dict[str, Any] = field(default_factory=dict)
    # recipe=script (docs/scripts.md): a torchrun-style script, unchanged; one of script (its path from
    # the launch dir) or module (`python -m`), with its command-line args, and the args added from the
    # second attempt on (the script resumes: e.g. [--init_from=resume])
    script: Optional[str] = None
    module: Optional[str] = None
    args: List[str] = field(default_factory=list)
    resume_args: List[str] = field(default_factory=list)


@dataclass
class WandbConfig:
    # rank 0 logs every step's metrics to wandb too; offline (files in the run dir) needs no network
    enabled: bool = True
    mode: WandbMode = WandbMode.offline
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
    wait_timeout_s: int = num(0, ge=0)
    # what a sweeper that needs results (Optuna, ...) gets back from each run: a key of the run's
    # summary (final_loss, mean_tokens_per_s, ...)
    objective: str = "final_loss"
    # the most points one launch sweeps: a larger grid is refused from its overrides alone, in a second,
    # before a point is composed (a typo such as range(0,1000000) would otherwise compose for minutes)
    max_points: int = num(100_000, ge=1, fix="launch fewer points, or raise submit.max_points knowingly")
    # a sweep past the scheduler's room (MaxJobCount, the user's MaxSubmitJobs) queued in waves by its own
    # jobs as room appears (launcher.submit.waves); false: such a sweep is refused, nothing queued
    waves: bool = True


class SweepScheduler(str, Enum):
    asha = "asha"
    pbt = "pbt"


class SweepMode(str, Enum):
    min = "min"
    max = "max"


@dataclass
class SweepConfig:
    """The sweep's scheduler (``sweep=asha``: conf/sweep/asha.yaml; ``sweep=pbt``: conf/sweep/pbt.yaml;
    none: every point runs train.steps).
    Successive halving (launcher/features/asha/schedule.py): at each rung (a step) the points still alive report
    ``objective`` (a key of their metrics rows); the best 1/``reduction`` of them go on, the rest are
    pruned (docs/sweeps.md, "Successive halving")."""

    scheduler: Optional[SweepScheduler] = None
    rungs: List[int] = field(default_factory=list)  # steps, increasing, each <= train.steps
    reduction: int = num(3, ge=2, fix="set sweep.reduction to 2 or more (3 keeps a third at each rung)")
    objective: str = "loss"  # the metrics row key the rungs compare
    mode: SweepMode = SweepMode.min  # min: lower is better
    # false: a rung is decided once every point that entered it reported or ended (synchronous);
    # true: a point goes on as soon as it is in the top 1/reduction of >= reduction reports there
    asynchronous: bool = False
    # sweep=pbt (conf/sweep/pbt.yaml, launcher/features/pbt/generations.py): every ``interval`` steps the
    # bottom ``quantile`` of the members copy a top member's checkpoint and train on with its ``explore`` keys' values,
    # each times one of ``factors``; the choices seeded by ``seed`` (None: the run's seed)
    interval: int = num(0, ge=0, fix="set sweep.interval to the steps between exploits (e.g. 2)")
    quantile: float = num(0.25, gt=0, le=0.5, fix="set sweep.quantile in (0, 0.5] (e.g. 0.25)")
    explore: List[str] = field(default_factory=list)
    factors: List[float] = field(default_factory=lambda: [0.8, 1.25])
    seed: Optional[int] = num(None, ge=0, le=INT64_MAX, why="(a seed of Python's random: 0 <= seed < 2**63)")
    replay: Optional[str] = None  # a PBT sweep dir whose recorded decisions are followed (launcher reproduce)


@dataclass
class RunConfig:
    # the recipe's contract names the run (after its model, its own name, or its package)
    name: str = "${recipe_run_name:${recipe._target_},${oc.select:model.name,''}}"
    seed: int = num(1234, ge=0, le=INT64_MAX, why="(numpy and torch seeds must be 0 <= seed < 2**63)")
    tags: List[str] = field(default_factory=list)
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
    sweep: SweepConfig = field(default_factory=SweepConfig)

