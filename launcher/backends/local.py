"""Local processes on this machine (submitit's LocalExecutor): the default, no cluster needed."""
from __future__ import annotations

import dataclasses
import os
import signal
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, Iterable, List, Mapping, Optional, Sequence

from launcher import host
from launcher.backends.base import Backend, JobState, TaskPlace, env_int, submitit_parameters
from launcher.config.recipe_target import is_script
from launcher.host import HOST_GPUS_ENV  # noqa: F401 (the backend's view of the host: launcher/host.py)
from launcher.run.job_record import JobRecord
from launcher.run.status import Status
from launcher.runtime import job_start, time_guard, warm_server, warm_start

if TYPE_CHECKING:
    from launcher.config.schema import RunConfig


def wait_for_local_ranks(rd: Any, timeout_s: float = 30.0) -> None:
    """The run's rank processes on this host that are still ending (a stopped rank may append its last
    metrics row on its way out): waited for (up to ``timeout_s``), so that a seal made next covers
    everything they wrote. Ranks on other hosts are the scheduler's to end."""
    host = socket.gethostname()
    procs = [(int(r["pid"]), r.get("process_start")) for r in rd.ranks()
             if r.get("hostname") == host and str(r.get("pid", "")).isdigit()]
    deadline = time.time() + timeout_s
    while any(same_process(p, start) for p, start in procs) and time.time() < deadline:
        time.sleep(0.2)


def process_start(pid: int, proc: str = "/proc") -> Optional[int]:
    """When process ``pid`` started, in clock ticks after boot (/proc/<pid>/stat, field 22): with the
    pid, the identity of a process (a pid is reused once its process is gone; the pair never is).
    None: no such process, or no /proc."""
    try:
        with open(f"{proc}/{pid}/stat", "rb") as fh:
            stat = fh.read()
    except OSError:
        return None
    # field 2 (the command name, in parentheses) may hold spaces and ')': count after the last ')'
    fields = stat.rpartition(b")")[2].split()
    try:
        return int(fields[19])  # fields[0] is field 3
    except (IndexError, ValueError):
        return None


def same_process(pid: int, start: Optional[int]) -> bool:
    """Whether ``pid`` is alive and is still the process that started at ``start`` (process_start);
    ``start`` None (a record from before start times were kept): the pid alone."""
    if not pid_alive(pid):
        return False
    return start is None or process_start(pid) == start


