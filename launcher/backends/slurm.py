"""Slurm through submitit's SlurmExecutor: one task per GPU, one array job per sweep group.

Values reach the sbatch script only through submitit's flag writer, which shell-quotes each one;
environment lines are quoted here with shlex.quote. ``cluster.setup`` lines are the user's own shell,
verbatim, except that a secret literal in one reads the variable that carries it (setup_lines). Job
states come from sacct (accounting), and from squeue for jobs sacct has not listed yet.
"""
from __future__ import annotations

import os
import re
import shlex
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Set, Tuple

from launcher.backends.base import (
    NOTE_ENV,
    Allocation,
    Backend,
    JobState,
    TaskPlace,
    env_int,
    limit_overrides,
    request_limits,
    submitit_parameters,
)
from launcher.features.elastic import resize as elastic
from launcher.job_record import JobRecord
from launcher.runtime import job_start
from launcher.status import Status
from launcher.sweeps import MAX_JOB_COUNT, ArrayLimits

PACK_STEP_ENV = "LAUNCHER_PACK_STEP"  # launcher.features.pack.runner exports it into each point's step
REQUEUE_NOTE_ENV = NOTE_ENV  # where the job's note for the step's teardown lives (runtime.after_step)

# Slurm's job states -> the run's status
STATES = {
    "PENDING": Status.pending, "CONFIGURING": Status.pending,
    "RUNNING": Status.running, "COMPLETING": Status.running, "SUSPENDED": Status.running,
    "COMPLETED": Status.completed,
    "FAILED": Status.failed, "NODE_FAIL": Status.failed, "OUT_OF_MEMORY": Status.failed,
    "BOOT_FAIL": Status.failed, "DEADLINE": Status.failed,
    "CANCELLED": Status.cancelled, "TIMEOUT": Status.timeout,
    "PREEMPTED": Status.requeued, "REQUEUED": Status.requeued, "REQUEUE_HOLD": Status.requeued,
    "REQUEUE_FED": Status.requeued,
}


def state_of(raw: str) -> Optional[JobState]:
    """``"CANCELLED by 0"``, ``"COMPLETED"``, ``"TIMEOUT+"`` -> JobState (None for an unknown word)."""
    word = (raw.split() or [""])[0].rstrip("+").upper()
    status = STATES.get(word)
    return JobState(status, raw.strip()) if status is not None else None


def parse_states(text: str) -> Dict[str, JobState]:
    """``JOBID|STATE`` lines (sacct -P, squeue -o "%i|%T") -> job id -> JobState; the last line of an id
    wins, unknown words are left out."""
    out: Dict[str, JobState] = {}
    for line in text.splitlines():
        jid, _, raw = line.partition("|")
        st = state_of(raw)
        if st is not None and jid.strip():
            out[jid.strip()] = st
    return out


def env_lines(env: Dict[str, Any]) -> List[str]:
    """`export K=V` lines, every value quoted so `;`, `$()` and spaces stay text. Secret-named
    variables are left out: they reach the job through the submitting environment instead."""
    # lazy: the secret rules only for the job's environment, not on the plan/--help path
    from launcher.archive.secrets import is_secret

    lines = []
    for k, v in sorted(env.items()):
        if not str(k).isidentifier():
            raise ValueError(f"cluster.env: {k!r} is not a valid environment variable name")
        if not is_secret(k):
            lines.append(f"export {k}={shlex.quote(str(v))}")
    return lines


def setup_lines(setup: Iterable[Any]) -> List[str]:
    """The user's ``cluster.setup`` lines as the script runs them: a secret literal among them reads
    the variable the launch exports it in (secrets.lift_shell), as the archived config does."""
    # lazy: the secret rules only for the job's script, not on the plan/--help path
    from launcher.archive.secrets import lift_shell

    return lift_shell([str(s) for s in setup])[0]


def requeue_lines(folder: Path) -> Dict[str, List[str]]:
    """The batch script's part in deciding the run's outcome outside the ranks: where the job leaves its
    note, and the teardown line that decides after srun returns (launcher.runtime.after_step: a rank
    that died without a word, a requeue the step killed)."""
    note = f"{shlex.quote(str(folder))}/requeue.${{SLURM_JOB_ID}}.json"
    # the job's exit status stays srun's (Slurm's FAILED/COMPLETED, afterok dependencies read it)
    return {"setup": [f"export {REQUEUE_NOTE_ENV}={note}"],
            "teardown": ["launcher_step_rc=$?",
                         f'{shlex.quote(sys.executable)} -m launcher.runtime.after_step "$launcher_step_rc"',
                         'exit "$launcher_step_rc"']}


def hostnames(nodelist: str) -> List[str]:
    """Slurm's compressed host list (SLURM_JOB_NODELIST: ``gpu[001-003,7],login-a[1-2]x``) expanded,
    in order; zero padding kept (``001``), several bracket groups in one name multiplied out."""
    out: List[str] = []
    for name in re.findall(r"(?:[^,\[]|\[[^\]]*\])+", nodelist):
        names = [""]
        for text, ranges in re.findall(r"([^\[]*)(?:\[([^\]]*)\])?", name):
            parts = [text]
            if ranges:
                parts = []
                for item in ranges.split(","):
                    lo, _, hi = item.partition("-")
                    parts += [text + str(i).zfill(len(lo)) for i in range(int(lo), int(hi or lo) + 1)]
            names = [n + p for n in names for p in parts]
        out += [n for n in names if n]
    return out


def cpus_per_node(text: str, count: int) -> List[int]:
    """SLURM_JOB_CPUS_PER_NODE (``4(x2),2``) -> one count per node."""
    out: List[int] = []
    for item in (text or "").split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
        if m:
            out += [int(m.group(1))] * int(m.group(2) or 1)
    return (out + [out[-1] if out else 1] * count)[:count]


