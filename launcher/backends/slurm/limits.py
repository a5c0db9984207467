"""What the cluster and the user's account allow (sinfo's node sizes, sacctmgr's and squeue's limits: parsed
purely, asked through ``run`` and cached), and what a job's ending means (scontrol's record)."""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from launcher.sweeps import ArrayLimits

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
    name: str = ""  # the node's name ("": a cache written before names were kept)


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
                            gres_gpus(parts[4]), default=part.endswith("*"), name=parts[0].strip()))
    return out


def in_partition(nodes: List[NodeSize], partition: Optional[str]) -> List[NodeSize]:
    """The nodes of ``partition`` (None: the default one, sinfo's ``*``)."""
    return [n for n in nodes if (n.partition == partition if partition else n.default)]


def capacity_problems(nodes: List[NodeSize], partition: Optional[str], want_nodes: int, tasks: int,
                      cpus_per_task: int, gpus: int, mem_mb: Optional[int]) -> List[str]:
    """Why no placement of the request fits the partition's nodes (pure; empty: it fits, or the
    partition is unknown, which sbatch then says). ``gpus``: per node (0: none asked)."""
    in_part = in_partition(nodes, partition)
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
    nodes = nodes_from_sinfo(run(["sinfo", "-h", "-N", "-o", "%N|%P|%c|%m|%G"]))
    if nodes:
        try:
            atomic.write_json(cache, {"at": time.time(), "nodes": [n.__dict__ for n in nodes]})
        except OSError:  # a read-only home: asked again next time
            pass
    return nodes


def accounting_limits(user: str, account: Optional[str] = None
                      ) -> Optional[Tuple[List[Association], Dict[str, Optional[int]]]]:
    """The user's associations and every QOS's MaxSubmitJobsPerUser (``sacctmgr``; cached for
    CAPACITY_TTL_S: slurmdbd is asked once per launch at most; asked again when ``account``, the one
    the job asks for, is none of the cached ones: added since). None: unreadable (no slurmdbd, no
    sacctmgr, no association of the user's): nothing is refused for them, sbatch judges."""
    from launcher.archive import atomic  # lazy: only when a sweep is checked against the limits

    cache = _cache_file("accounting")
    got = atomic.read_json(cache)
    if isinstance(got, dict) and got.get("user") == user and time.time() - float(got.get("at", 0)) < CAPACITY_TTL_S \
            and (account is None or any(isinstance(a, dict) and a.get("account") == account
                                        for a in got.get("assocs") or ())):
        try:
            return ([Association(**{**a, "qos": tuple(a["qos"])}) for a in got["assocs"]],
                    {str(k): v for k, v in got["qos"].items()})
        except (KeyError, TypeError, AttributeError):
            pass
    assocs = associations_from_sacctmgr(run(["sacctmgr", "-n", "-P", "show", "user", user, "withassoc",
                                                          f"format={ASSOC_FORMAT}"]))
    if not assocs:
        return None
    qos = qos_limits_from_sacctmgr(run(["sacctmgr", "-n", "-P", "show", "qos",
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


def job_end_of(show_job: str) -> Optional[float]:
    """The job's end (its time limit), epoch seconds, from ``scontrol show job -o`` (pure; the
    controller's local time, as on its nodes). None: unknown or unlimited."""
    import datetime

    m = re.search(r"\bEndTime=(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)\b", show_job)
    return datetime.datetime.strptime(m.group(1), "%Y-%m-%dT%H:%M:%S").timestamp() if m else None


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


_said_failed: set = set()  # the commands whose failure this process said already


def run(cmd: List[str], say_failure: bool = False) -> str:
    """A Slurm command's output (\"\" where it could not run or timed out). ``say_failure``: a failure
    (slurmdbd down for sacct, the controller for squeue) is named on stderr once a process, so a table
    that lacks its answer says why instead of showing what it last recorded as if current."""
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as e:
        res = subprocess.CompletedProcess(cmd, 1, "", str(e))
    if say_failure and res.returncode != 0 and not res.stdout and cmd[0] not in _said_failed \
            and "Invalid job id" not in (res.stderr or ""):
        _said_failed.add(cmd[0])
        why = (res.stderr or "").strip().splitlines()[-1:] or ["no answer"]
        print(f"launcher: warning: {cmd[0]} failed ({why[0][:200]}): job states shown as last recorded",
              file=sys.stderr)
    return res.stdout
