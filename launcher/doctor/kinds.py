"""The doctor's classes of failure (KINDS, NOT_FAILED), each one's fix (FIXES), and the Diagnosis
``launcher.doctor.diagnose`` returns (docs/doctor.md)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional

KINDS = ("oom_startup", "oom_step", "disk_full", "hang", "collective_timeout", "rendezvous", "killed_rank",
         "node_fault", "node_failure", "preempted", "time_limit", "exception", "cancelled", "completed", "running",
         "pending", "unknown")
# kinds that are not a failure: nothing to diagnose
NOT_FAILED = ("completed", "running", "pending")

FIXES: Dict[str, str] = {
    "oom_startup": (
        "Model states (parameters, gradients, optimizer state: ~16 bytes per parameter with mixed-precision "
        "Adam) do not fit; a smaller batch will not help. Change the layout: shard them (zero=1|2|3, a higher "
        "ZeRO stage), offload to CPU (zero.offload_optimizer=true, zero.offload_params=true with zero=3), "
        "split the model (parallelism.tp / parallelism.pp) or add GPUs; `launcher plan --search <overrides>` "
        "ranks the layouts that fit."),
    "oom_step": (
        "Activations of the step do not fit (they grow with micro batch x sequence length x layers): lower "
        "train.micro_batch_size (train.global_batch_size is kept: gradient accumulation grows), recompute "
        "activations (train.recompute=selective, or full: ~30-40% more forward compute), use sequence "
        "parallelism with tensor parallelism (parallelism.tp>1 parallelism.sequence_parallel=true), or a "
        "shorter model.seq_len; `launcher plan <overrides>` shows the activation memory per layout."),
    "disk_full": (
        "A file system the run writes to is full (or its quota used up): a checkpoint, a log or a record "
        "could not be written. Free space where the runs root lies (`df -h RUNS_ROOT`; old runs' checkpoints: "
        "train.checkpoint.keep keeps the last N), or point submit.runs_root at a larger file system; then "
        "`launcher resume RUN` continues from the last checkpoint that was written whole (each is verified)."),
    "hang": (
        "Read the stacks (stacks/ in the run dir): the stuck rank's frame is the cause, the other ranks wait "
        "for it in a collective. Re-run with cluster.env.NCCL_DEBUG=INFO to see the collective and the "
        "peers; if a step (first step, checkpoint save, evaluation) is legitimately slower than "
        "train.hang_timeout_s, raise train.hang_timeout_s (a start-up slower than train.startup_timeout_s: "
        "raise that, or call ctx.progress() as it moves)."),
    "collective_timeout": (
        "A collective waited longer than train.dist_timeout_s for a peer: read the named rank's log "
        "(`launcher logs RUN --rank R --err`) for what it was doing; re-run with cluster.env.NCCL_DEBUG=INFO "
        "and check the interconnect (NCCL_SOCKET_IFNAME, NCCL_IB_*); set train.hang_timeout_s to get every "
        "rank's stack next time; raise train.dist_timeout_s only if the collective is legitimately slow."),
    "rendezvous": (
        "The ranks could not meet at MASTER_ADDR:MASTER_PORT. Port in use: choose a free one "
        "(cluster.master_port=<port>, or null to derive it from the job id). Connection refused or timed "
        "out: check that MASTER_ADDR resolves and is reachable from every node and the port is open "
        "(`nc -vz ADDR PORT`; firewall, security group)."),
    "killed_rank": (
        "A rank was killed by a signal (SIGKILL: the kernel's out-of-memory killer, the scheduler, a user or a "
        "node problem); its peers only saw the connection drop. Check the node's kernel log "
        "(`dmesg | grep -i -e oom -e killed`) and the rank's log; with checkpoints "
        "(train.checkpoint.every) and train.max_restarts > 0 the run restarts by itself."),
    "node_fault": (
        "A GPU or its link failed on the rank's node (an ECC error, a device lost, an NCCL system error), or "
        "it ran out of memory that other processes held (another job's, a zombie of an earlier one: "
        "`nvidia-smi` on the node shows them): the node's fault, not the program's. The node ledger records "
        "it (`launcher nodes`): a requeue leaves "
        "the node out, and a node with cluster.health.exclude_after such events is left out of every later "
        "submission until cluster.health.expire_h (or `launcher nodes --clear NODE`); report it to the "
        "cluster admins. The same error on another node is the program's: fix it at the frame shown."),
    "node_failure": (
        "A node failed (scheduler NODE_FAIL): nothing in the run caused it. Resume from the last checkpoint "
        "(`launcher resume RUN`, or train.max_restarts > 0 with train.checkpoint.every), keep the node out "
        "(cluster.sbatch_extra.exclude=<node>) and report it to the cluster admins."),
    "preempted": (
        "The scheduler preempted the job for a higher-priority one. The run saves a checkpoint on SIGTERM and "
        "restarts when requeued (train.max_restarts > 0); for a run that must not be interrupted use a "
        "non-preemptible cluster.qos / cluster.partition, or `launcher resume RUN`."),
    "time_limit": (
        "The job reached its time limit (cluster.time_min). Raise cluster.time_min, or keep checkpoints "
        "(train.checkpoint.every) and train.max_restarts > 0 so the run saves at the USR2 signal "
        "(cluster.signal_delay_s before the limit) and requeues; `launcher resume RUN` continues it."),
    "exception": (
        "A Python exception in the code: fix it at the frame shown (`launcher logs RUN --rank R --err` has the "
        "whole log); `launcher reproduce RUN` re-runs the same config, code and seeds."),
    "cancelled": "Cancelled by a user or the scheduler (launcher cancel, scancel): nothing to fix.",
    "completed": "Nothing to fix.",
    "running": "Nothing to fix yet: the run is running.",
    "pending": "Nothing to fix yet: the run is waiting to (re)start.",
    "unknown": (
        "No recognisable cause was recorded: read every rank's log (`launcher logs RUN --rank N --err`), the "
        "scheduler's record of the job (sacct -j JOB) and the node's kernel log (dmesg)."),
}


@dataclass
class Diagnosis:
    kind: str
    summary: str
    rank: Optional[int] = None
    detail: List[str] = field(default_factory=list)  # the evidence, one line each
    fix: str = ""

    def to_json(self) -> Dict[str, Any]:
        return asdict(self)