# a pack job's own sizes, which its points' steps must not inherit (srun's defaults would be the job's:
# SLURM_MEM_PER_NODE the whole node's memory)
STEP_DROPPED = frozenset({"SLURM_MEM_PER_NODE", "SLURM_MEM_PER_CPU", "SLURM_MEM_PER_GPU", "SLURM_NTASKS",
                          "SLURM_NPROCS", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE"})


def alias_addr(host: str, aliases: str) -> Optional[str]:
    """``host``'s address in SLURM_NODE_ALIASES (``name:[addr]:host,...``, cloud nodes), or None."""
    for item in aliases.split(","):
        parts = item.split(":")
        if len(parts) >= 2 and parts[0] == host and parts[1].strip("[]"):
            return parts[1].strip("[]")
    return None


SEAL_MODULE = "launcher.runtime.seal"  # what the job sealing a run off the allocation runs
SEAL_TIME_MIN = 60  # its time limit: hashing the run dir once on one node
ELASTIC_MODULE = "launcher.features.elastic.decide"  # what the job deciding a run's next nodes runs (cluster.elastic)
ELASTIC_TIME_MIN = 10  # its time limit: a few scheduler questions and one submission
SCOPE_ENV = (("partition", "SLURM_JOB_PARTITION"), ("account", "SLURM_JOB_ACCOUNT"), ("qos", "SLURM_JOB_QOS"))


def job_scope(environ: Mapping[str, str]) -> Dict[str, str]:
    """The partition, account and QOS a running job's environment names (a job it queues uses them)."""
    return {flag: environ[key] for flag, key in SCOPE_ENV if environ.get(key)}


def after_job_command(kind: str, module: str, run_dir: Path, dependency: str, folder: Path, python: str,
                      scope: Mapping[str, str], time_min: int, args: Sequence[str] = ()) -> List[str]:
    """The sbatch line of a one-node, one-task job of ``kind`` that runs ``python -m module run_dir
    args...`` once ``dependency`` (sbatch's, e.g. ``afterany:123``) holds, never requeued, cancelled
    when the dependency can no longer hold, in ``scope`` (partition, account, QOS), its log in the
    submitit ``folder``."""
    cmd = ["sbatch", "--parsable", f"--dependency={dependency}", "--kill-on-invalid-dep=yes", "--no-requeue",
           "--nodes=1", "--ntasks=1", "--cpus-per-task=1", f"--time={int(time_min)}",
           f"--job-name={kind}-{Path(run_dir).parent.name}-{Path(run_dir).name}",
           f"--output={Path(folder) / f'{kind}.%j.out'}"]
    cmd += [f"--{flag}={scope[flag]}" for flag, _ in SCOPE_ENV if scope.get(flag)]
    return cmd + ["--wrap", " ".join(shlex.quote(str(w)) for w in (python, "-m", module, str(run_dir), *args))]


def seal_job_command(run_dir: Path, job_id: str, folder: Path, python: str,
                     environ: Mapping[str, str]) -> List[str]:
    """The sbatch line of the one-node, one-task job that seals ``run_dir`` once job ``job_id`` has
    ended (whatever its end: afterany), in the job's partition, account and QOS (the job's own
    environment names them), its log in the submitit ``folder``."""
    return after_job_command("seal", SEAL_MODULE, run_dir, f"afterany:{job_id}", folder, python, job_scope(environ),
                             SEAL_TIME_MIN)


def node_states_from_sinfo(text: str, partition: Optional[str]) -> List[Tuple[str, str]]:
    """(node, state) of ``partition``'s nodes (None: the default partition's) from
    ``sinfo -h -N -o %N|%P|%T``."""
    out = []
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) < 3:
            continue
        name, part, state = parts[0], parts[1], parts[2]
        if (part.rstrip("*") == partition) if partition else part.endswith("*"):
            out.append((name, state))
    return out


def submit_environment(environ: Mapping[str, str]) -> Dict[str, str]:
    """The environment sbatch runs in from inside a job: none of the job's own SLURM_/SBATCH_ variables
    (sbatch would read the running job's settings as the new job's), SLURM_CONF kept."""
    return {k: v for k, v in environ.items()
            if not (k.startswith(("SLURM_", "SBATCH_")) and k != "SLURM_CONF")}


def code_lines(code_dir: Optional[Path]) -> List[str]:
    """Jobs import the code snapshot first, so they run the code as it was at submission; they write
    no bytecode cache into it (runs are sealed with its digest; root's writes ignore its read-only mode)."""
    if code_dir is None:
        return []
    return [f"export PYTHONPATH={shlex.quote(str(code_dir))}${{PYTHONPATH:+:$PYTHONPATH}}",
            "export PYTHONDONTWRITEBYTECODE=1"]


# filesystems every node of a cluster can mount at the same path
SHARED_FS = frozenset({"nfs", "nfs4", "lustre", "gpfs", "beegfs", "cephfs", "ceph", "glusterfs", "fuse.glusterfs",
                       "wekafs", "panfs", "cifs", "smb3", "afs", "orangefs", "pvfs2", "fuse.juicefs", "fuse.sshfs",
                       "virtiofs", "9p", "fuse.weka", "exascaler"})


def fs_type(path: Path, mounts: str) -> str:
    """The type of the filesystem ``path`` is on (longest mount point of /proc/mounts above it)."""
    target = str(Path(path).expanduser().absolute())
    best, kind = "", ""
    for line in mounts.splitlines():
        parts = line.split()
        if len(parts) < 3:
            continue
        mnt = parts[1].replace("\\040", " ")
        if (target == mnt or target.startswith(mnt.rstrip("/") + "/") or mnt == "/") and len(mnt) >= len(best):
            best, kind = mnt, parts[2]
    return kind


def own_addresses() -> Set[str]:
    """Names and addresses of this host (and loopback)."""
    names = {"localhost", "127.0.0.1", "::1", socket.gethostname(), socket.getfqdn()}
    try:
        names.update(a[4][0] for a in socket.getaddrinfo(socket.gethostname(), None))
    except OSError:
        pass
    return names


def unshared_runs_root(runs_root: Path, fs: str, node_addrs: Set[str], own: Set[str]) -> Optional[str]:
    """The problem of a runs root on a local filesystem (``fs``) when some node is another host."""
    if not fs or fs in SHARED_FS or not node_addrs:
        return None
    others = sorted(a for a in node_addrs if a not in own and not a.startswith("127."))
    if not others:  # every node is this host (a single-machine cluster)
        return None
    return (f"submit.runs_root={runs_root} is on a {fs} filesystem of this host, which the nodes "
            f"({', '.join(others[:3])}{', ...' if len(others) > 3 else ''}) do not mount: each job would wait for "
            "its run dir and fail. Put it on a shared filesystem (submit.runs_root=/shared/... or $LAUNCHER_RUNS; "
            f"NFS, Lustre, GPFS, ...)")


def cpu_lines(cpus_per_task: int) -> List[str]:
    """srun (Slurm >= 22.05) takes the CPUs per task from SRUN_CPUS_PER_TASK, not from sbatch's
    --cpus-per-task: export it for any srun the user's setup lines run too."""
    return [f"export SRUN_CPUS_PER_TASK={int(cpus_per_task)}"]


def limits_from_config(text: str) -> Dict[str, Optional[int]]:
    """``scontrol show config`` -> {max_array_size, max_job_count, max_submit_jobs} (None where absent).
    MaxArraySize is the largest array index + 1, i.e. the most tasks one array may hold."""
    found: Dict[str, Optional[int]] = {"max_array_size": None, "max_job_count": None, "max_submit_jobs": None}
    names = {"maxarraysize": "max_array_size", "maxjobcount": "max_job_count", "maxsubmitjobs": "max_submit_jobs"}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        name = names.get(key.strip().lower())
        if sep and name:
            word = (value.split() or [""])[0]
            found[name] = int(word) if word.isdigit() and int(word) > 0 else None
    return found


def enforces_limits(text: str) -> bool:
    """Whether ``scontrol show config`` says association limits (MaxSubmitJobs...) are enforced:
    AccountingStorageEnforce lists ``limits`` (or ``safe``, which implies it)."""
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep and key.strip().lower() == "accountingstorageenforce":
            return bool({"limits", "safe"} & {w.strip().lower() for w in value.split(",")})
    return False


def max_submit_from_sacctmgr(text: str) -> Optional[int]:
    """The smallest MaxSubmitJobs of ``sacctmgr -n -P show assoc ... format=MaxSubmit`` lines (None: unset)."""
    values = [int(w) for w in (line.strip().split("|")[0] for line in text.splitlines()) if w.isdigit()]
    return min(values) if values else None


# ---- the user's submit limits in the accounting database (pure: sacctmgr's and squeue's text in) ----
# MaxSubmitJobs / GrpSubmitJobs of the user's association and MaxSubmitJobsPerUser of the job's QOS live
# in slurmdbd, not in `scontrol show config`: sbatch refuses a job past them ("Job violates
# accounting/QOS policy (job submit limit, ...)"), counting every pending or running array task as one
# job. MaxJobs (running jobs) is not among them: jobs past it wait, queued.

# `sacctmgr -n -P show user USER withassoc format=...`: one row per association of the user
ASSOC_FORMAT = "User,DefaultAccount,Account,Partition,MaxSubmit,GrpSubmit,DefaultQOS,QOS"
# `sacctmgr -n -P show qos format=...`
QOS_FORMAT = "Name,MaxSubmitPU"
# `squeue -h -r -u USER -o ...`: one row per job, each array task its own (-r)
QUEUE_FORMAT = "%i|%a|%q|%P"


@dataclass(frozen=True)
class Association:
    """One of the user's associations (account, partition) as sacctmgr shows it (None: unset)."""

    account: str
    partition: str = ""  # "": every partition without an association of its own
    max_submit: Optional[int] = None
    grp_submit: Optional[int] = None
    default_qos: str = ""
    qos: Tuple[str, ...] = ()
    default_account: str = ""  # the user's


@dataclass(frozen=True)
class QueuedJob:
    """One job (array task) the user has pending or running, as squeue shows it."""

    account: str = ""
    qos: str = ""
    partition: str = ""


def _limit_value(word: str) -> Optional[int]:
    word = word.strip()
    return int(word) if word.isdigit() else None  # "" (unset) or anything unreadable: no limit


def associations_from_sacctmgr(text: str) -> List[Association]:
    """``sacctmgr -n -P show user USER withassoc format=ASSOC_FORMAT`` -> one Association per row."""
    out = []
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) != 8 or not parts[2].strip():
            continue
        _, default, account, part, max_submit, grp_submit, def_qos, qos = (p.strip() for p in parts)
        out.append(Association(account, part, _limit_value(max_submit), _limit_value(grp_submit), def_qos,
                               tuple(q for q in qos.split(",") if q), default))
    return out