def signal_process(pid: int, start: Optional[int], sig: int) -> bool:
    """``sig`` to ``pid`` only while it is the process that started at ``start``; False (nothing sent)
    where it has gone or the pid now belongs to another process. The pid is pinned (pidfd) before its
    start time is compared, so it cannot be reused between the check and the signal."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return False
    except (AttributeError, OSError):  # no pidfd (an old kernel, not Linux): checked, then signalled
        fd = None
    try:
        if not same_process(pid, start):
            return False
        if fd is not None:
            signal.pidfd_send_signal(fd, sig)
        else:
            os.kill(pid, sig)
        return True
    except ProcessLookupError:
        return False
    finally:
        if fd is not None:
            os.close(fd)


class ServerChild:
    """What submitit's LocalJob and the launch's wait use of a ``subprocess.Popen``, for a controller the
    warm server forked (its child, not this process's: no exit status here, 0 once it is gone)."""

    def __init__(self, pid: int) -> None:
        self.pid, self._start = pid, process_start(pid)
        self.returncode: Optional[int] = None

    def poll(self) -> Optional[int]:
        if self.returncode is None and not same_process(self.pid, self._start):
            self.returncode = 0
        return self.returncode

    def send_signal(self, signum: int) -> None:
        signal_process(self.pid, self._start, signum)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cpu_flags(path: str = "/proc/cpuinfo") -> frozenset:
    """The CPU flags /proc/cpuinfo lists (those of its first processor; empty where it is missing)."""
    try:
        with open(path) as fh:
            for line in fh:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


VISIBLE_KEY = "cuda_visible_devices"  # a parameter of ours, not submitit's: GPUs named by UUID


def gpu_parameters(gpus_per_node: int, host_has_gpus: bool, visible_env: Optional[str]) -> Dict[str, Any]:
    """submitit's LocalExecutor sets CUDA_VISIBLE_DEVICES to the GPUs a job asks for (gpus_per_node,
    taken from visible_gpus): none asked is every GPU hidden, and the job would train on CPU. On a
    host with GPUs a job asks for one per process, from the ones this process may use. Those named by
    UUID (``GPU-...``, ``MIG-...``: MIG slices, some containers) are kept as they are written (the
    first ``gpus_per_node`` of them, under VISIBLE_KEY): visible_gpus takes integers only, and
    renumbering them 0..n-1 would hand the ranks GPUs they were not given."""
    if not host_has_gpus:
        return {}
    params: Dict[str, Any] = {"gpus_per_node": int(gpus_per_node)}
    entries = [x.strip() for x in (visible_env or "").split(",") if x.strip()]
    if entries and all(x.isdigit() for x in entries):
        params["visible_gpus"] = [int(x) for x in entries]
    elif entries:
        params[VISIBLE_KEY] = ",".join(entries[:int(gpus_per_node)])
    return params


# the job's controller: submitit's loop, then the decision the Slurm batch script's teardown makes
# when the processes ended with no rank's word (launcher.runtime.local_controller)
CONTROLLER = "launcher.runtime.local_controller"


def _executor_class(visible: Optional[str] = None, preload: Sequence[str] = warm_start.PRELOAD) -> Any:
    """submitit's LocalExecutor whose job controller is CONTROLLER (submitit's own started the same
    way: the environment it reads, the process whose pid is the job id). ``visible``: the
    CUDA_VISIBLE_DEVICES its processes get, verbatim (GPU-/MIG- UUIDs: submitit's visible_gpus
    takes integers only). Its controller imports ``preload`` once (warm_start.preload_for the recipe)
    and forks the processes from itself (launcher.runtime.warm_start)."""
    import subprocess
    import sys

    from submitit import LocalExecutor  # submitit: only to start ranks, not to read or wait for them
    from submitit.local.local import LocalJob

    class Executor(LocalExecutor):
        def _submit_command(self, command: str) -> Any:
            ntasks = self.parameters.get("tasks_per_node", 1)
            n_gpus = self.parameters.get("gpus_per_node", 0)
            ids = self.parameters.get("visible_gpus", ())
            gpus = range(n_gpus) if ids == () else ids[:n_gpus]
            env = dict(os.environ)
            env.update(
                SUBMITIT_LOCAL_NTASKS=str(ntasks), SUBMITIT_LOCAL_COMMAND=command,
                SUBMITIT_LOCAL_TIMEOUT_S=str(int(60 * self.parameters.get("timeout_min", 2.0))),
                SUBMITIT_LOCAL_SIGNAL_DELAY_S=str(int(self.parameters.get("signal_delay_s", 30))),
                SUBMITIT_LOCAL_NODEID="0", SUBMITIT_LOCAL_JOB_NUM_NODES="1",
                SUBMITIT_STDERR_TO_STDOUT="1" if self.parameters.get("stderr_to_stdout", False) else "",
                SUBMITIT_EXECUTOR="local",
                CUDA_VISIBLE_DEVICES=visible if visible is not None else ",".join(str(k) for k in gpus),
                SUBMITIT_LOCAL_WITH_SHELL="",
            )
            env[warm_start.PRELOAD_ENV] = ",".join(preload)
            # it outlives the launching process; the job (its pid) is polled and ended through LocalJob.
            # Forked from the warm server where the processes import torch (a new interpreter otherwise)
            pid = None
            if tuple(preload) == warm_start.PRELOAD:
                pid = warm_server.start_controller([CONTROLLER, str(self.folder)], env, warm_start.SERVER_PRELOAD)
            process: Any = ServerChild(pid) if pid is not None else \
                subprocess.Popen([sys.executable, "-m", CONTROLLER, str(self.folder)], env=env)  # noqa: S603
            return LocalJob(folder=self.folder, job_id=str(process.pid), process=process, tasks=list(range(ntasks)))

    return Executor


class LocalBackend(Backend):
    name = "local"
    waits = True
    shares_host_memory = True
    max_nodes = 1  # every process runs on this host
    max_restarts = 5  # submitit's local controller starts a job at most 6 times
    # a paused point's processes exit and its job's controller waits for the rung's decision; no packs
    # (every point is already processes of this host, cluster.array_parallelism at once), no nodes to
    # lose, no queue to wait in
    pauses = True

    def host_cpu_flags(self) -> Optional[frozenset]:
        return None if host.host_gpus() else cpu_flags()

    def host_has_gpus(self) -> bool:
        """Whether the processes compute on GPUs: GPUs that are there (LAUNCHER_HOST_GPUS=0 leaves them
        unused; a view of GPUs this host lacks runs its processes on the CPU: ``parameters``)."""
        simulated = host.simulated_gpus()
        return host.detected_gpus() > 0 and (simulated is None or simulated > 0)

    def host_gpu_count(self) -> Optional[int]:
        return host.host_gpus() or None

    def parameters(self, cfg: RunConfig, code_dir: Optional[Path] = None) -> Dict[str, Any]:
        cl = cfg.cluster
        simulated, real = host.simulated_gpus(), host.detected_gpus()
        if simulated is not None and simulated > real:  # a view of another host, run here for real
            host.say_once(f"{host.HOST_GPUS_ENV}={simulated} takes this host to have {simulated} GPU(s) and it has "
                          f"{real}: the {int(cl.gpus_per_node)} process(es) run on "
                          f"{'the CPU (gloo)' if not real else 'the GPUs it has'}")
        params = {"timeout_min": int(cl.time_min), "tasks_per_node": int(cl.gpus_per_node), "nodes": 1,
                  "signal_delay_s": int(cl.signal_delay_s)}
        params.update(gpu_parameters(int(cl.gpus_per_node), self.host_has_gpus(),
                                     os.environ.get("CUDA_VISIBLE_DEVICES")))
        if submitit_parameters(cl).get("stderr_to_stdout"):  # the one the local executor takes
            params["stderr_to_stdout"] = True
        return params

    def executor(self, cfg: RunConfig, folder: Path, code_dir: Optional[Path] = None, job_name: Optional[str] = None,
                 parallelism: Optional[int] = None) -> Any:
        params = self.parameters(cfg)
        preload = warm_start.preload_for(is_script(cfg.get("recipe")))
        ex = _executor_class(params.pop(VISIBLE_KEY, None), preload)(folder=folder, python=job_start.python_command())
        ex.update_parameters(**params)
        return ex

    def _prepare(self, cfg: RunConfig, code_dir: Optional[Path]) -> None:
        # local jobs inherit this process's working dir and PYTHONPATH: run them from the snapshot
        if code_dir is not None:
            os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(code_dir), os.environ.get("PYTHONPATH")]))
            os.environ["PYTHONDONTWRITEBYTECODE"] = "1"  # (slurm.code_lines says why)
            os.chdir(code_dir)

    def preview(self, cfg: RunConfig, folder: Path, points: List[int], code_dir: Optional[Path] = None,
                job_name: Optional[str] = None, parallelism: Optional[int] = None) -> str:
        return f"# ---- local: points {points}, {cfg.cluster.gpus_per_node} process(es) each"

    def job_record(self, job: Any, num_tasks: Optional[int] = None) -> JobRecord:
        """The job id is the pid of submitit's local controller; its start time is kept with it."""
        record = super().job_record(job, num_tasks)
        if not record.job_id.isdigit():
            return record
        return dataclasses.replace(record, process_start=process_start(int(record.job_id)))

    def states(self, jobs: Iterable[Dict[str, Any]]) -> Dict[str, JobState]:
        # the job id is the pid of submitit's local job process; once it is gone (or the pid is another
        # process's: its start time differs) the job has ended
        out = {}
        for job in jobs:
            pid = str(job.get("job_id") or "")
            if pid.isdigit():
                alive = same_process(int(pid), JobRecord.from_json(job).process_start)
                out[pid] = JobState(Status.running if alive else Status.failed, "RUNNING" if alive else "EXITED")
        return out

    def cancel(self, job: JobRecord, wait_s: float = 30.0) -> None:
        """SIGINT to submitit's local controller, as submitit's own LocalJob.cancel does: it then
        interrupts and kills its task processes (which, like Slurm tasks, ignore SIGTERM). Returns once
        the controller has exited (or after ``wait_s``)."""
        pid = job.job_id
        if not pid.isdigit() or not signal_process(int(pid), job.process_start, signal.SIGINT):
            return  # gone, or the pid now belongs to another process: nothing of the run's to stop
        deadline = time.time() + wait_s
        while same_process(int(pid), job.process_start) and time.time() < deadline:
            time.sleep(0.2)


    # submitit's local controller starts every process again when one exits with this status
    requeue_exit_code = 144  # submitit.local.local.LOCAL_REQUEUE_RETURN_CODE
    every_rank_exits_to_requeue = True

    def job_end(self, job_id: Optional[str]) -> Optional[float]:
        """When the controller's time limit (cluster.time_min) ends this start of the job."""
        try:
            return float(os.environ[time_guard.JOB_END_ENV])
        except (KeyError, ValueError):
            return None

    def request_requeue(self, job_id: Optional[str]) -> None:
        """Nothing to ask: the exit status (requeue_exit_code) is the request."""

    # ---- the node side (launcher.runtime.env): submitit's local environment of a process ----
    def detect(self, environ: Mapping[str, str]) -> bool:
        """submitit's local controller exports SUBMITIT_EXECUTOR=local (inside a Slurm allocation too)."""
        return environ.get("SUBMITIT_EXECUTOR") == self.name

    def place(self, environ: Mapping[str, str]) -> TaskPlace:
        """SUBMITIT_LOCAL_*: the controller's pid is the job id; every process on this host."""
        job = str(environ.get("SUBMITIT_LOCAL_JOB_ID") or "")
        return TaskPlace(rank=env_int(environ, "SUBMITIT_LOCAL_GLOBALID", 0),
                         world_size=env_int(environ, "SUBMITIT_LOCAL_NTASKS", 1),
                         local_rank=env_int(environ, "SUBMITIT_LOCAL_LOCALID", 0),
                         node_rank=env_int(environ, "SUBMITIT_LOCAL_NODEID", 0),
                         num_nodes=env_int(environ, "SUBMITIT_LOCAL_JOB_NUM_NODES", 1),
                         hostnames=(socket.gethostname(),), job_id=job, raw_job_id=job)


BACKEND = LocalBackend()
