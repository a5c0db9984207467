"""The backend protocol, and what every backend shares (secrets passed through the submitting
environment, submitit's log paths, the grouping key)."""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import (
    TYPE_CHECKING,
    Any,
    Callable,
    Dict,
    FrozenSet,
    Iterable,
    Iterator,
    List,
    Mapping,
    Optional,
    Sequence,
    Tuple,
)

from launcher.run.job_record import JobRecord
from launcher.run.rundir import now_iso
from launcher.run.status import FINAL, Status
from launcher.sweeps import ArrayLimits

if TYPE_CHECKING:
    from launcher.config.schema import RunConfig
    from launcher.sweeps import ArrayLimits

# where a job's note for the step's teardown lives (launcher.runtime.after_step), exported by a batch
# script that runs a teardown after its step
NOTE_ENV = "LAUNCHER_REQUEUE_NOTE"
# a packed point's index, exported by the pack's runner (launcher.features.pack.runner) into the point's
# step: the backend's node side reads the step's place by it and leaves the point's requeues to the runner
PACK_STEP_ENV = "LAUNCHER_PACK_STEP"
# when an attempt's processes were started (epoch seconds), exported by whatever starts them (the local
# controller at each start, a Slurm batch script before its step, a pack's runner into each point's step):
# a rank's peer watch (launcher.runtime.watchdog) ignores the errors an earlier attempt left
STEP_START_ENV = "LAUNCHER_STEP_START"


@dataclass(frozen=True)
class JobState:
    """A job's state as the scheduler reports it (``raw``) and what it means for the run."""

    status: Status
    raw: str = ""

    @property
    def ended(self) -> bool:
        return self.status.value in FINAL


@dataclass(frozen=True)
class TaskPlace:
    """Where a process is in its job, as the scheduler that started it says (read on the node by
    launcher.runtime.env). ``job_id``: ``<array>_<task>`` for an array task; ``raw_job_id``: the
    scheduler's own id of this job (a task's own id: the rendezvous port is derived from it)."""

    rank: int
    world_size: int
    local_rank: int
    node_rank: int
    num_nodes: int
    hostnames: Tuple[str, ...]
    job_id: str
    raw_job_id: str
    array_job_id: Optional[str] = None
    array_task_id: Optional[str] = None


def env_int(environ: Mapping[str, str], key: str, default: int) -> int:
    """An integer the scheduler exported (``default`` where it is unset or not a number)."""
    value = str(environ.get(key) or "").strip()
    return int(value) if value.isdigit() else default