def qos_limits_from_sacctmgr(text: str) -> Dict[str, Optional[int]]:
    """``sacctmgr -n -P show qos format=QOS_FORMAT`` -> {qos name: MaxSubmitJobsPerUser or None}."""
    out: Dict[str, Optional[int]] = {}
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) == 2 and parts[0].strip():
            out[parts[0].strip()] = _limit_value(parts[1])
    return out


def queued_from_squeue(text: str) -> List[QueuedJob]:
    """``squeue -h -r -u USER -o QUEUE_FORMAT`` -> one QueuedJob per line (a bare id: one job, fields unknown)."""
    out = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.strip().split("|")]
        if parts[0]:
            out.append(QueuedJob(*(parts[1:4] + ["", "", ""])[:3]))
    return out


def association_of(assocs: Sequence[Association], account: Optional[str],
                   partition: Optional[str]) -> Optional[Association]:
    """The association a job of ``account`` (None: the user's default) on ``partition`` runs under:
    the one of that partition, else the account's partition-less one (as slurmctld picks)."""
    if not assocs:
        return None
    acct = account or assocs[0].default_account
    rows = [a for a in assocs if a.account == acct]
    exact = [a for a in rows if partition and a.partition == partition]
    return (exact or [a for a in rows if not a.partition] or [None])[0]


def qos_of(assoc: Optional[Association], qos: Optional[str]) -> str:
    """The QOS a job runs under: the one it asks for, else its association's default, else the
    association's only QOS, else ``normal`` (slurmctld's order)."""
    if qos:
        return qos
    if assoc is not None and assoc.default_qos:
        return assoc.default_qos
    if assoc is not None and len(assoc.qos) == 1:
        return assoc.qos[0]
    return "normal"


def submit_bounds(assocs: Sequence[Association], qos_limits: Dict[str, Optional[int]], queued: Sequence[QueuedJob],
                  account: Optional[str] = None, partition: Optional[str] = None,
                  qos: Optional[str] = None, partition_qos: Optional[str] = None) -> List[ArrayLimits]:
    """Every submit limit set for a job of (account, partition, qos), each with the user's jobs that
    count against it: the association's MaxSubmitJobs and GrpSubmitJobs (the user's jobs in that
    account; sacctmgr shows MaxSubmitJobs inherited from the parent accounts), the QOS's and the
    partition QOS's MaxSubmitJobsPerUser (the user's jobs in that QOS). Empty: none set or none read."""
    assoc = association_of(assocs, account, partition)
    out: List[ArrayLimits] = []
    if assoc is not None:
        where = f"association {assoc.account}" + (f"/{assoc.partition}" if assoc.partition else "")
        # a job squeue could not say the account of counts too: a bound read too tight beats sbatch's refusal
        held = sum(1 for j in queued if j.account in (assoc.account, "")
                   and (not assoc.partition or j.partition in (assoc.partition, "")))
        for name, value in (("MaxSubmitJobs", assoc.max_submit), ("GrpSubmitJobs", assoc.grp_submit)):
            if value is not None:
                out.append(ArrayLimits(None, value, held, bound=f"{name} of {where}, sacctmgr"))
    job_qos = qos_of(assoc, qos)
    if qos_limits.get(job_qos) is not None:
        held = sum(1 for j in queued if j.qos in (job_qos, ""))
        out.append(ArrayLimits(None, qos_limits[job_qos], held,
                               bound=f"MaxSubmitJobsPerUser of QOS {job_qos}, sacctmgr"))
    if partition_qos and partition_qos != job_qos and qos_limits.get(partition_qos) is not None:
        # a partition's QOS applies to every job in the partition, whatever the job's own QOS
        held = sum(1 for j in queued if not partition or j.partition in (partition, ""))
        out.append(ArrayLimits(None, qos_limits[partition_qos], held,
                               bound=f"MaxSubmitJobsPerUser of QOS {partition_qos} (the partition's), sacctmgr"))
    return out


def partition_qos_from_scontrol(text: str, partition: Optional[str]) -> Optional[str]:
    """The QoS= of ``partition`` (None: the default one) in ``scontrol show partition -o`` (None: none)."""
    for line in text.splitlines():
        fields = dict(w.split("=", 1) for w in line.split() if "=" in w)
        if (fields.get("PartitionName") == partition) if partition else fields.get("Default") == "YES":
            value = fields.get("QoS", "")
            return value if value and value != "N/A" else None
    return None


JOB_NAME_MAX = 1024  # slurmctld refuses a longer name ("Pathname ... too long")
CAPACITY_TTL_S = 600.0  # sinfo's node sizes, cached this long (per user, host and SLURM_CONF)


@dataclass(frozen=True)
class NodeSize:
    """One node of a partition as sinfo reports it."""

    partition: str
    cpus: int
    mem_mb: Optional[int]
    gpus: int
    default: bool = False  # its partition is the default one (sinfo marks it with *)


