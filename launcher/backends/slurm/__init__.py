"""Slurm through submitit's SlurmExecutor: one task per GPU, one array job per sweep group.

Values reach the sbatch script only through submitit's flag writer, which shell-quotes each one;
environment lines are quoted here with shlex.quote. ``cluster.setup`` lines are the user's own shell,
verbatim, except that a secret literal in one reads the variable that carries it (setup_lines). Job
states come from sacct (accounting), and from squeue for jobs sacct has not listed yet.
"""
from __future__ import annotations

import launcher.backends.slurm.limits as limits
from launcher.backends.base import PACK_STEP_ENV, Backend
from launcher.backends.slurm.jobs import SlurmJobs
from launcher.backends.slurm.limits import (
    ASSOC_FORMAT,
    CAPACITY_TTL_S,
    JOB_NAME_MAX,
    QOS_FORMAT,
    QUEUE_FORMAT,
    Association,
    NodeSize,
    QueuedJob,
    accounting_limits,
    association_of,
    associations_from_sacctmgr,
    capacity_problems,
    cluster_nodes,
    gres_gpus,
    job_ending_of,
    nodes_from_sinfo,
    partition_qos_from_scontrol,
    qos_limits_from_sacctmgr,
    qos_of,
    queued_from_squeue,
    run,
    submit_bounds,
)
from launcher.backends.slurm.node import SlurmNode
from launcher.backends.slurm.submitting import SlurmSubmission
from launcher.backends.slurm.text import (
    ELASTIC_MODULE,
    ELASTIC_TIME_MIN,
    REQUEUE_NOTE_ENV,
    SCOPE_ENV,
    SEAL_MODULE,
    SEAL_TIME_MIN,
    SHARED_FS,
    STATES,
    STEP_DROPPED,
    WAVES_MODULE,
    WAVES_TIME_MIN,
    after_job_command,
    alias_addr,
    code_lines,
    cpu_lines,
    cpus_per_node,
    enforces_limits,
    env_lines,
    fs_type,
    hostnames,
    job_scope,
    limits_from_config,
    max_submit_from_sacctmgr,
    node_states_from_sinfo,
    own_addresses,
    parse_states,
    requeue_lines,
    seal_job_command,
    setup_lines,
    state_of,
    submit_environment,
    unshared_runs_root,
    with_array_tasks,
)
from launcher.sweeps import ArrayLimits

# what other modules read of this backend (its parts: text, limits, submission, jobs, node)
__all__ = [
    "ASSOC_FORMAT", "ArrayLimits", "Association", "BACKEND", "CAPACITY_TTL_S", "ELASTIC_MODULE",
    "ELASTIC_TIME_MIN", "JOB_NAME_MAX", "NodeSize", "PACK_STEP_ENV", "QOS_FORMAT", "QUEUE_FORMAT", "QueuedJob",
    "REQUEUE_NOTE_ENV", "SCOPE_ENV", "SEAL_MODULE", "SEAL_TIME_MIN", "SHARED_FS", "STATES", "STEP_DROPPED",
    "WAVES_MODULE", "WAVES_TIME_MIN",
    "SlurmBackend", "accounting_limits", "after_job_command", "alias_addr", "association_of",
    "associations_from_sacctmgr", "capacity_problems", "cluster_nodes", "code_lines", "cpu_lines",
    "cpus_per_node", "enforces_limits", "env_lines", "fs_type", "gres_gpus", "hostnames", "job_ending_of",
    "job_scope", "limits", "limits_from_config", "max_submit_from_sacctmgr", "node_states_from_sinfo",
    "nodes_from_sinfo", "own_addresses", "parse_states", "with_array_tasks", "partition_qos_from_scontrol",
    "qos_limits_from_sacctmgr", "qos_of", "queued_from_squeue", "requeue_lines", "run", "seal_job_command",
    "setup_lines", "state_of", "submit_bounds", "submit_environment", "unshared_runs_root"
]


class SlurmBackend(SlurmSubmission, SlurmJobs, SlurmNode, Backend):
    name = "slurm"
    waits = False
    packs = elastic = pauses = dependencies = waves = True
    step_word = "srun"
    env_prefixes = ("SLURM_",)

    pause_ends_job = True
    # srun's line for a task a signal ended, and slurmstepd's for a job Slurm ended (launcher doctor)
    killed_words = r"task (?P<task>\d+): Killed"
    ended_words = r"CANCELLED AT \S+ DUE TO (?P<why>TIME LIMIT|NODE FAILURE|PREEMPTION)"


BACKEND = SlurmBackend()
