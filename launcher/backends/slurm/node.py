"""The Slurm backend's node side: whether this process is a task of a Slurm job, its place in the job,
the node's name and a rendezvous host's address; a pack's allocation and a point's step (srun --exact)."""
from __future__ import annotations

import os
import re
import socket
import sys
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import launcher.backends.slurm.limits as limits
from launcher.backends.base import PACK_STEP_ENV, Allocation, TaskPlace, env_int
from launcher.backends.slurm.text import (
    PLACE_MODULE,
    PLACE_TIME_MIN,
    REQUEUE_NOTE_ENV,
    STEP_DROPPED,
    after_job_command,
    alias_addr,
    cpus_per_node,
    hostnames,
    job_scope,
)


class SlurmNode:
    """A Slurm task's environment (a mixin of SlurmBackend)."""

    # ---- a pack's job (launcher.features.pack.runner) on its first node: its allocation, a point's step ----
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
        m = re.search(r"\bNodeAddr=(\S+)", limits.run(["scontrol", "show", "node", host, "-o"]))
        return m.group(1) if m else None

    # ---- the node ledger (launcher.features.nodes): the requeued job's start leaves bad nodes out ----
    def requeue_without(self, job_id: Optional[str], nodes: Sequence[str], run_dir: Path) -> bool:
        """Slurm takes ExcNodeList only from a pending job: queue the one-task job that waits for this
        one to be pending, sets it and releases it (launcher.backends.slurm.place), then requeue this
        one held. A packed point's step: False (its pack's runner places it)."""
        if not job_id or not nodes or os.environ.get(PACK_STEP_ENV):
            return False
        note = os.environ.get(REQUEUE_NOTE_ENV)
        folder = Path(note).parent if note else Path(run_dir)
        cmd = after_job_command("place", PLACE_MODULE, Path(run_dir), "", folder, sys.executable,
                                job_scope(os.environ), PLACE_TIME_MIN, (str(job_id), ",".join(nodes)))
        self._sbatch(cmd)  # (SlurmJobs': raises RuntimeError where sbatch refuses it)
        self.pause(job_id)  # requeuehold: nothing starts it before the placing job has set ExcNodeList
        return True

    def step_deaths(self, job_id: Optional[str]) -> List[Tuple[str, int, str]]:
        """srun's own word on the tasks that ended abnormally (``srun: error: node2: task 1: Killed``),
        read from the end of the batch script's stderr (``scontrol show job``'s StdErr), where srun wrote
        it; empty: none, or not readable. A packed point's step: empty (the runner's file)."""
        if not job_id or os.environ.get(PACK_STEP_ENV):
            return []
        return srun_deaths(_stderr_tail(limits.run(["scontrol", "show", "job", "-o", str(job_id)])))

    def lost_nodes(self, job_id: Optional[str]) -> Dict[str, str]:
        """From inside a job Slurm requeued itself: the nodes it lost while the job's last run ended
        NODE_FAIL (that run's nodes with a down, drain or fail event from its start to its end:
        accounting's node events, else their state now), each with Slurm's reason; {}: none, or unknown."""
        if not job_id or os.environ.get(PACK_STEP_ENV):
            return {}
        run = last_node_fail(limits.run(["sacct", "-j", str(job_id), "--duplicates", "-X", "-n", "-P",
                                         "-o", "JobIDRaw,State,Start,End,NodeList"]))
        if run is None:
            return {}
        start, end, hosts = run
        events = limits.run(["sacctmgr", "-n", "-P", "show", "event", f"nodes={','.join(hosts)}", f"start={start}",
                             "format=NodeName,TimeStart,State,Reason"])
        lost = {n: why for n, at, why in node_events(events) if n in hosts and at <= end}
        if not lost:
            now = limits.run(["sinfo", "-h", "-N", "-n", ",".join(hosts), "-o", "%N|%T|%E"])
            lost = {n: why for n, _, why in node_events(now) if n in hosts}
        return lost


_BAD_NODE_STATE = re.compile(r"down|drain|fail|not_responding|no_respond", re.I)


def last_node_fail(sacct: str) -> Optional[Tuple[str, str, List[str]]]:
    """(start, end, nodes) of the last run that ended NODE_FAIL among ``sacct --duplicates -X -P -o
    JobIDRaw,State,Start,End,NodeList``'s lines; None: none did."""
    out = None
    for line in sacct.splitlines():
        parts = line.strip().split("|")
        if len(parts) >= 5 and parts[1].startswith("NODE_FAIL"):
            out = (parts[2], parts[3], hostnames(parts[4]))
    return out


def node_events(text: str) -> List[Tuple[str, str, str]]:
    """(node, time or state, reason) of each line ``NODE|TIME-OR-STATE|[STATE|]REASON`` that says the
    node went down, drained or failed (sacctmgr's node events, ``sinfo -N -o %N|%T|%E``)."""
    out = []
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) == 4 and _BAD_NODE_STATE.search(parts[2]):
            out.append((parts[0], parts[1], parts[3] or parts[2]))
        elif len(parts) == 3 and _BAD_NODE_STATE.search(parts[1]):
            out.append((parts[0], parts[1], parts[2] or parts[1]))
    return out


_SRUN_DEATH = re.compile(r"^srun: error: (?P<node>[^\s:]+): tasks? (?P<tasks>[\d,\-]+): (?P<how>.+?)\s*$", re.M)


def _stderr_tail(show_job: str, size: int = 65536) -> str:
    """The last ``size`` bytes of the batch script's stderr that ``scontrol show job -o`` names ("": none)."""
    m = re.search(r"\bStdErr=(\S+)", show_job)
    try:
        with open(m.group(1), "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - size))
            return f.read().decode(errors="replace")
    except (AttributeError, OSError):
        return ""


def srun_deaths(text: str) -> List[Tuple[str, int, str]]:
    """(node, task, how) of each ``srun: error: NODE: task N: HOW`` line (``tasks 0-1,3`` too), in order."""
    out: List[Tuple[str, int, str]] = []
    for m in _SRUN_DEATH.finditer(text):
        for part in m["tasks"].split(","):
            lo, _, hi = part.partition("-")
            if lo.isdigit() and (not hi or hi.isdigit()):
                out.extend((m["node"], t, m["how"]) for t in range(int(lo), int(hi or lo) + 1))
    return out