def gres_gpus(gres: str) -> int:
    """GPUs in a node's sinfo %G (``gpu:2``, ``gpu:a100:8(S:0-1)``, ``gpu:a:4,gpu:b:2``, ``(null)``)."""
    total = 0
    for item in re.split(r",(?![^(]*\))", gres or ""):
        parts = re.sub(r"\(.*?\)", "", item).split(":")
        if parts[0].strip() == "gpu" and parts[-1].strip().isdigit():
            total += int(parts[-1])
    return total


def nodes_from_sinfo(text: str) -> List[NodeSize]:
    """``sinfo -h -N -o "%N|%P|%c|%m|%G"`` -> one NodeSize per node and partition."""
    out = []
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) != 5 or not parts[2].strip().isdigit():
            continue
        part = parts[1].strip()
        mem = parts[3].strip().rstrip("+")
        out.append(NodeSize(part.rstrip("*"), int(parts[2]), int(mem) if mem.isdigit() else None,
                            gres_gpus(parts[4]), default=part.endswith("*")))
    return out


def capacity_problems(nodes: List[NodeSize], partition: Optional[str], want_nodes: int, tasks: int,
                      cpus_per_task: int, gpus: int, mem_mb: Optional[int]) -> List[str]:
    """Why no placement of the request fits the partition's nodes (pure; empty: it fits, or the
    partition is unknown, which sbatch then says). ``gpus``: per node (0: none asked)."""
    in_part = [n for n in nodes if (n.partition == partition if partition else n.default)]
    if not in_part:
        return []
    where = f"partition {in_part[0].partition}"
    cpus = tasks * cpus_per_task
    fit = [n for n in in_part if n.cpus >= cpus and n.gpus >= gpus and (mem_mb is None or n.mem_mb is None
                                                                         or n.mem_mb >= mem_mb)]
    if fit and len(fit) >= want_nodes:
        return []
    if not fit:
        out = []
        if gpus > max(n.gpus for n in in_part):
            out.append(f"cluster.gpus_per_node: asks {gpus} GPUs per node; the nodes of {where} have at most "
                       f"{max(n.gpus for n in in_part)} (sinfo)")
        if cpus > max(n.cpus for n in in_part):
            out.append(f"cluster.gpus_per_node: {tasks} tasks per node x cluster.cpus_per_task={cpus_per_task} "
                       f"ask {cpus} CPUs per node; the nodes of {where} have at most "
                       f"{max(n.cpus for n in in_part)} (sinfo)")
        mems = [n.mem_mb for n in in_part if n.mem_mb is not None]
        if mem_mb is not None and mems and mem_mb > max(mems):
            out.append(f"cluster.mem_gb: asks {mem_mb // 1024} GB per node; the nodes of {where} have at most "
                       f"{max(mems) / 1024:.1f} GB (sinfo)")
        if want_nodes > len(in_part):
            out.append(f"cluster.nodes: asks {want_nodes} nodes; {where} has {len(in_part)} (sinfo)")
        return out or [f"cluster: no node of {where} has {cpus} CPUs, {gpus} GPUs and the memory asked at once (sinfo)"]
    return [f"cluster.nodes: asks {want_nodes} nodes; {where} has {len(fit)} that fit one node's share "
            f"({len(in_part)} nodes in all, sinfo)"]


def _cache_file(kind: str) -> Path:
    """Where what ``kind`` the cluster said is cached: per user, host and SLURM_CONF."""
    import hashlib

    key = hashlib.sha256(f"{os.getuid()}|{socket.gethostname()}|{os.environ.get('SLURM_CONF', '')}".encode())
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "launcher" / f"slurm-{kind}-{key.hexdigest()[:16]}.json"


def cluster_nodes() -> List[NodeSize]:
    """Every node of every partition (sinfo), cached for CAPACITY_TTL_S: each launch asks once at most."""
    from launcher.archive import atomic  # lazy: only when a request is checked against the cluster

    cache = _cache_file("nodes")
    got = atomic.read_json(cache)
    if isinstance(got, dict) and time.time() - float(got.get("at", 0)) < CAPACITY_TTL_S:
        try:
            return [NodeSize(**n) for n in got["nodes"]]
        except (KeyError, TypeError):
            pass
    nodes = nodes_from_sinfo(_run(["sinfo", "-h", "-N", "-o", "%N|%P|%c|%m|%G"]))
    if nodes:
        try:
            atomic.write_json(cache, {"at": time.time(), "nodes": [n.__dict__ for n in nodes]})
        except OSError:  # a read-only home: asked again next time
            pass
    return nodes


def accounting_limits(user: str) -> Optional[Tuple[List[Association], Dict[str, Optional[int]]]]:
    """The user's associations and every QOS's MaxSubmitJobsPerUser (``sacctmgr``; cached for
    CAPACITY_TTL_S: slurmdbd is asked once per launch at most). None: unreadable (no slurmdbd, no
    sacctmgr, no association of the user's): nothing is refused for them, sbatch judges."""
    from launcher.archive import atomic  # lazy: only when a sweep is checked against the limits

    cache = _cache_file("accounting")
    got = atomic.read_json(cache)
    if isinstance(got, dict) and got.get("user") == user and time.time() - float(got.get("at", 0)) < CAPACITY_TTL_S:
        try:
            return ([Association(**{**a, "qos": tuple(a["qos"])}) for a in got["assocs"]],
                    {str(k): v for k, v in got["qos"].items()})
        except (KeyError, TypeError, AttributeError):
            pass
    assocs = associations_from_sacctmgr(_run(["sacctmgr", "-n", "-P", "show", "user", user, "withassoc",
                                                          f"format={ASSOC_FORMAT}"]))
    if not assocs:
        return None
    qos = qos_limits_from_sacctmgr(_run(["sacctmgr", "-n", "-P", "show", "qos",
                                                     f"format={QOS_FORMAT}"]))
    try:
        atomic.write_json(cache, {"at": time.time(), "user": user, "assocs": [a.__dict__ for a in assocs], "qos": qos})
    except OSError:  # a read-only home: asked again next time
        pass
    return assocs, qos


def _seconds(text: str) -> Optional[int]:
    """Slurm's ``[D-]HH:MM:SS`` (or ``MM:SS``) in seconds; None: UNLIMITED, Unknown or unreadable."""
    m = re.fullmatch(r"(?:(\d+)-)?(?:(\d+):)?(\d+):(\d+)", text or "")
    if not m:
        return None
    d, h, mi, s = (int(x) if x else 0 for x in m.groups())
    return ((d * 24 + h) * 60 + mi) * 60 + s