class NodeSide:
    """Every backend's node side; a scheduler's backend overrides what its jobs can tell."""

    name: str = ""

    # the scheduler's word for a run's processes, whose exit status a teardown puts in words
    step_word: str = "the step"
    # prefixes of the variables it sets in a job that shape its training, archived with the run's
    # (env/training-env.json: launcher.archive.secrets.training_env)
    env_prefixes: Tuple[str, ...] = ()

    # the exit status of a process whose job should start again (after request_requeue)
    requeue_exit_code: int = 1
    # whether every process of the job must exit for the job to start again (submitit's local
    # controller restarts a job once all its processes exited); Slurm's requeue ends them all itself
    every_rank_exits_to_requeue: bool = False

    def request_requeue(self, job_id: Optional[str]) -> None:
        """From inside the job: have the scheduler start this job again, in the same run dir."""
        raise NotImplementedError

    def requeue_without(self, job_id: Optional[str], nodes: Sequence[str], run_dir: Path) -> bool:
        """From inside the job, instead of ``request_requeue``: have the scheduler start this job again
        without ``nodes`` (the node ledger, launcher.features.nodes). False: this backend cannot (nothing
        was done; ``request_requeue`` follows)."""
        return False

    def partition_nodes(self, partition: Optional[str]) -> Optional[List[str]]:
        """The names of the nodes a job of ``partition`` may run on (None: unknown)."""
        return None

    # ---- the node side of a job's end (launcher.runtime.after_step runs these after the step) ----
    def requeued_since_start(self, job_id: Optional[str]) -> bool:
        """Whether this job was requeued since it started (a request already went through)."""
        return False

    def job_ending(self, job_id: Optional[str]) -> Optional[str]:
        """From inside the job, after a TERM: what the scheduler is doing with it. "requeued" (it starts
        again: a preemption that requeues, ``scontrol requeue``), "cancelled" (it ends for good:
        ``scancel``, an administrator, a preemption that cancels), "timeout" (its time limit); None:
        unknown, or the job is not ending (a TERM from elsewhere). A signal alone cannot tell a cancel
        from a preemption; the scheduler can."""
        return None

    def job_end(self, job_id: Optional[str]) -> Optional[float]:
        """From inside the job: when its time limit ends it, epoch seconds (None: unknown, or none)."""
        return None

    def step_deaths(self, job_id: Optional[str]) -> List[Tuple[str, int, str]]:
        """From inside the job, after its step: the tasks the scheduler saw end abnormally, as (node,
        task, how: "Killed", "Segmentation fault", "Exited with exit code 1"...); empty: unknown."""
        return []

    def lost_nodes(self, job_id: Optional[str]) -> Dict[str, str]:
        """From inside a job the scheduler restarted itself: the nodes it lost while the job last ran
        (down, not responding), each with the scheduler's reason; {}: none, or unknown."""
        return {}

    def job_state_now(self, job_id: Optional[str]) -> str:
        """From inside the job: the scheduler's word for it now (RUNNING, CANCELLED, NODE_FAIL, ...;
        "": unknown), so the step's teardown leaves a job the scheduler is ending to the scheduler."""
        return ""

    # ---- what a process of this scheduler's jobs reads of its job
    def detect(self, environ: Mapping[str, str]) -> bool:
        """Whether ``environ`` is that of a process of one of this backend's jobs."""
        return False

    def place(self, environ: Mapping[str, str]) -> TaskPlace:
        """This process's place in its job (rank, world, node, job ids), from ``environ``."""
        raise NotImplementedError

    def node_name(self, environ: Mapping[str, str]) -> Optional[str]:
        """The scheduler's name for this node (None: it has none, the hostname is the name). Nodes of
        one cluster may share a host (scripts/slurm-local.sh): this, not the hostname, tells them apart."""
        return None

    def address_hint(self, host: str, environ: Mapping[str, str]) -> Optional[str]:
        """``host``'s address where the job's environment says it, no question asked (None: not said)."""
        return None

    def ask_address(self, host: str) -> Optional[str]:
        """``host``'s address asked of the scheduler (one request: only one rank of a job asks, the others
        read its answer in the run dir); None: unknown."""
        return None

    def seal_after_job(self, run_dir: Path, job_id: Optional[str], folder: Path) -> Optional[str]:
        """From the job's teardown: have ``run_dir`` (a final run) sealed once this job has ended, off its
        allocation; the id of what will seal it, or None: not arranged (the login side's next refresh
        seals it, launcher.run.outcome). ``folder``: the job's submitit folder (logs)."""
        return None


@dataclass(frozen=True)
class Allocation:
    """What a job holds, read inside it (a pack's runner plans its points' steps on it): its id, its
    nodes, the CPUs of each, the GPUs of a node, a node's memory in bytes (None: not tracked)."""
    job_id: str
    hosts: List[str]
    cpus: List[int]
    gpus: int = 0
    mem_bytes: Optional[int] = None


@dataclass(frozen=True)
class Capability:
    """Something a scheduler may not be able to do, and the setting that asks for it."""
    flag: str  # the Backend attribute that declares it
    key: str  # the config key that asks for it
    asked: Callable[[Callable[[str], Any]], bool]  # from the config's values by dotted key
    needs: str  # what the setting needs of the scheduler, in words
    fix: str


