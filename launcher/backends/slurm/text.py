"""Slurm's words, read and written (pure: text in, text or records out): job states, the batch
script's lines, node lists, the after-job commands, the file system and address checks, limits."""
from __future__ import annotations

import re
import shlex
import socket
import sys
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Set, Tuple

from launcher.backends.base import (
    NOTE_ENV,
    STEP_START_ENV,
    JobState,
)
from launcher.run.status import Status

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


def _tasks_of(spec: str) -> Optional[set]:
    """The task indices of a compressed array record's brackets (``0-5,7,9-11%4`` -> {0..5, 7, 9, 10, 11});
    None where it is not such a list."""
    tasks: set = set()
    for part in spec.partition("%")[0].split(","):
        lo, dash, hi = part.strip().partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()):
            return None
        tasks.update(range(int(lo), int(hi if dash else lo) + 1))
    return tasks


def with_array_tasks(states: Dict[str, JobState], ids: Iterable[str]) -> Dict[str, JobState]:
    """``states`` plus, for each asked array task ``A_T`` the answer left out, the state of the compressed
    record ``A_[...]`` that holds T: the only record sacct and squeue keep of an array's tasks that never
    started (pending, or cancelled, or purged while pending). An array cancelled whole before any task
    was split off is one record named ``A`` alone in sacct: each of its tasks takes that state."""
    out = dict(states)
    packed = {}
    for jid, st in states.items():
        array, sep, rest = jid.partition("_[")
        tasks = _tasks_of(rest.rstrip("]")) if sep and rest.endswith("]") else None
        if tasks is not None:
            packed.setdefault(array, []).append((tasks, st))
    for i in ids:
        array, sep, task = i.partition("_")
        if i not in out and sep and task.isdigit():
            for tasks, st in packed.get(array, []):
                if int(task) in tasks:
                    out[i] = st
            if i not in out and array in states:  # the whole array's one record
                out[i] = states[array]
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
    # when this attempt's ranks start: their peer watch ignores the errors an earlier attempt left
    return {"setup": [f"export {REQUEUE_NOTE_ENV}={note}", f"export {STEP_START_ENV}=$(date +%s.%N)"],
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
PLACE_MODULE = "launcher.backends.slurm.place"  # what the job leaving a held job's bad nodes out runs
PLACE_TIME_MIN = 15  # its time limit: waiting for the held job to be pending, two scontrol calls
WAVES_MODULE = "launcher.submit.waves"  # what the job queueing a sweep's next wave runs
WAVES_TIME_MIN = 30  # its time limit: the scheduler's limits read, the wave's arrays and records written
SCOPE_ENV = (("partition", "SLURM_JOB_PARTITION"), ("account", "SLURM_JOB_ACCOUNT"), ("qos", "SLURM_JOB_QOS"))


def job_scope(environ: Mapping[str, str]) -> Dict[str, str]:
    """The partition, account and QOS a running job's environment names (a job it queues uses them)."""
    return {flag: environ[key] for flag, key in SCOPE_ENV if environ.get(key)}


def after_job_command(kind: str, module: str, run_dir: Path, dependency: str, folder: Path, python: str,
                      scope: Mapping[str, str], time_min: int, args: Sequence[str] = (),
                      begin: Optional[str] = None) -> List[str]:
    """The sbatch line of a one-node, one-task job of ``kind`` that runs ``python -m module run_dir
    args...`` once ``dependency`` (sbatch's, e.g. ``afterany:123``; empty: none) holds and ``begin``
    (sbatch's, e.g. ``now+60``) has come, never requeued, cancelled when the dependency can no longer
    hold, in ``scope`` (partition, account, QOS), its log in the submitit ``folder``."""
    cmd = ["sbatch", "--parsable", *([f"--dependency={dependency}"] if dependency else []),
           *([f"--begin={begin}"] if begin else []), "--kill-on-invalid-dep=yes", "--no-requeue",
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