def job_ending_of(show_job: str, restart_count: int) -> Optional[str]:
    """What ``scontrol show job -o`` says of a job whose processes got a TERM (pure). slurmctld counts
    a requeue (Restarts) before it signals the job's processes: Restarts above the job's own
    SLURM_RESTART_COUNT is "requeued" (it starts again). A job it is ending shows CANCELLED, TIMEOUT or
    COMPLETING (which hides the base state: its Reason tells a time limit, a lost node...): "cancelled"
    where nothing else ends it (no reason given, its run time short of its limit), "timeout" at its
    limit. Anything else is None: a job still RUNNING got a TERM that is not the scheduler's end of it
    (srun ending a step whose other task failed, a user's kill), and a lost node or a failure is left
    to the step's teardown and cluster.elastic."""
    fields = dict(re.findall(r"(\w+)=(\S*)", show_job))
    if "JobState" not in fields or "Restarts" not in fields or not fields["Restarts"].isdigit():
        return None
    if int(fields["Restarts"]) > restart_count:
        return "requeued"
    state, reason = fields["JobState"].upper(), fields.get("Reason", "None")
    if state in ("TIMEOUT", "DEADLINE") or (state == "COMPLETING" and reason == "TimeLimit"):
        return "timeout"
    if state == "CANCELLED":
        return "cancelled"
    if state != "COMPLETING" or reason not in ("None", ""):
        return None
    run, limit = _seconds(fields.get("RunTime", "")), _seconds(fields.get("TimeLimit", ""))
    if run is not None and limit is not None and run >= limit:
        return "timeout"
    return "cancelled"