CAPABILITIES: Tuple[Capability, ...] = (
    Capability("packs", "cluster.pack", lambda get: bool(get("cluster.pack")),
               "job steps inside one allocation, to pack points onto its nodes (launcher.features.pack.runner)",
               "set cluster.pack=false (each point its own job; cluster.array_parallelism bounds how many at once)"),
    Capability("elastic", "cluster.elastic.enabled", lambda get: bool(get("cluster.elastic.enabled")),
               "nodes to lose and regain, and a job queued after the run's job ends (launcher.features.elastic.resize)",
               "set cluster.elastic.enabled=false, or choose a backend that has it (e.g. cluster=local_slurm)"),
    Capability("pauses", "sweep.scheduler", lambda get: bool(get("sweep.scheduler")),
               "a point's job paused at a rung and started again (sweep=asha, sweep=pbt)",
               "drop the sweep option (every point runs train.steps), or choose a backend that pauses"),
)


class Backend(NodeSide):
    """A scheduler, as the launcher uses it: what it can do (the capabilities below), submission and
    its dry run, job states and cancel, packs, pauses and elastic jobs; the node side (a job's place,
    requeue and end) is ``NodeSide``'s."""

    name: str = ""
    waits: bool = False  # `launch` waits for the jobs unless submit.wait says otherwise
    shares_host_memory: bool = False  # its processes share the submitting host's memory (planner)
    max_nodes: Optional[int] = None  # the most nodes one job may span (None: as many as cluster.nodes asks)
    max_restarts: Optional[int] = None  # the most times it starts one job again (None: no limit of its own)
    # what it can do (CAPABILITIES): a setting that needs what the backend lacks is refused, naming its
    # key, before anything is queued (launcher.config.rules)
    packs: bool = False  # cluster.pack: ``pack_preview``, ``pack_executor``, ``allocation``, ``step_command``
    elastic: bool = False  # cluster.elastic: ``elastic_after_job``, ``usable_nodes``
    pauses: bool = False  # sweep=asha|pbt: ``pause``, ``resume_paused``, ``drop_paused``
    # a job queued to start once another has ended well (``after``): `launcher preflight` queues its
    # rungs at once; without it they run one after another, each started when the one before passed
    dependencies: bool = False
    # a sweep past its room queued in waves by its own jobs (launcher.submit.waves): ``wave_job``; without
    # it such a sweep is refused (a scheduler without submit limits never has one)
    waves: bool = False

    def lacks(self, get: Callable[[str], Any]) -> List[Tuple[str, str, str]]:
        """(key, problem, fix) of each setting of a config (its values by dotted key) that needs a
        capability this backend does not have."""
        return [(c.key, f"the {self.name} backend cannot do this: it needs {c.needs}", c.fix)
                for c in CAPABILITIES if c.asked(get) and not getattr(self, c.flag)]

    def after(self, job_id: str) -> List[str]:
        """The overrides that make a run's job start only once job ``job_id`` ended well (``dependencies``)."""
        raise NotImplementedError(f"the {self.name} backend queues no job after another")

    def host_has_gpus(self) -> bool:
        """Whether the jobs run on this host and it has NVIDIA GPUs they will use without being asked
        (local); False where the scheduler allocates GPUs only when asked (cluster.use_gpus)."""
        return False

    def host_gpu_count(self) -> Optional[int]:
        """The GPUs its jobs may use on this host, where they run here and it has GPUs; else None."""
        return None

    def host_cpu_flags(self) -> Optional[FrozenSet[str]]:
        """The /proc/cpuinfo flags of the CPU its jobs compute on, where that is known before submission
        (local: this host, when it has no GPUs); None elsewhere (other hosts, or GPUs)."""
        return None

    # executor parameters that name or throttle a submission rather than shape its resources: they
    # are the submission's (set by ``executor``), not a point's, and never split a sweep
    submission_parameters: FrozenSet[str] = frozenset({"job_name", "array_parallelism"})

    def parameters(self, cfg: RunConfig, code_dir: Optional[Path] = None) -> Dict[str, Any]:
        """The submitit executor parameters for one run config."""
        raise NotImplementedError

    def executor(self, cfg: RunConfig, folder: Path, code_dir: Optional[Path] = None, job_name: Optional[str] = None,
                 parallelism: Optional[int] = None) -> Any:
        """A submitit executor for this config, writing into ``folder``; ``job_name`` and ``parallelism``
        (tasks of one array at once) are the submission's, where the scheduler has them."""
        raise NotImplementedError

    def group_key(self, cfg: RunConfig) -> str:
        """Points with the same key share one submission (one Slurm array): equal resources. The job
        name and the throttle are the submission's, so points that differ only in name, model or
        hyper-parameters share one array."""
        params = self.parameters(cfg)
        key = self.name + ":" + repr(sorted((k, v) for k, v in params.items() if k not in self.submission_parameters))
        cl = getattr(cfg, "cluster", None)
        if cl is not None and hasattr(cl, "get") and cl.get("pack"):  # a pack is one job: its nodes are its own
            key += f":pack:{cl.get('pack_nodes')}"
        return key

    def runs_root_problem(self, runs_root: Path, cfg: Optional[RunConfig] = None) -> Optional[str]:
        """Why the jobs could not see ``runs_root`` (their run dirs are there), or None."""
        return None

    def request_problems(self, cfg: RunConfig) -> List[str]:
        """Why the scheduler could never run this request (``key: why``, one a line), asked once per
        submission group before anything is written: a job name or a runs root longer than it (or
        the file system) accepts; the Slurm backend adds a world larger than the cluster."""
        return request_limits(cfg, job_name_max=None)

    def jobs_in_folder(self, folder: Path) -> List[str]:
        """Ids of this user's queued jobs whose batch script lives in ``folder`` (a launch killed
        between sbatch and its record left them; launcher.submit.interrupted). Default: none known."""
        return []

    def array_limits(self, cfg: Optional[RunConfig] = None) -> ArrayLimits:
        """What the scheduler lets one launch submit (most tasks per array, most jobs queued per user,
        jobs this user has queued now); asked once per launch. ``cfg``'s cluster.max_array_size and
        cluster.max_submit_jobs, when set, replace what the scheduler would say (and spare asking it).
        Default: no limits of the scheduler's own."""
        return ArrayLimits().with_overrides(*limit_overrides(cfg))

    @contextlib.contextmanager
    def environment(self, cfg: RunConfig, code_dir: Optional[Path]) -> Iterator[None]:
        """The submitting process's environment while it submits (every backend passes it on):
        secret-named ``cluster.env`` values travel here, never in a script or the archive."""
        # lazy: the secret rules only for the job's environment, not on the plan/--help path
        from launcher.archive.secrets import is_redacted, is_secret

        saved_env, saved_cwd = dict(os.environ), os.getcwd()
        try:
            for k, v in dict(cfg.cluster.env).items():
                if is_secret(k) and not is_redacted(v):  # (a reproduction's archived config holds none)
                    os.environ[str(k)] = str(v)
            self._prepare(cfg, code_dir)
            yield
        finally:
            os.chdir(saved_cwd)
            os.environ.clear()
            os.environ.update(saved_env)

    def _prepare(self, cfg: RunConfig, code_dir: Optional[Path]) -> None:
        """Backend-specific changes to the submitting environment (undone after submission)."""

    def preview(self, cfg: RunConfig, folder: Path, points: List[int], code_dir: Optional[Path] = None,
                job_name: Optional[str] = None, parallelism: Optional[int] = None) -> str:
        """What a dry run prints for one submission group (the indices of its points)."""
        raise NotImplementedError

    def pack_preview(self, cfg: RunConfig, folder: Path, points: List[int], nodes: int, code_dir: Optional[Path] = None,
                     job_name: Optional[str] = None) -> str:
        """What a dry run prints for one pack (cluster.pack) of the points ``points`` on ``nodes`` nodes."""
        raise NotImplementedError(f"cluster.pack: the {self.name} backend cannot pack points")

    # a pack's job (launcher.features.pack.runner) on its first node: what it holds, and how it starts one
    # point's processes on some of its nodes as a step of its own
    def allocation(self, environ: Mapping[str, str]) -> Allocation:
        raise NotImplementedError(f"cluster.pack: the {self.name} backend cannot pack points")

    def step_command(self, command: List[str], need: Any, nodes: List[str], out: str, err: str, name: str,
                     host_mem: Optional[int] = None, shared_gpu: bool = False) -> List[str]:
        """The command that runs ``command`` as one point's step: ``need`` (launcher.features.pack.runner.Need)
        ranks on exactly ``nodes``, its output in ``out``/``err``, ``host_mem`` bytes of a node's memory
        per rank where known; ``shared_gpu``: its ranks may share a GPU with another point's."""
        raise NotImplementedError(f"cluster.pack: the {self.name} backend cannot pack points")

    def step_environment(self, environ: Mapping[str, str]) -> Dict[str, str]:
        """The environment a point's step starts with, from the pack job's own."""
        return dict(environ)

    def pack_node_limit(self, cfg: RunConfig) -> Optional[int]:
        """The most nodes a pack of ``cfg``'s points could get (its partition's nodes; None: unknown)."""
        return None

    def pack_executor(self, cfg: RunConfig, folder: Path, code_dir: Optional[Path], job_name: Optional[str],
                      nodes: int) -> Any:
        """An executor for one pack (cluster.pack): ``nodes`` whole nodes whose one batch process runs
        launcher.features.pack.runner's runner. Only a scheduler with job steps has one."""
        raise NotImplementedError(f"cluster.pack: the {self.name} backend cannot pack points")

    def job_record(self, job: Any, num_tasks: Optional[int] = None) -> JobRecord:
        """job.json of a job submitit submitted (its id read as this scheduler writes it)."""
        return JobRecord(backend=self.name, job_id=str(job.job_id), submitit_folder=str(job.paths.folder),
                         stdout=str(job.paths.stdout), stderr=str(job.paths.stderr), num_tasks=num_tasks,
                         submitted=now_iso())

    def submitted_script(self, job: Any) -> Optional[str]:
        """The text of the script submitit handed to the scheduler for ``job`` (None: no script)."""
        return None

    def states(self, jobs: Iterable[Dict[str, Any]]) -> Dict[str, JobState]:
        """State of each job (job.json records) the scheduler still knows, by job id."""
        raise NotImplementedError

    def cancel(self, job: JobRecord) -> None:
        raise NotImplementedError

    def cancel_all(self, jobs: List[JobRecord]) -> None:
        """Cancel these jobs (a sweep's), each ended when this returns; a scheduler that can cancel many
        at once overrides it. Default: one at a time."""
        for job in jobs:
            self.cancel(job)

    # ---- sweep=asha (launcher.features.asha.rungs): a point paused at a rung, then resumed or dropped ----
    # whether ``pause`` ends the job (its slot freed: Slurm); else a paused process may wait in place
    pause_ends_job: bool = False

    def pause(self, job_id: Optional[str]) -> None:
        """From inside the job, its run recorded ``paused``: end this job, freeing its slot, kept so
        that ``resume_paused`` can start it again. Default: nothing (the processes exit; a controller
        of the job waits for the decision)."""

    def resume_paused(self, job_id: Optional[str]) -> None:
        """Start a paused run's job again (its run is set ``requeued``; it resumes from its checkpoint).
        Default: nothing (the job's controller reads the run's status)."""

    def drop_paused(self, job_id: Optional[str]) -> None:
        """A paused run was pruned (final): its job will never run again. Default: nothing."""

    # cluster.elastic (launcher.features.elastic): a backend with ``elastic`` True has these
    def elastic_after_job(self, run_dir: Path, job_id: str, folder: Path, when: str = "afternotok",
                          scope: Optional[Mapping[str, str]] = None) -> str:
        """Queue the job that decides where run ``run_dir`` goes on after job ``job_id``; its id."""
        raise NotImplementedError(f"the {self.name} backend has no cluster.elastic")

    def cancel_helper(self, job_id: str, kind: str) -> bool:
        """Cancel a job of ``kind`` queued beside the runs' (a wave job); whether it was. Default: none."""
        return False

    def wave_job(self, sweep_dir: Path, after: Sequence[str], folder: Path, scope: Mapping[str, str],
                 begin: Optional[str] = None) -> str:
        """Queue the job that queues a sweep's next wave once jobs ``after`` have ended; its id."""
        raise NotImplementedError(f"the {self.name} backend has no waves")

    def usable_nodes(self, partition: Optional[str], own: Optional[str] = None) -> List[str]:
        """The nodes a job queued now could start on at once."""
        raise NotImplementedError(f"the {self.name} backend has no cluster.elastic")

    def ended_state(self, job_id: str) -> str:
        """The scheduler's word for a job that has ended ("": unknown)."""
        return ""

    # the scheduler's words in a job's logs, for `launcher doctor` (regular expressions; "" none):
    # a task killed by a signal (group ``task``: its rank), and a job the scheduler ended (group ``why``)
    killed_words: str = ""
    ended_words: str = ""

    def log_path(self, job: JobRecord, rank: int, err: bool = False) -> Path:
        """Where rank ``rank`` of a job writes its stdout (or stderr): submitit's naming."""
        from submitit.core.utils import JobPaths  # submitit: only to submit or read a job, not on the plan/--help path

        if job.pack_index is not None:  # a packed point's step writes its own (launcher.features.pack.runner)
            folder = Path(job.submitit_folder.replace("%j", job.job_id))
            return folder / f"{job.job_id}_pack{job.pack_index}_{rank}_log.{'err' if err else 'out'}"
        paths = JobPaths(job.submitit_folder, job_id=job.job_id, task_id=rank)
        return paths.stderr if err else paths.stdout