def _run(cmd: List[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


class SlurmBackend(Backend):
    name = "slurm"
    waits = False
    packs = elastic = pauses = dependencies = True
    step_word = "srun"
    env_prefixes = ("SLURM_",)

    def parameters(self, cfg: Any, code_dir: Optional[Path] = None) -> Dict[str, Any]:
        cl = cfg.cluster
        params: Dict[str, Any] = {
            "job_name": str(cfg.submit.job_name),
            "time": int(cl.time_min),
            "nodes": int(cl.nodes),
            "ntasks_per_node": int(cl.gpus_per_node),
            "cpus_per_task": int(cl.cpus_per_task),
            "array_parallelism": int(cl.array_parallelism),
            "setup": setup_lines(cl.setup) + env_lines(dict(cl.env)) + code_lines(code_dir) +
            cpu_lines(int(cl.cpus_per_task)),
            # Slurm signals USR2 this long before the time limit: the run checkpoints and requeues
            "signal_delay_s": int(cl.signal_delay_s),
            # one rank failing ends the step at once instead of leaving the others in a collective;
            # since Slurm 22.05 srun no longer inherits --cpus-per-task: without it every rank is
            # bound to one CPU (data loading, CPU Adam and OMP threads all on one core)
            "srun_args": ["--kill-on-bad-exit=1", f"--cpus-per-task={int(cl.cpus_per_task)}"],
        }
        # cluster.elastic: its restarts are new jobs the run's deciding job submits; Slurm requeues nothing
        if elastic.settings(cfg)["enabled"]:
            params["setup"] = params["setup"] + [f"export {elastic.ENV}=1"]
        if cl.get("exclusive"):
            params["exclusive"] = True  # sbatch --exclusive: no other job shares the nodes
        if cl.use_gpus:
            params["gpus_per_node"] = int(cl.gpus_per_node)
        for key in ("partition", "account", "qos", "constraint"):
            value = cl.get(key)
            if value:
                params[key] = str(value)
        if cl.mem_gb:
            params["mem"] = f"{int(cl.mem_gb)}GB"
        # a value true (its YAML typed as a string here) is a bare flag: --no-requeue, not --no-requeue=True
        extra = {str(k): True if str(v).lower() == "true" else v for k, v in cl.sbatch_extra.items()}
        # submitit's own parameters as given (the Hydra launcher's hydra-submitit-launcher options:
        # comment, exclude, gres, ...; additional_parameters with their types, true a bare flag)
        raw = submitit_parameters(cl)
        extra.update(raw.pop("additional_parameters", None) or {})
        params.update(raw)
        if elastic.settings(cfg)["enabled"]:
            extra["no-requeue"] = True
        if code_dir is not None:
            extra.setdefault("chdir", str(code_dir))  # `python -m` puts the working dir first on sys.path
        if extra:
            params["additional_parameters"] = extra
        return params

    def submission(self, cfg: Any, code_dir: Optional[Path], job_name: Optional[str],
                   parallelism: Optional[int], folder: Path) -> Dict[str, Any]:
        """The executor parameters of one submission: the point's, with the submission's name and throttle,
        and the batch script's teardown."""
        params = self.parameters(cfg, code_dir)
        lines = requeue_lines(folder)
        params["setup"] = params["setup"] + lines["setup"]
        params["teardown"] = lines["teardown"]
        if job_name is not None:
            params["job_name"] = str(job_name)
        if parallelism is not None:
            params["array_parallelism"] = max(1, int(parallelism))  # sbatch --array=0-<n-1>%<k>
        return params

    def executor(self, cfg: Any, folder: Path, code_dir: Optional[Path] = None, job_name: Optional[str] = None,
                 parallelism: Optional[int] = None) -> Any:
        from submitit import SlurmExecutor  # submitit: only to submit or read a job, not on the plan/--help path

        ex = SlurmExecutor(folder=folder, python=job_start.python_command())  # stop signals held from the start
        ex.update_parameters(**self.submission(cfg, code_dir, job_name, parallelism, folder))
        return ex

    def pack_parameters(self, cfg: Any, code_dir: Optional[Path], job_name: Optional[str], nodes: int,
                        folder: Path) -> Dict[str, Any]:
        """The pack's job: ``nodes`` whole nodes (--exclusive: the runner shares them among its points'
        steps), every GPU of them where the points use GPUs; one process (no srun: the runner starts the
        steps), the points' setup lines and environment; no teardown (the runner decides each point's
        end itself)."""
        params = self.parameters(cfg, code_dir)
        cl = cfg.cluster
        params.update(nodes=int(nodes), ntasks_per_node=1, use_srun=False, exclusive=True, teardown=[])
        params.pop("srun_args", None)
        params.pop("mem", None)  # whole nodes: all their memory
        if cl.use_gpus:
            part = cl.get("partition")
            sizes = [n.gpus for n in cluster_nodes() if (n.partition == str(part) if part else n.default)]
            params["gpus_per_node"] = max(sizes + [int(cl.gpus_per_node)])
        if job_name is not None:
            params["job_name"] = str(job_name)
        params.pop("array_parallelism", None)
        return params

    def pack_preview(self, cfg: Any, folder: Path, points: List[int], nodes: int, code_dir: Optional[Path] = None,
                     job_name: Optional[str] = None) -> str:
        params = self.pack_parameters(cfg, code_dir, job_name, nodes, folder)
        lines = [f"#   {k}: {v}" for k, v in sorted(params.items()) if k != "setup"]
        return "\n".join([f"# ---- pack of points {points}: ONE job of {nodes} node(s) (cluster.pack=true); "
                          "each point a job step (srun --exact)", *lines])

    def allocation(self, environ: Mapping[str, str]) -> Allocation:
        hosts = hostnames(str(environ.get("SLURM_JOB_NODELIST") or "")) or ["localhost"]
        mem_mb = str(environ.get("SLURM_MEM_PER_NODE") or "")
        return Allocation(job_id=str(environ.get("SLURM_JOB_ID") or "0"), hosts=hosts,
                          cpus=cpus_per_node(str(environ.get("SLURM_JOB_CPUS_PER_NODE") or ""), len(hosts)),
                          gpus=int(str(environ.get("SLURM_GPUS_ON_NODE") or "0").split("(")[0] or 0),
                          mem_bytes=int(mem_mb) << 20 if mem_mb.isdigit() and int(mem_mb) > 0 else None)

    def step_command(self, command: List[str], need: Any, nodes: List[str], out: str, err: str, name: str,
                     host_mem: Optional[int] = None, shared_gpu: bool = False) -> List[str]:
        """srun exactly the point's nodes, ranks and CPUs (--exact: no more of the allocation than asked,
        so other points run beside it)."""
        cmd = ["srun", "--exact", f"--nodes={need.nodes}", f"--ntasks={need.nodes * need.tasks}",
               f"--ntasks-per-node={need.tasks}", f"--cpus-per-task={need.cpus_per_task}",
               f"--nodelist={','.join(nodes)}", "--kill-on-bad-exit=1", f"--job-name={name}",
               f"--output={out}", f"--error={err}"]
        if host_mem is not None:  # the planner's estimate, per node (where Slurm tracks memory)
            cmd.append(f"--mem={max(1, (need.tasks * host_mem) >> 20)}M")
        if need.gpus:
            cmd.append(f"--gres=gpu:{need.tasks}")
            if shared_gpu:  # several points' ranks on one GPU: the step may overlap another's GRES
                cmd.append("--overlap")
        return cmd + list(command)

    def step_environment(self, environ: Mapping[str, str]) -> Dict[str, str]:
        return {k: v for k, v in environ.items() if k not in STEP_DROPPED}

    def after(self, job_id: str) -> List[str]:
        # --kill-on-invalid-dep: a rung whose predecessor failed leaves the queue instead of waiting for ever
        return [f"++cluster.sbatch_extra.dependency=afterok:{job_id}", "++cluster.sbatch_extra.kill-on-invalid-dep=yes"]

    def pack_node_limit(self, cfg: Any) -> Optional[int]:
        """The nodes of the pack's partition (sinfo, cached): a pack asks whole nodes."""
        part = cfg.cluster.get("partition")
        names = [n for n in cluster_nodes() if (n.partition == str(part) if part else n.default)]
        return len(names) or None

    def pack_executor(self, cfg: Any, folder: Path, code_dir: Optional[Path], job_name: Optional[str],
                      nodes: int) -> Any:
        from submitit import SlurmExecutor  # submitit: only to submit or read a job, not on the plan/--help path

        ex = SlurmExecutor(folder=folder, python=job_start.python_command())  # stop signals held from the start
        ex.update_parameters(**self.pack_parameters(cfg, code_dir, job_name, nodes, folder))
        return ex

    def runs_root_problem(self, runs_root: Path, cfg: Any = None) -> Optional[str]:
        """A runs root on a filesystem only this host has, for nodes that are other hosts: the job
        would wait 120 s for its run dir and fail. Unknown (no sinfo, no /proc/mounts): None."""
        try:
            mounts = Path("/proc/mounts").read_text()
        except OSError:
            return None
        part = cfg.cluster.get("partition") if cfg is not None else None
        nodes = [ln.split() for ln in _run(["sinfo", "-h", "-N", "-o", "%N %o"]
                                           + (["-p", str(part)] if part else [])).splitlines()]
        return unshared_runs_root(runs_root, fs_type(runs_root, mounts), {n[1] for n in nodes if len(n) == 2},
                                  own_addresses())

    def request_problems(self, cfg: Any) -> List[str]:
        """The shared bounds, the job name's (slurmctld's 1024 bytes), and a request no node set of its
        partition could ever hold (cluster.nodes, per-node GPUs, CPUs, memory; sinfo, cached)."""
        out = request_limits(cfg, job_name_max=JOB_NAME_MAX)
        cl = getattr(cfg, "cluster", None)
        try:
            want = int(cl.nodes), int(cl.gpus_per_node), int(cl.get("cpus_per_task") or 1)
        except (AttributeError, TypeError, ValueError):  # not a launcher run config (a bare shim)
            return out
        mem = cl.get("mem_gb")
        gpus = want[1] if cl.get("use_gpus") else 0
        part = cl.get("partition")
        return out + capacity_problems(cluster_nodes(), str(part) if part else None, want[0], want[1], want[2],
                                       gpus, int(mem) * 1024 if mem else None)

    def jobs_in_folder(self, folder: Path) -> List[str]:
        """squeue's array job ids (%F) of this user's jobs whose batch script (%o) is in ``folder``."""
        import getpass  # getpass (termios): only when a launch is repaired

        inside = str(Path(folder).absolute()).rstrip("/") + "/"
        ids = []
        for line in _run(["squeue", "-h", "-u", getpass.getuser(), "-o", "%F|%o"]).splitlines():
            jid, _, command = line.partition("|")
            if command.strip().startswith(inside) and jid.strip() not in ids:
                ids.append(jid.strip())
        return ids

    def array_limits(self, cfg: Any = None) -> Any:
        """MaxArraySize and MaxJobCount from ``scontrol show config``; when AccountingStorageEnforce
        enforces limits, the user's submit limits from the accounting database (association
        MaxSubmitJobs / GrpSubmitJobs, the QOS's MaxSubmitJobsPerUser: ``sacctmgr``, cached; unreadable:
        none, sbatch judges); and the tightest room: each limit less the jobs (array tasks counted one by
        one) the user has queued now against it (``squeue -r -u USER``), MaxJobCount less every job the
        controller holds (``squeue -r -t all``, every user's). ``cfg``'s cluster.account / partition /
        qos pick the association and QOS. cluster.max_array_size / cluster.max_submit_jobs replace the
        scheduler's values and spare the queries they make moot."""
        import getpass  # getpass (termios): only when the scheduler's limits are read

        user = getpass.getuser()
        size, jobs = limit_overrides(cfg)
        cl = getattr(cfg, "cluster", None) if cfg is not None else None
        account, part, qos = (str(cl.get(k)) if cl is not None and cl.get(k) else None
                              for k in ("account", "partition", "qos"))
        conf: Dict[str, Optional[int]] = {}
        accounting: Optional[Any] = None
        if size is None or jobs is None:
            text = _run(["scontrol", "show", "config"])
            conf = limits_from_config(text)
            if jobs is None and enforces_limits(text):  # association and QOS limits apply only when enforced
                accounting = accounting_limits(user)
        counted = jobs is not None or conf.get("max_submit_jobs") or accounting
        rows = queued_from_squeue(_run(["squeue", "-h", "-r", "-u", user, "-o", QUEUE_FORMAT])) if counted else []
        if jobs is not None:
            return ArrayLimits(size or conf.get("max_array_size"), jobs, len(rows))
        bounds = []
        if conf.get("max_submit_jobs"):
            bounds.append(ArrayLimits(None, conf["max_submit_jobs"], len(rows)))
        if accounting:
            assocs, qos_limits = accounting
            part_qos = None
            if any(v is not None for v in qos_limits.values()):  # (0 is a limit: nothing may be queued)
                part_qos = partition_qos_from_scontrol(_run(["scontrol", "show", "partition", "-o"]), part)
            bounds += submit_bounds(assocs, qos_limits, rows, account, part, qos, part_qos)
        if conf.get("max_job_count"):  # the controller's, over every user's jobs it holds (ended ones too,
            # for MinJobAge): sbatch past it retries for minutes, then fails "Resource temporarily unavailable"
            held = len(_run(["squeue", "-h", "-r", "-t", "all", "-o", "%i"]).split())
            bounds.append(ArrayLimits(None, conf["max_job_count"], held, bound=MAX_JOB_COUNT))
        tightest = min(bounds, key=lambda b: b.room) if bounds else ArrayLimits()
        return replace(tightest, max_array_size=size or conf.get("max_array_size"))

    def preview(self, cfg: Any, folder: Path, points: List[int], code_dir: Optional[Path] = None,
                job_name: Optional[str] = None, parallelism: Optional[int] = None) -> str:
        """The sbatch script submitit would write for these points (dry run: nothing is submitted;
        after a real submission the archive holds the file submitit wrote)."""
        return (f"# ---- sbatch script for points {points} ({len(points)} array task(s))\n"
                + self.script_text(cfg, folder, len(points), code_dir, job_name, parallelism))

    def script_text(self, cfg: Any, folder: Path, n_points: int, code_dir: Optional[Path] = None,
                    job_name: Optional[str] = None, parallelism: Optional[int] = None) -> str:
        # submitit: only to submit or read a job, not on the plan/--help path
        from submitit.slurm.slurm import _make_sbatch_string

        params = self.submission(cfg, code_dir, job_name, parallelism, folder)
        if n_points > 1:
            params["map_count"] = n_points
        command = " ".join([shlex.quote(sys.executable), "-u -m submitit.core._submit", shlex.quote(str(folder))])
        return _make_sbatch_string(command=command, folder=folder, **params)

    def job_record(self, job: Any, num_tasks: Optional[int] = None) -> JobRecord:
        """A task of an array job is ``<array>_<task>``; a lone job, its own id."""
        record = super().job_record(job, num_tasks)
        array, _, task = record.job_id.partition("_")
        return replace(record, array_job_id=array, array_task_id=int(task)) if task else record

    def submitted_script(self, job: Any) -> Optional[str]:
        path = Path(job.paths.submission_file)
        return path.read_text() if path.exists() else None

    def states(self, jobs: Iterable[Dict[str, Any]]) -> Dict[str, JobState]:
        ids = sorted({str(j["job_id"]) for j in jobs if j.get("job_id")})
        if not ids:
            return {}
        out = parse_states(_run(["sacct", "-X", "-n", "-P", "--format=JobID,State", "-j", ",".join(ids)]))
        # accounting lags submission, and keeps REQUEUED for a job requeued held and then cancelled
        # (a pruned point's): the controller's word for these, while it still knows the job (-t all:
        # ended ones too, for MinJobAge)
        ask = [i for i in ids if i not in out or out[i].status is Status.requeued]
        if ask:
            live = parse_states(_run(["squeue", "-h", "-t", "all", "-o", "%i|%T", "-j", ",".join(ask)]))
            out.update({i: st for i, st in live.items() if i in ask})
        return out

    def cancel(self, job: JobRecord, wait_s: float = 60.0) -> None:
        """scancel, then wait (up to ``wait_s``) until Slurm reports the job ended, so that nothing
        of it writes into the run dir after the launcher seals it."""
        if job.pack_index is not None:  # a packed point: its step alone; the pack's other points run on
            return self._cancel_point(job, wait_s)
        subprocess.run(["scancel", job.job_id], check=False, timeout=60)
        deadline = time.time() + wait_s
        while time.time() < deadline:
            state = self.states([job.to_json()]).get(job.job_id)
            if state is None or state.ended:
                return
            time.sleep(1.0)

    def _cancel_point(self, job: JobRecord, wait_s: float) -> None:
        """scancel the step of a packed point (found by its name: launcher.features.pack.runner.step_name), then
        wait until it is gone. A point still queued has no step: its run, recorded cancelled first
        (launcher cancel), is one its pack's runner never starts."""
        prefix = f"pack{job.pack_index}-"

        def steps() -> List[str]:
            out = _run(["squeue", "-h", "-s", "-j", job.job_id, "-o", "%i|%j"])
            return [i.strip() for i, _, name in (ln.partition("|") for ln in out.splitlines())
                    if name.strip().startswith(prefix)]

        for step in steps():
            subprocess.run(["scancel", step], check=False, timeout=60)
        deadline = time.time() + wait_s
        while time.time() < deadline and steps():
            time.sleep(1.0)

    def request_requeue(self, job_id: Optional[str]) -> None:
        """``scontrol requeue``: Slurm ends this job's processes and queues the same job id again."""
        if os.environ.get(PACK_STEP_ENV):  # a packed point: its pack's runner starts it again, not Slurm
            return
        if os.environ.get(elastic.ENV) == "1":  # cluster.elastic: the job queued after this one restarts the
            return  # run, as a new job on the nodes there are then (launcher.features.elastic.decide)
        if not job_id:
            raise RuntimeError("no Slurm job id to requeue (SLURM_JOB_ID unset)")
        res = subprocess.run(["scontrol", "requeue", str(job_id)], timeout=60, capture_output=True, text=True)
        if res.returncode:
            raise subprocess.CalledProcessError(res.returncode, res.args, res.stdout, res.stderr.strip())

    pause_ends_job = True

    def pause(self, job_id: Optional[str]) -> None:
        """``scontrol requeuehold``: Slurm ends this job and keeps it pending, held (out of the array's
        running slots, never purged as an ended job would be) until ``resume_paused`` releases it."""
        try:
            self._scontrol("requeuehold", job_id)
        except subprocess.CalledProcessError as e:
            if e.returncode >= 0:
                raise
            # scontrol runs inside the job: the requeue it asked for ends the job's processes and can kill
            # scontrol before it exits. The request was taken; a hold makes sure of it (already held: no-op).
            subprocess.run(["scontrol", "hold", str(job_id)], check=False, timeout=60, capture_output=True)

    def resume_paused(self, job_id: Optional[str], tries: int = 5, wait_s: float = 2.0) -> None:
        """``scontrol release`` of the held job: it runs again, same job id, and resumes. Asked again a
        few times: a job paused a moment ago may still be completing its requeue."""
        for i in range(tries):
            try:
                return self._scontrol("release", job_id)
            except subprocess.CalledProcessError:
                if i == tries - 1:
                    raise
                time.sleep(wait_s)

    def drop_paused(self, job_id: Optional[str]) -> None:
        """``scancel`` of the held job."""
        if job_id:
            subprocess.run(["scancel", str(job_id)], check=False, timeout=60, capture_output=True)

    def _scontrol(self, verb: str, job_id: Optional[str]) -> None:
        if not job_id:
            raise RuntimeError(f"no Slurm job id to {verb}")
        res = subprocess.run(["scontrol", verb, str(job_id)], timeout=60, capture_output=True, text=True)
        if res.returncode:
            raise subprocess.CalledProcessError(res.returncode, res.args, res.stdout, res.stderr.strip())

    def requeued_since_start(self, job_id: Optional[str]) -> bool:
        """Whether this job was requeued since it started (its restart count went up): an earlier
        request went through, and a second one would fail ("Job is pending execution")."""
        if os.environ.get(PACK_STEP_ENV):
            return False
        m = re.search(r"\bRestarts=(\d+)", _run(["scontrol", "show", "job", "-o", str(job_id)]))
        return bool(m) and int(m.group(1)) > int(os.environ.get("SLURM_RESTART_COUNT") or 0)

    def job_ending(self, job_id: Optional[str]) -> Optional[str]:
        """``scontrol show job`` read at the TERM (slurmctld's word, before accounting's): see
        ``job_ending_of``. A packed point's step: None (the pack runner decides for its points)."""
        if not job_id or os.environ.get(PACK_STEP_ENV):
            return None
        return job_ending_of(_run(["scontrol", "show", "job", "-o", str(job_id)]),
                             int(os.environ.get("SLURM_RESTART_COUNT") or 0))

    def job_state_now(self, job_id: Optional[str]) -> str:
        """``scontrol show job``'s JobState (slurmctld's word, without accounting's lag); "": unknown."""
        if not job_id:
            return ""
        m = re.search(r"\bJobState=(\S+)", _run(["scontrol", "show", "job", "-o", str(job_id)]))
        return m.group(1) if m else ""

    # ---- the node side (launcher.runtime.env): Slurm's environment of a task ----
    def detect(self, environ: Mapping[str, str]) -> bool:
        """submitit's batch script exports SUBMITIT_EXECUTOR=slurm; without it, any Slurm job."""
        word = environ.get("SUBMITIT_EXECUTOR")
        return word == self.name or (not word and bool(environ.get("SLURM_JOB_ID")))

    def place(self, environ: Mapping[str, str]) -> TaskPlace:
        raw = str(environ.get("SLURM_JOB_ID") or "")
        if environ.get(PACK_STEP_ENV) and environ.get("SLURM_STEP_ID"):
            return self._pack_place(environ, raw)
        array, task = environ.get("SLURM_ARRAY_JOB_ID") or None, environ.get("SLURM_ARRAY_TASK_ID") or None
        hosts = hostnames(environ.get("SLURM_JOB_NODELIST", "")) or [self.node_name(environ) or socket.gethostname()]
        return TaskPlace(rank=env_int(environ, "SLURM_PROCID", 0), world_size=env_int(environ, "SLURM_NTASKS", 1),
                         local_rank=env_int(environ, "SLURM_LOCALID", 0), node_rank=env_int(environ, "SLURM_NODEID", 0),
                         num_nodes=env_int(environ, "SLURM_JOB_NUM_NODES", 1), hostnames=tuple(hosts),
                         job_id=f"{array}_{task}" if array else raw, raw_job_id=raw,
                         array_job_id=array, array_task_id=task)

    def _pack_place(self, environ: Mapping[str, str], raw: str) -> TaskPlace:
        """A rank of a packed point (launcher.features.pack.runner): its step's nodes, not the allocation's, and
        ``<job>.<step>`` as its job id (the rendezvous port is derived from it: points differ)."""
        step_id = f"{raw}.{environ['SLURM_STEP_ID']}"
        hosts = hostnames(environ.get("SLURM_STEP_NODELIST", "")) or [self.node_name(environ) or socket.gethostname()]
        me = self.node_name(environ)
        world = env_int(environ, "SLURM_STEP_NUM_TASKS", env_int(environ, "SLURM_NTASKS", 1))
        return TaskPlace(rank=env_int(environ, "SLURM_PROCID", 0), world_size=world,
                         local_rank=env_int(environ, "SLURM_LOCALID", 0),
                         node_rank=hosts.index(me) if me in hosts else env_int(environ, "SLURM_NODEID", 0),
                         num_nodes=env_int(environ, "SLURM_STEP_NUM_NODES", len(hosts)), hostnames=tuple(hosts),
                         job_id=step_id, raw_job_id=step_id)

    def node_name(self, environ: Mapping[str, str]) -> Optional[str]:
        return environ.get("SLURMD_NODENAME") or None

    def address_hint(self, host: str, environ: Mapping[str, str]) -> Optional[str]:
        return alias_addr(host, environ.get("SLURM_NODE_ALIASES", ""))

    def ask_address(self, host: str) -> Optional[str]:
        """Slurm's NodeAddr of ``host`` (``scontrol show node``: one RPC to slurmctld)."""
        m = re.search(r"\bNodeAddr=(\S+)", _run(["scontrol", "show", "node", host, "-o"]))
        return m.group(1) if m else None

    def seal_after_job(self, run_dir: Path, job_id: Optional[str], folder: Path) -> Optional[str]:
        """A one-node, one-task job after this one (afterany) seals the run: the allocation is released
        first, not held while one process hashes the run dir (seal_job_command)."""
        if not job_id:
            return None
        try:
            return self._sbatch(seal_job_command(run_dir, job_id, folder, sys.executable, os.environ))
        except (OSError, subprocess.SubprocessError, RuntimeError):
            return None

    def elastic_after_job(self, run_dir: Path, job_id: str, folder: Path, when: str = "afternotok",
                          scope: Optional[Mapping[str, str]] = None) -> str:
        """Queue the one-node job that decides where run ``run_dir`` goes on once job ``job_id`` ends
        (``when``: afternotok, the cluster may have ended it; afterany, it ends to grow back), in
        ``scope`` (partition, account, QOS; None: this job's); its id. Raises RuntimeError: refused."""
        cmd = after_job_command("elastic", ELASTIC_MODULE, run_dir, f"{when}:{job_id}", folder, sys.executable,
                                job_scope(os.environ) if scope is None else scope, ELASTIC_TIME_MIN, (str(job_id),))
        return self._sbatch(cmd)

    def usable_nodes(self, partition: Optional[str], own: Optional[str] = None) -> List[str]:
        """The nodes of ``partition`` (None: the default one) a job queued now could start on at once: the
        idle ones, and ``own`` (launcher.features.elastic.resize.usable)."""
        rows = node_states_from_sinfo(_run(["sinfo", "-h", "-N", "-o", "%N|%P|%T"]), partition)
        return elastic.usable(rows, own)

    def ended_state(self, job_id: str) -> str:
        """The scheduler's word for a job that has ended (sacct, the controller's while accounting lags)."""
        state = self.states([{"job_id": job_id}]).get(str(job_id))
        return state.raw if state is not None else ""

    @staticmethod
    def _sbatch(cmd: List[str]) -> str:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=submit_environment(os.environ))
        if res.returncode != 0 or not res.stdout.strip():
            raise RuntimeError(f"sbatch refused: {(res.stderr or res.stdout).strip()}")
        return res.stdout.strip().split(";")[0]

    # srun's line for a task a signal ended, and slurmstepd's for a job Slurm ended (launcher doctor)
    killed_words = r"task (?P<task>\d+): Killed"
    ended_words = r"CANCELLED AT \S+ DUE TO (?P<why>TIME LIMIT|NODE FAILURE|PREEMPTION)"


BACKEND = SlurmBackend()