PATH_MAX, NAME_MAX = 4096, 255  # Linux's (and Slurm's MAXPATHLEN for --output/--chdir)
# the longest path the launcher writes under a runs root: <sweep>/<index>/ranks/..., submitit's logs
RUNS_ROOT_RESERVE = 256


def request_limits(cfg: RunConfig, job_name_max: Optional[int]) -> List[str]:
    """The bounds every backend shares (a runs root the file system can hold the runs in) and, where
    the scheduler has one, the job name's length."""
    out: List[str] = []
    submit = getattr(cfg, "submit", None)
    get = (lambda k: submit.get(k)) if submit is not None and hasattr(submit, "get") else (lambda k: None)
    name, root = get("job_name"), get("runs_root")
    if job_name_max is not None and name is not None and len(str(name).encode()) > job_name_max:
        out.append(f"submit.job_name: is {len(str(name).encode())} bytes; the scheduler accepts at most "
                   f"{job_name_max} (fix: a shorter name)")
    if root is not None:
        text = str(Path(str(root)).expanduser().absolute())
        long = [part for part in Path(text).parts if len(part.encode()) > NAME_MAX]
        if long:
            out.append(f"submit.runs_root: a path component is {len(long[0].encode())} bytes; the file system "
                       f"accepts at most {NAME_MAX} (fix: a shorter dir name)")
        elif len(text.encode()) + RUNS_ROOT_RESERVE > PATH_MAX:
            out.append(f"submit.runs_root: is {len(text.encode())} bytes; runs under it need paths up to "
                       f"{RUNS_ROOT_RESERVE} bytes longer, and {PATH_MAX} is the most a path may be "
                       "(fix: a shorter runs root)")
    return out


def limit_overrides(cfg: RunConfig):
    """(cluster.max_array_size, cluster.max_submit_jobs) of a run config (None: not set)."""
    cl = getattr(cfg, "cluster", None) if cfg is not None else None
    get = (lambda k: cl.get(k)) if cl is not None else (lambda k: None)
    size, jobs = get("max_array_size"), get("max_submit_jobs")
    return (int(size) if size else None), (int(jobs) if jobs else None)


def submitit_parameters(cl: Any) -> Dict[str, Any]:
    """``cluster.submitit_parameters``: executor parameters handed to submitit unchanged (absent from
    the schema: only the Hydra launcher sets them)."""
    raw = cl.get("submitit_parameters")
    if not raw:
        return {}
    from omegaconf import OmegaConf

    return dict(OmegaConf.to_container(raw, resolve=True)) if OmegaConf.is_config(raw) else dict(raw)
