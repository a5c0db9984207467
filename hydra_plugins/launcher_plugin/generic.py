"""A Hydra launcher for ANY Hydra app: ``hydra/launcher=launcher_slurm`` or ``hydra/launcher=launcher_local``.

Registered when Hydra scans the ``hydra_plugins`` namespace (the ConfigStore entries below run at
import; nothing of the project's ``launch`` app is imported). It runs the app's OWN task function on
the nodes, the way Hydra's own launchers do, and gives every point the archive a ``launch`` run gets:

login side (``launch``)
  compose each point once (launcher.config.compose.SweepComposer as ``load_sweep_config``: each combination
  of config-group choices composed by Hydra once, a point's values merged onto a copy; the config the
  node runs, ``now`` resolved as on the login side), a SweepDir (a multirun's later batches join its
  first one's) under ``runs_root`` with ONE code snapshot of the app's repo, then per
  point a staged RunDir: config.yaml (resolved, secrets redacted), overrides.yaml, seeds.json (when
  the app has ``seed``), run.json last (code and software records once, in the sweep's shared/);
  ONE submitit batch for all points (one Slurm array; several when the sweep is larger than the
  scheduler's MaxArraySize, the %k throttle shared out) through ``launcher.backends.get(...)``;
  job.json and the sbatch script; publish, sweep.json, the registry. ``wait: true`` (the default)
  then blocks for the jobs and returns each task's JobReturn in job-index order; ``wait: false`` returns at once, each
  JobReturn holding its run id.

node side (``_HydraJob.__call__``)
  the job's own stop-signal handlers (hydra_plugins.launcher_plugin.requeue), Hydra's singletons and
  resolvers as on the login side, the run dir's rank / node / environment records, the attempt
  (restarts.jsonl), status running, then ``hydra.core.utils.run_job`` on a copy of the point's config
  from the launch directory (so ``hydra.sweep.dir``/``subdir``, ``hydra.runtime.output_dir`` and
  ``hydra.job.chdir`` behave as with Hydra's launchers), the JobReturn pickled and kept, then status
  completed (the return value in the summary) or failed (the exception and its traceback), and the
  seal. Only the task's own exceptions (``sys.exit`` too) go back inside the JobReturn, naming the
  point; a signal requeues the point into the same run dir and output dir.

The pickled jobs hold the app's config (secrets included, as Hydra's own launchers' do), so
submitit's folder defaults to ``${hydra.sweep.dir}/.submitit``, outside ``runs_root``.
"""
# no `from __future__ import annotations`: Hydra's plugin scan executes this module before it is in
# sys.modules, where dataclasses cannot resolve string annotations
import contextlib
import inspect
import json
import logging
import os
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from hydra.core.config_store import ConfigStore
from hydra.core.utils import JobReturn, JobStatus
from hydra.plugins.launcher import Launcher
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

log = logging.getLogger(__name__)

PROVIDER = "launcher"


# ---- configuration --------------------------------------------------------------------------------


@dataclass
class BaseLauncherConf:
    """What both launchers take: every option of hydra-submitit-launcher's BaseQueueConf, with its
    meaning (so its configs carry over), and the archive's own."""

    # where the run archive goes; null: $LAUNCHER_RUNS, else ./runs (from the launch directory)
    runs_root: Optional[str] = None
    # block until every job ended and return their results (Hydra's launchers do); false: return
    # once queued, each JobReturn holding the run id
    wait: bool = True
    # submitit's folder (pickled jobs hold the app's config: keep it out of runs_root)
    submitit_folder: str = "${hydra.sweep.dir}/.submitit"
    name: str = "${hydra.job.name}"
    timeout_min: int = 60
    nodes: int = 1
    tasks_per_node: int = 1
    gpus_per_node: Optional[int] = None
    cpus_per_task: Optional[int] = None
    mem_gb: Optional[int] = None
    # one log per task: stderr into the stdout file
    stderr_to_stdout: bool = False
    # seconds before the time limit that the job gets its warning signal (USR2); one that does not fit
    # the limit (at or before the start) is cut to half the limit, with a warning
    signal_delay_s: int = 120
    # time limits a point may be requeued after (submitit's meaning: a preemption is always requeued,
    # a time limit only this many times; the app resumes from its own checkpoint, if it has one).
    # 3 as submitit's executors and launch's train.max_restarts (hydra-submitit-launcher: 0)
    max_num_timeout: int = 3
    # environment of every task (secret-named values travel through the submitting environment)
    env: Dict[str, str] = field(default_factory=dict)
    # tags recorded in each run.json (launcher runs --tag)
    tags: List[str] = field(default_factory=list)
    # set by `launcher reproduce`: the run id these runs reproduce (recorded in run.json), and the
    # archived code snapshot they run instead of a new snapshot of the working tree
    reproduces: Optional[str] = None
    code_snapshot: Optional[str] = None
    work_dir: Optional[str] = None  # a reproduction's writable copy of code_snapshot: what its jobs run
    # successive halving over the points ({}: none), as launch's sweep=asha (docs/sweeps.md):
    # {scheduler: asha, rungs: [steps], reduction: 3, mode: min|max, asynchronous: false}; the app
    # reports its objective with launcher.features.asha.rungs.at_step(step, value) after saving its checkpoint
    sweep: Dict[str, Any] = field(default_factory=dict)


@dataclass
class SlurmLauncherConf(BaseLauncherConf):
    """Every option of hydra-submitit-launcher's SlurmQueueConf, written into the sbatch script as
    submitit writes it, and the scheduler limits a sweep is split under."""

    _target_: str = "hydra_plugins.launcher_plugin.generic.SlurmLauncher"
    partition: Optional[str] = None
    account: Optional[str] = None
    qos: Optional[str] = None
    comment: Optional[str] = None
    constraint: Optional[str] = None
    exclude: Optional[str] = None
    gres: Optional[str] = None
    cpus_per_gpu: Optional[int] = None
    gpus_per_task: Optional[int] = None
    mem_per_gpu: Optional[str] = None
    mem_per_cpu: Optional[str] = None
    # shell lines run in the sbatch script before the job starts (module load, venv activation)
    setup: Optional[List[str]] = None
    # most array tasks running at once (sbatch --array=...%k; shared out when the sweep is split)
    array_parallelism: int = 256
    # most tasks per array / jobs queued per user; null: read from the scheduler (scontrol show config,
    # MaxArraySize and MaxSubmitJobs). A larger sweep goes out as several arrays.
    max_array_size: Optional[int] = None
    max_submit_jobs: Optional[int] = None
    # any other sbatch option, name -> value ({exclude: node3, mail-type: END}); true: a bare flag
    additional_parameters: Dict[str, Any] = field(default_factory=dict)


@dataclass
class LocalLauncherConf(BaseLauncherConf):
    _target_: str = "hydra_plugins.launcher_plugin.generic.LocalLauncher"


ConfigStore.instance().store(group="hydra/launcher", name="launcher_slurm", node=SlurmLauncherConf,
                             provider=PROVIDER)
ConfigStore.instance().store(group="hydra/launcher", name="launcher_local", node=LocalLauncherConf,
                             provider=PROVIDER)


# the SlurmQueueConf options that reach submitit as they are (its own sbatch flag writer)
SUBMITIT_SLURM_OPTIONS = ("comment", "exclude", "gres", "cpus_per_gpu", "gpus_per_task", "mem_per_gpu", "mem_per_cpu")


def signal_delay(params: Dict[str, Any]) -> int:
    """``signal_delay_s`` where it fits ``timeout_min``; one due at or before the start (120 s of a
    2 min limit: the job would be signalled before it could run) is cut to half the limit."""
    delay, limit_s = int(params.get("signal_delay_s") or 0), int(params.get("timeout_min") or 60) * 60
    if delay < limit_s:
        return delay
    cut = limit_s // 2
    log.warning(f"hydra.launcher.signal_delay_s={delay} does not fit hydra.launcher.timeout_min="
                f"{params.get('timeout_min')} ({limit_s} s): the warning signal comes {cut} s before the limit")
    return cut


def cluster_config(backend: str, params: Dict[str, Any]) -> DictConfig:
    """The plugin's parameters in the shape ``launcher.backends`` reads (``cluster.*``,
    ``submit.job_name``), every other key at the schema's default, so the backend builds the
    executor exactly as it does for ``launch`` runs. One task per process: ``gpus_per_node`` of a
    Slurm job is an sbatch option of its own, not the task count. What the schema has no key for
    (SUBMITIT_SLURM_OPTIONS, stderr_to_stdout, additional_parameters with their types: ``true`` is a
    bare flag) goes to submitit as given, in ``cluster.submitit_parameters``."""
    from launcher.config.schema import ClusterConfig

    extra: Dict[str, str] = {}
    gpus = params.get("gpus_per_node")
    if gpus:
        extra["gpus-per-node"] = str(int(gpus))
    raw: Dict[str, Any] = {k: params[k] for k in SUBMITIT_SLURM_OPTIONS if params.get(k) is not None}
    if params.get("stderr_to_stdout"):
        raw["stderr_to_stdout"] = True
    if params.get("additional_parameters"):
        raw["additional_parameters"] = {str(k): v for k, v in params["additional_parameters"].items()}
    cluster = OmegaConf.merge(OmegaConf.structured(ClusterConfig(name="hydra_app")), {
        "backend": backend,
        "nodes": int(params.get("nodes") or 1),
        "gpus_per_node": int(params.get("tasks_per_node") or 1),
        "cpus_per_task": int(params.get("cpus_per_task") or 1),
        "mem_gb": params.get("mem_gb"),
        "partition": params.get("partition"),
        "account": params.get("account"),
        "qos": params.get("qos"),
        "constraint": params.get("constraint"),
        "time_min": int(params.get("timeout_min") or 60),
        "signal_delay_s": signal_delay(params),
        "use_gpus": False,
        "setup": [str(s) for s in params.get("setup") or []],
        "env": {str(k): str(v) for k, v in (params.get("env") or {}).items()},
        "sbatch_extra": extra,
        "array_parallelism": int(params.get("array_parallelism") or 256),
        "max_array_size": params.get("max_array_size"),
        "max_submit_jobs": params.get("max_submit_jobs"),
    })
    OmegaConf.set_struct(cluster, False)
    cluster.submitit_parameters = raw
    return OmegaConf.create({"cluster": cluster, "submit": {"job_name": str(params.get("name") or "hydra_app")}})


def runs_root_of(params: Dict[str, Any]) -> Path:
    root = params.get("runs_root") or os.environ.get("LAUNCHER_RUNS") or "runs"
    return Path(str(root)).expanduser().resolve()


def source_root(task_function: Any, cwd: Path) -> Path:
    """The app's tree to snapshot: the git repo holding the task function's source file; else the
    git repo of the launch directory; else the top package directory of the task's module; else
    the launch directory."""
    from launcher.archive import code

    try:
        src = inspect.getsourcefile(inspect.unwrap(task_function))
    except TypeError:
        src = None
    here = Path(src).resolve().parent if src else None
    for start in filter(None, (here, cwd)):
        repo = code.repo_root(start)
        if repo is not None:
            return repo
    if here is not None:
        top = here
        while (top / "__init__.py").is_file() and (top.parent / "__init__.py").is_file():
            top = top.parent
        return top.parent if (top / "__init__.py").is_file() else top
    return cwd


def plain(value: Any) -> Any:
    """A return value as the JSON of status.json can hold it (numbers, strings, lists, dicts), else its repr."""
    if OmegaConf.is_config(value):
        value = OmegaConf.to_container(value, resolve=True)
    try:
        json.dumps(value, allow_nan=True)
        return value
    except (TypeError, ValueError):
        pass
    try:
        return float(value)  # numpy / torch scalars
    except (TypeError, ValueError):
        return repr(value)


def resolved_app_config(sweep_config: DictConfig) -> Dict[str, Any]:
    """The point's config without Hydra's node, resolved where it resolves (an interpolation only the
    node can resolve, ``${oc.env:...}`` of a variable set there, is archived as written)."""
    cfg = OmegaConf.masked_copy(sweep_config, [k for k in sweep_config.keys() if k != "hydra"])
    try:
        return OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    except Exception:
        return OmegaConf.to_container(cfg, resolve=False, enum_to_str=True)


SETUP_KEY = "hydra.launcher.setup"


def lifted_setup(params: Dict[str, Any], hydra_overrides: Sequence[str]) -> Tuple[List[str], Dict[str, str], List[str]]:
    """``hydra.launcher.setup`` lifted as ``cluster.setup`` is (launcher.archive.secrets.lift_shell,
    the backend writes the sbatch script from the same lines with the same names): the lines with
    each secret literal replaced by a reference to the ``LAUNCHER_SECRET_...`` variable that carries
    it; those variables (exported while the jobs are submitted: the jobs inherit them); and the
    launch's Hydra overrides with a ``hydra.launcher.setup=[...]`` given there written as the lifted
    lines (what run.json keeps and ``launcher reproduce`` passes again)."""
    from launcher.archive import secrets
    from launcher.config.compose import override_key

    lines = [str(x) for x in params.get("setup") or []]
    lifted, values = secrets.lift_shell(lines)
    if not values:
        return lines, {}, list(hydra_overrides)
    written = "[" + ",".join("'" + line.replace("'", "\\'") + "'" for line in lifted) + "]"
    overrides = [f"{o.split('=', 1)[0]}={written}" if "=" in o and override_key(o) == SETUP_KEY else o
                 for o in hydra_overrides]
    return lifted, values, overrides


@contextlib.contextmanager
def exported(values: Dict[str, str]) -> Any:
    """``values`` in this process's environment for the block (sbatch passes it on to the jobs),
    the environment as it was after it: the launch runs inside the user's app."""
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# ---- on the node ------------------------------------------------------------------------------------

# scheduler restarts a point may have (preemptions; time limits are bounded by max_num_timeout, as
# with submitit): a safety bound against a job that the scheduler restarts forever
_MAX_RESTARTS = 100


def _task(cfg: DictConfig) -> List[str]:
    """The point's task overrides as typed (launcher.config.compose.override_lines: never resolved)."""
    from launcher.config.compose import override_lines

    return override_lines(cfg.hydra.overrides.task)


def _point(cfg: DictConfig) -> str:
    """A point as Hydra's messages name it: its job number and task overrides."""
    return f"#{OmegaConf.select(cfg, 'hydra.job.num', default='?')} {_task(cfg)}"


def _failed_return(cfg: DictConfig, error: BaseException) -> JobReturn:
    """A FAILED JobReturn naming its point (overrides, configs): Hydra prints "Error executing job with
    overrides: [...]" when it re-raises the error on the login side."""
    return JobReturn(overrides=_task(cfg), cfg=_app_of(cfg), hydra_cfg=cfg,
                     task_name=str(cfg.hydra.job.name), status=JobStatus.FAILED, _return_value=error)



class _SharedState:
    """The app's task function, Hydra's context and Hydra's singletons: alike for every job of a batch,
    so pickled ONCE into a file beside submitit's (``write``); a job pickles only the file's path and
    loads it on the node (once per process). Pickling them with every job cost ~10 ms a job."""

    _loaded: Dict[str, Tuple[Any, Any, Dict[Any, Any]]] = {}

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def write(self, task_function: Any, hydra_context: Any, singleton_state: Dict[Any, Any]) -> "_SharedState":
        import cloudpickle

        tmp = Path(f"{self.path}.tmp")
        tmp.parent.mkdir(parents=True, exist_ok=True)
        try:  # the app's config, secrets included: no half-written copy is left behind
            with open(tmp, "wb") as f:
                cloudpickle.dump((task_function, hydra_context, singleton_state), f)
            os.replace(tmp, self.path)
        finally:
            tmp.unlink(missing_ok=True)
        self._loaded[self.path] = (task_function, hydra_context, singleton_state)
        return self

    def get(self) -> Tuple[Any, Any, Dict[Any, Any]]:
        got = self._loaded.get(self.path)
        if got is None:
            import pickle

            with open(self.path, "rb") as f:
                got = self._loaded[self.path] = pickle.load(f)
        return got


class _HydraJob:
    """What submitit pickles for one point: the point's composed config (kept pristine: every attempt
    runs a copy), its run dir and the batch's shared state (the task function, Hydra's context and
    state); on the node it runs ``run_job`` as Hydra's launchers do, inside the run's records and the
    requeue contract (hydra_plugins.launcher_plugin.requeue). ``resumed``: the callable the app's own
    checkpoint hook handed over, run instead of the task function."""

    def __init__(self, shared: _SharedState, config: DictConfig, run_dir: str, env: Dict[str, str],
                 backend: str = "local", timeout_min: float = 60, signal_delay_s: float = 0,
                 max_num_timeout: int = 0, resumed: Any = None) -> None:
        self.shared = shared
        self.config = config
        self.run_dir = str(run_dir)
        self.env = dict(env)
        self.backend = backend
        self.timeout_min, self.signal_delay_s = timeout_min, signal_delay_s
        self.max_num_timeout = int(max_num_timeout)
        self.resumed = resumed

    def __repr__(self) -> str:
        return f"_HydraJob({self.run_dir!r})"

    def resumed_with(self, callable_: Any) -> "_HydraJob":
        return _HydraJob(self.shared, self.config, self.run_dir, self.env, self.backend, self.timeout_min,
                         self.signal_delay_s, self.max_num_timeout, resumed=callable_)

    def __call__(self) -> JobReturn:
        import copy

        import submitit
        from hydra.core.singleton import Singleton
        from hydra.core.utils import run_job, setup_globals

        from hydra_plugins.launcher_plugin import requeue
        from launcher import backends
        from launcher.features.asha import rungs
        from launcher.run.rundir import RunDir
        from launcher.runtime import restarts
        from launcher.runtime.attempt import attempt

        backend = backends.get(self.backend)
        job_env = submitit.JobEnvironment()
        # first: a signal before the task starts is held, not submitit's (which would requeue a job
        # whose config Hydra made read-only)
        signals = requeue.StopSignals(self.timeout_min, self.signal_delay_s,
                                      stops=job_env.global_rank == 0 or backend.every_rank_exits_to_requeue)
        signals.install()
        task_function, hydra_context, singleton_state = self.shared.get()
        task = self.resumed if self.resumed is not None else task_function
        Singleton.set_state(singleton_state)
        setup_globals()
        rd = RunDir(self.run_dir)
        with attempt(rd, lambda _: (None, self.env)) as a:  # RANK, WORLD_SIZE, ...: an app may start torch.distributed
            config = copy.deepcopy(self.config)  # the next attempt starts from the pristine config
            with open_dict(config.hydra.job):
                config.hydra.job.id = job_env.job_id
            if a.ended:  # the scheduler started a job whose run has ended: what it ended with
                return self._ended(rd, config)
            n = restarts.begin_attempt(rd, _MAX_RESTARTS, a.denv.job_id) if a.denv.rank == 0 else 0
            a.running()
            if a.denv.rank == 0:  # what the step's teardown decides by if no process records an outcome
                restarts.leave_note(rd, n, None, a.denv.job_id, backend=backend.name, max_restarts=_MAX_RESTARTS)
            # Hydra's launchers run the job from the launch directory: a relative hydra.sweep.dir (and
            # the app's own relative paths) mean there what they meant at the command line
            os.chdir(str(config.hydra.runtime.cwd))
            while True:
                rungs.attach(rd, n, a.denv.job_id, a.denv.rank, a.denv.world_size)  # what at_step reports as
                try:
                    with signals.running():
                        ret = run_job(hydra_context=hydra_context, task_function=task, config=config,
                                      job_dir_key="hydra.sweep.dir", job_subdir_key="hydra.sweep.subdir")
                except requeue.Stopped as stop:
                    if rd.status().state.value != "paused":
                        self._record_environment(a)
                        return self._stopped(stop, a, rd, backend, n, task, config)
                    # the TERM of its own pause (Slurm's requeuehold ends the job): paused, not stopped
                    paused_at = int((rd.status().stop or {}).get("step") or 0)
                    ret = _failed_return(config, restarts.AtRung("wait", paused_at))
                except KeyboardInterrupt:  # cancelled (submitit's local cancel): the attempt records it
                    raise
                except BaseException as e:  # the task's own sys.exit (run_job catches its Exceptions) or Hydra's
                    ret = _failed_return(config, e)
                at_rung = ret._return_value if isinstance(ret._return_value, restarts.AtRung) else None
                if at_rung is None or at_rung.verdict != "wait" or backend.pause_ends_job:
                    break
                # paused where the job holds no queue's slot (local): this process waits for the rung's decision
                if rungs.wait_decision(rd) != "promoted":
                    at_rung = restarts.AtRung("pruned", at_rung.step)
                    break
                n = restarts.begin_attempt(rd, _MAX_RESTARTS, a.denv.job_id)  # the app resumes from its checkpoint
                a.running()
                os.chdir(str(config.hydra.runtime.cwd))
            self._record_environment(a)
            if at_rung is not None:  # paused at a rung (its job ends), or pruned (recorded)
                a.at_rung(at_rung.verdict, at_rung.step)
                if at_rung.verdict != "pruned":  # its job ends (Slurm holds it) and the next attempt's result
                    sys.stdout.flush()  # is the point's: no result of this one, which would read as the
                    sys.stderr.flush()  # point's end to whoever waits for the job (submitit's done())
                    os._exit(0)
                ret = JobReturn(overrides=ret.overrides, cfg=ret.cfg, hydra_cfg=ret.hydra_cfg, task_name=ret.task_name,
                                status=JobStatus.COMPLETED, _return_value=None)  # pruned: no value
            ret = self._write_result(ret, config)  # before the outcome: a result that cannot go back fails
            if ret.status != JobStatus.COMPLETED:
                err = ret._return_value
                a.rank_error("".join(traceback.format_exception(type(err), err, err.__traceback__))
                             if isinstance(err, BaseException) else str(err))
                self._others_recorded(rd, a.denv.world_size)
                a.fail(f"{type(err).__name__}: {err}", **self._dirs(ret, config), duration_s=a.duration_s)
            elif a.denv.rank == 0 and self._others_recorded(rd, a.denv.world_size):
                a.completed({"return_value": plain(ret._return_value)}, **self._dirs(ret, config),
                            attempt=n, restarts=len(rd.restarts()))
            return ret

    def _stopped(self, stop: Any, a: Any, rd: Any, backend: Any, n: int, task: Any, config: DictConfig) -> JobReturn:
        """A signal stopped the task: requeue the point (USR2) or leave it to the scheduler (TERM),
        after the app's checkpoint hook; once the time-outs allowed (max_num_timeout) are spent, the
        run timed out."""
        from hydra_plugins.launcher_plugin import requeue
        from launcher.run.status import Status
        from launcher.runtime import restarts

        print(f"launcher: run {rd.path}: {stop}", file=sys.stderr, flush=True)
        denv = a.denv
        if denv.rank != 0:  # every process exits for the job to start again (backend.every_rank_exits_to_requeue)
            a.requeued()
            raise SystemExit(backend.requeue_exit_code)
        detail = (f"{stop}; the point starts again from its config ({_point(config)})" if stop.requeues else
                  f"{stop}: the scheduler is ending the job (preemption, scontrol requeue or scancel)")
        timeouts = sum(1 for r in rd.restarts() if r.get("reason") == "time_limit")
        if stop.reason == "time_limit" and timeouts >= self.max_num_timeout:
            why = (f"time limit ({self.timeout_min} min): not requeued, {timeouts} time-out(s) requeued already "
                   f"(hydra.launcher.max_num_timeout={self.max_num_timeout})")
        else:
            why = requeue.save_checkpoint(task, _app_of(config), self.resumed_with)
        if why is None and not stop.requeues:  # TERM: the scheduler is ending the job and decides
            a.stopped(stop={"reason": stop.reason, "detail": detail, "rank": denv.rank, "step": None})
            raise SystemExit(1)
        if why is None:
            if restarts.request_requeue(rd, backend, attempt=n or 1, max_restarts=_MAX_RESTARTS, reason=stop.reason,
                                        detail=detail, rank=denv.rank, step=None, job_id=denv.job_id):
                a.requeued()
                raise SystemExit(backend.requeue_exit_code)
            why = f"the requeue was refused: {(rd.status().stop or {}).get('requeue_error')}"
        error = TimeoutError(f"point {_point(config)} (run {rd.run_id}): {why}")
        a.end(Status.timeout if stop.reason == "time_limit" else Status.failed, str(error), duration_s=a.duration_s)
        return self._write_result(_failed_return(config, error), config)

    @staticmethod
    def _ended(rd: Any, config: DictConfig) -> JobReturn:
        """A run that ended before this start (its job requeued after it finished): the JobReturn its
        ending attempt wrote, else a failure saying so."""
        import pickle

        import submitit

        for path in (_HydraJob._kept_result(), Path(submitit.JobEnvironment().paths.result_pickle)):
            try:
                with open(path, "rb") as f:
                    outcome, ret = pickle.load(f)
                if outcome == "success" and isinstance(ret, JobReturn):
                    return ret
            except Exception:  # no result file (or not ours): say what the archive says
                pass
        st = rd.status()
        return _failed_return(config, RuntimeError(f"point {_point(config)}: run {rd.run_id} already ended "
                                                   f"({st.state.value}{': ' + st.error if st.error else ''})"))

    @staticmethod
    def _kept_result() -> Path:
        """Where a job keeps its JobReturn until submitit writes its result file (whose appearance tells
        the launch that the job is done: it must not come before the outcome is recorded)."""
        import submitit

        path = Path(submitit.JobEnvironment().paths.result_pickle)
        return path.with_name(path.name + ".kept")

    @classmethod
    def _write_result(cls, ret: JobReturn, config: DictConfig) -> JobReturn:
        """The JobReturn, pickled and kept beside submitit's result file before the outcome is recorded
        (submitit writes the same once the job returns; a start after the run ended returns it): a
        return value (or exception) that cannot be pickled makes the point fail, saying so, instead of
        a run archived completed whose job failed."""
        import cloudpickle

        try:
            blob = cloudpickle.dumps(("success", ret))
        except Exception as e:
            what = "return value" if ret.status == JobStatus.COMPLETED else "exception"
            err = ret._return_value
            text = ("".join(traceback.format_exception(type(err), err, err.__traceback__))
                    if isinstance(err, BaseException) else repr(err))
            ret = _failed_return(config, RuntimeError(f"point {_point(config)}: its {what} cannot be pickled back "
                                                      f"to the launcher ({type(e).__name__}: {e}): {text[-2000:]}"))
            blob = cloudpickle.dumps(("success", ret))
        path = cls._kept_result()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(blob)
        os.replace(tmp, path)
        return ret

    @staticmethod
    def _others_recorded(rd: Any, world: int, timeout_s: float = 120.0) -> bool:
        """Rank 0 seals the run: first every task's rank record must be in (tasks start apart)."""
        deadline = time.time() + timeout_s
        while len(rd.ranks()) < world and time.time() < deadline:
            time.sleep(0.2)
        return True

    @staticmethod
    def _dirs(ret: JobReturn, config: DictConfig) -> Dict[str, Any]:
        """Hydra's output dir of the job (``hydra.runtime.output_dir``) and the working dir it ran in."""
        hydra_cfg = ret.hydra_cfg if ret.hydra_cfg is not None else config
        out = OmegaConf.select(hydra_cfg, "hydra.runtime.output_dir", default=None)
        return {"output_dir": None if out is None else str(out), "working_dir": ret.working_dir}

    @staticmethod
    def _record_environment(a: Any) -> None:
        """The training environment (rank 0), and torch / CUDA / NCCL as seen on the node when the
        app imported torch (importing it only to record its version would slow every job)."""
        if a.denv.rank != 0:
            return
        import platform

        from launcher.archive import topology

        runtime: Dict[str, Any] = {"python": platform.python_version(), "executable": sys.executable}
        if "torch" in sys.modules:
            runtime.update(topology.runtime_software())
        else:
            runtime["torch"] = "not imported by the app"
        a.record_environment(runtime)

    def checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        """submitit's hook, for a signal that comes before this job installs its own handlers: the job
        as submitted (its config still pristine) starts again."""
        import submitit

        return submitit.helpers.DelayedSubmission(self, *args, **kwargs)


# ---- on the login node ---------------------------------------------------------------------------


class _GenericLauncher(Launcher):
    backend_name = ""

    def __init__(self, **params: Any) -> None:
        self.params: Dict[str, Any] = {k: (OmegaConf.to_container(v, resolve=True) if OmegaConf.is_config(v) else v)
                                       for k, v in params.items()}
        self.config: Optional[DictConfig] = None
        self.hydra_context: Any = None
        self.task_function: Any = None
        self.into: Optional[Path] = None  # the multirun's sweep dir, made by its first batch

    def setup(self, *, hydra_context: Any, task_function: Any, config: DictConfig) -> None:
        self.config = config
        self.hydra_context = hydra_context
        self.task_function = task_function
        from launcher.config.compose import SweepComposer

        # Hydra's sweeper composes every point to validate the batch; composed once per combination of
        # group choices with the point's values merged on, and kept for launch() to take
        self.composer = SweepComposer.install(hydra_context.config_loader, fast=False)

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        from hydra.core.singleton import Singleton
        from hydra.core.utils import configure_log, filter_overrides, setup_globals

        assert self.config is not None and self.hydra_context is not None and self.task_function is not None
        setup_globals()
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        if "mode" in self.config.hydra.sweep and self.config.hydra.sweep.mode is not None:
            os.chmod(sweep_dir, int(str(self.config.hydra.sweep.mode), 8))
        log.info(f"launcher '{self.backend_name}': {len(job_overrides)} job(s), sweep output dir {sweep_dir}")
        configs = []
        self.composer.end()  # the sweeper's validation composed the points
        self.composer.expected = len(job_overrides)
        try:
            for i, overrides in enumerate(job_overrides):
                idx = initial_job_idx + i
                cfg = self.composer.take(self.config, list(overrides))
                with open_dict(cfg):
                    cfg.hydra.job.id = f"{cfg.hydra.job.name}_{idx}"
                    cfg.hydra.job.num = idx
                configs.append(cfg)
        finally:
            self.composer.end()
        from launcher.archive import secrets

        # as Hydra's launchers list the points, but a secret-named value given there is not printed
        apps = [resolved_app_config(c) for c in configs]
        known = secrets.known_secrets(apps)
        for i, overrides in enumerate(job_overrides):
            log.info(secrets.scrub(f"\t#{initial_job_idx + i} : {' '.join(filter_overrides(overrides))}", known))
        from launcher.submit import signals

        # SIGTERM/SIGHUP while the points are staged and queued: as Ctrl-C (what was queued published,
        # the rest cancelled), then the app's own handlers decide (handlers ours only for this block)
        with self.composer.removed(), signals.handled():  # Hydra's state travels to the nodes without it
            submitted = submit(self.backend_name, self.params, self.task_function, self.hydra_context, configs,
                               Singleton.get_state(), into=self.into, first_index=initial_job_idx, apps=apps)
        self.into = submitted.sweep_dir  # a later batch (Optuna's next trials) joins this sweep
        print(f"sweep {submitted.sweep_id}: {len(configs)} run(s) submitted ({self.backend_name}), "
              f"job(s) {', '.join(submitted.job_ids)}; archive {submitted.sweep_dir}", flush=True)
        if not bool(self.params.get("wait", True)):
            return [_queued(cfg, run_id) for cfg, run_id in zip(configs, submitted.run_ids)]
        return collect(submitted, configs)


class SlurmLauncher(_GenericLauncher):
    backend_name = "slurm"


class LocalLauncher(_GenericLauncher):
    backend_name = "local"


def _app_of(cfg: DictConfig) -> DictConfig:
    return OmegaConf.masked_copy(cfg, [k for k in cfg.keys() if k != "hydra"])


def _queued(cfg: DictConfig, run_id: str) -> JobReturn:
    """``wait: false``: the job is queued, its JobReturn holds the run id (launcher runs / status)."""
    return JobReturn(overrides=_task(cfg), cfg=_app_of(cfg), hydra_cfg=cfg,
                     working_dir=None, task_name=str(cfg.hydra.job.name), status=JobStatus.COMPLETED,
                     _return_value=run_id)


@dataclass
class Submitted:
    sweep_id: str
    sweep_dir: Path
    runs_root: Path
    run_dirs: List[Path]
    run_ids: List[str]
    job_ids: List[str]
    jobs: List[Any]


def _entry(fn: Any, root: Path) -> Dict[str, str]:
    """How to start the app again from its code snapshot (launcher reproduce): ``python -m <module>``
    (the task function's module; for an app started with ``python -m``, the module it was started
    as), or, for an app run as a script, ``python <script>`` with the script's path relative to the
    snapshot root."""
    module = str(getattr(fn, "__module__", "") or "")
    if module == "__main__":
        spec = getattr(sys.modules.get("__main__"), "__spec__", None)
        module = str(getattr(spec, "name", "") or "__main__")
    if module and module != "__main__":
        return {"module": module}
    try:
        src = Path(inspect.getsourcefile(fn) or sys.argv[0]).resolve()
    except TypeError:
        src = Path(sys.argv[0]).resolve()
    try:
        return {"script": str(src.relative_to(root.resolve()))}
    except ValueError:
        return {"script": str(src)}


def _schedule(params: Dict[str, Any]) -> Dict[str, Any]:
    """hydra.launcher.sweep, checked as launch checks sweep=asha ({}: none); refused naming the key."""
    from launcher.features.asha import schedule as asha

    raw = params.get("sweep") or {}
    sweep = dict(OmegaConf.to_container(raw, resolve=True)) if OmegaConf.is_config(raw) else dict(raw)
    if not sweep:
        return {}
    if sweep.get("scheduler") == "pbt":  # exploit loads another member's state into the app: its own format
        raise ValueError("hydra.launcher.sweep.scheduler: 'pbt' is not offered to a Hydra app (exploiting copies "
                         "another member's checkpoint and changes its config mid-run, which only the launcher's "
                         "step loop can do) (fix: scheduler: asha, or train through launch -m ... sweep=pbt)")
    if sweep.get("scheduler") != "asha":
        raise ValueError(f"hydra.launcher.sweep.scheduler: {sweep.get('scheduler')!r} is no scheduler "
                         "(fix: scheduler: asha)")
    sweep.setdefault("reduction", 3)
    rungs = [int(r) for r in sweep.get("rungs") or []]
    for key, problem, fix in asha.problems(sweep, max(rungs, default=1)):
        raise ValueError(f"hydra.launcher.{key}: {problem} (fix: {fix})")
    return sweep


def submit(backend_name: str, params: Dict[str, Any], task_function: Any, hydra_context: Any,
           configs: List[DictConfig], singleton_state: Dict[Any, Any], argv: Optional[List[str]] = None,
           into: Optional[Path] = None, first_index: int = 0,
           apps: Optional[List[Dict[str, Any]]] = None) -> Submitted:
    """Archive and submit the composed points as ONE submitit batch; the runs are visible (published
    and indexed) when this returns. ``into``: the sweep dir of the multirun's first batch, which
    these points join (its code snapshot, run indices from ``first_index``). ``apps``: each point's
    resolved_app_config, when the caller has it."""
    from launcher import backends
    from launcher.archive import atomic, registry, secrets, snapshot
    from launcher.config.compose import override_lines
    from launcher.run.checks_record import HYDRA_APP, ChecksRecord
    from launcher.run.rundir import SweepDir
    from launcher.run.status import Status
    from launcher.submit import interrupted, staging, submission
    from launcher.sweeps import Unschedulable

    backend = backends.get(backend_name)
    shim = cluster_config(backend.name, params)
    runs_root = runs_root_of(params)
    folder = Path(str(params.get("submitit_folder") or "")).expanduser()
    argv = list(sys.argv if argv is None else argv)

    # the scheduler's limits: a sweep too large is refused here, before anything is written
    indices = list(range(first_index, first_index + len(configs)))
    try:
        planned = submission.arrays(indices, cfg=lambda i: shim)
    except Unschedulable as e:  # TooManyJobs among them
        raise ValueError(f"hydra.launcher: {e}") from None
    schedule = _schedule(params)

    # hydra.launcher.setup as cluster.setup: a secret literal there travels in a LAUNCHER_SECRET_...
    # variable; the jobs' Hydra config (pickled, their .hydra/hydra.yaml) and run.json hold the reference
    setup, lifted, hydra_overrides = lifted_setup(params, override_lines(configs[0].hydra.overrides.hydra))
    if lifted:
        for cfg in configs:
            with read_write(cfg.hydra), open_dict(cfg.hydra):
                cfg.hydra.launcher.setup = setup
                cfg.hydra.overrides.hydra = hydra_overrides

    # create: the sweep dir and one code snapshot of the app's tree
    apps = apps if apps is not None else [resolved_app_config(c) for c in configs]
    root = source_root(task_function, Path.cwd())
    known = secrets.known_secrets(apps + [dict(params.get("env") or {}),
                                          {"cluster": {"setup": [str(x) for x in params.get("setup") or []]}}])
    known.update(snapshot.tree_secrets(root))
    sd = SweepDir(into) if into is not None else SweepDir.new(runs_root)
    if not folder.parts:
        folder = sd.submitit_folder
    folder = folder.resolve()  # the jobs run elsewhere (their run's work dir): never a relative path
    interrupted.begin(sd.path, backend.name, indices)  # before anything is staged: `launcher runs` repairs a kill
    staged: list = []
    try:
        # the code every point runs: a snapshot of the app's tree taken once (a later batch joins the first
        # one's), or the archived snapshot a reproduction runs again
        code_dir = Path(str(params["code_snapshot"])) if params.get("code_snapshot") else sd.code_dir
        if into is None and not params.get("code_snapshot"):
            for line in snapshot.left_out_warnings(snapshot.take(root, code_dir, known=known, exclude=[runs_root])):
                print(f"warning: {line}", file=sys.stderr)
        snap = snapshot.info(code_dir) or {}

        # stage (launcher.submit.staging, as `launch` stages): the code and software records once, in the
        # sweep's shared dir (linked into each run when it starts; a later batch joins the first's), then
        # each point's records
        clean = lambda obj: secrets.scrub_tree(obj, known)  # noqa: E731
        fn = inspect.unwrap(task_function)
        app_meta = {"task_function": f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', '?')}",
                    "config_name": configs[0].hydra.job.config_name, "source_root": str(root),
                    "entry": _entry(fn, root), "hydra_overrides": hydra_overrides}
        points: List[staging.Staged] = []
        for i, (cfg, app) in enumerate(zip(configs, apps), start=first_index):
            seed = app.get("seed") if isinstance(app, dict) else None
            if not isinstance(seed, int) or isinstance(seed, bool):
                seed = None
            points.append(staging.Staged(
                index=i, config=secrets.redact_config(app, known),
                seeds=None if seed is None else {
                    "seed": seed, "how": "the app's own `seed` key (the app seeds its RNGs from it)"},
                overrides={"overrides": _task(cfg), "choices": dict(OmegaConf.to_container(cfg.hydra.runtime.choices))},
                checks=ChecksRecord(HYDRA_APP),
                run={**({"reproduces": str(params["reproduces"])} if params.get("reproduces") else {}),
                     **({"work_dir": str(params["work_dir"])} if params.get("work_dir") else {}),
                     "run_id": sd.run_id(i), "sweep_id": sd.sweep_id, "index": i, "name": str(cfg.hydra.job.name),
                     "seed": seed, "tags": list(params.get("tags") or []), "backend": backend.name, "argv": argv,
                     "kind": "hydra_app", "app": app_meta,
                     **({"sweep": schedule} if schedule else {}),
                     "hydra": {"job_num": int(cfg.hydra.job.num),
                               "sweep_dir": str(Path(str(cfg.hydra.sweep.dir)).resolve()),
                               "subdir": str(cfg.hydra.sweep.subdir)}}))
        with atomic.deferred_sync(private=True):  # staged dirs are hidden: one flush, before any job may start
            if into is None:  # a later batch: the first one wrote them, and its runs may be reading them
                staging.write_shared(sd, code_dir, snap, known)
            staged.extend(staging.stage(sd, points, known))
    except BaseException:  # an error, Ctrl-C, SIGTERM before the first sbatch: as if never launched
        _undo(sd, indices, made=into is None, runs_root=runs_root)
        raise

    # submit: one batch (one array) per chunk of at most MaxArraySize points (launcher.submit.submission)
    env = {k: v for k, v in (params.get("env") or {}).items() if not secrets.is_secret(k)}
    num_tasks = int(params.get("nodes") or 1) * int(params.get("tasks_per_node") or 1)

    def publish(runs: List[submission.SubmittedRun], job_ids: List[str]) -> None:
        """Rename into place, seal what already ended, sweep.json, then the index."""
        published = [sd.publish(i) for i in indices]
        for rd in published:
            if rd.exists() and rd.is_final():
                rd.seal()
        sd.extend({"sweep_id": sd.sweep_id, "argv": clean(argv), "job_ids": job_ids, "backend": backend.name,
                   "runs": [sd.run_id(i) for i in indices], "code_snapshot": str(code_dir), "kind": "hydra_app"})
        registry.record(runs_root, [rd.path for rd in published if rd.exists()])
        interrupted.end(sd.path)  # every run published: nothing for `launcher runs` to repair

    try:
        state = _SharedState(folder / f"hydra_state_{sd.sweep_id}_{first_index}.pkl").write(
            task_function, hydra_context, singleton_state)
    except KeyboardInterrupt:
        _undo(sd, indices, made=into is None, runs_root=runs_root)
        raise
    except Exception as e:
        for rd in staged:
            rd.finish(Status.failed, seal=False, exit_code=None, error=secrets.scrub(f"submission failed: {e}", known))
        publish([], [])
        raise
    arrays_ = [submission.Array([submission.Run(
        run_id=sd.run_id(i), rundir=sd.run(i), stage=sd.staging(i), cfg=shim,
        code_dir=Path(str(params.get("work_dir") or code_dir)), folder=folder,
        task=_HydraJob(state, configs[i - first_index], str(sd.run(i).path), env, backend=backend.name,
                       timeout_min=int(shim.cluster.time_min), signal_delay_s=int(shim.cluster.signal_delay_s),
                       max_num_timeout=int(params.get("max_num_timeout", 3) or 0)), shared=sd.shared(),
        num_tasks=num_tasks) for i in arr.points], arr.parallelism) for arr in planned]
    with exported(lifted):  # the jobs inherit the variables their setup lines read
        runs, job_ids = submission.submit(
            arrays_, known, publish=publish,
            queued=lambda job_id, runs: interrupted.queued(sd.path, job_id,
                                                           [SweepDir.index_of(r.run_id) for r in runs]))
    return Submitted(sweep_id=sd.sweep_id, sweep_dir=sd.path, runs_root=runs_root,
                     run_dirs=[sd.run(i).path for i in indices], run_ids=[sd.run_id(i) for i in indices],
                     job_ids=job_ids, jobs=[r.job for r in runs])


def _undo(sd: Any, indices: List[int], made: bool, runs_root: Path) -> None:
    """A batch stopped before its first sbatch: its staged runs removed, and the sweep dir when this
    batch made it (a later batch of a multirun keeps the sweep its first batch made)."""
    import shutil

    from launcher.submit import interrupted, signals

    with signals.shielded():
        for i in indices:
            shutil.rmtree(sd.staging(i).path, ignore_errors=True)
        if made and sd.path.parent == runs_root:
            shutil.rmtree(sd.path, ignore_errors=True)
        else:
            interrupted.end(sd.path)


def _job_done(job: Any) -> bool:
    """A local job's processes have all ended (its controller too); a Slurm job: never said here (its
    requeue-held attempts look ended to submitit), the run's status decides."""
    process = getattr(job, "_process", None)
    return process is not None and process.poll() is not None


def collect(submitted: Submitted, configs: List[DictConfig]) -> List[JobReturn]:
    """Wait for every job; each point's JobReturn in job-index order (a job that died without one, a
    FAILED JobReturn holding the error)."""
    from launcher.archive import registry
    from launcher.features.asha import rungs
    from launcher.run.rundir import RunDir
    from launcher.run.status import Status
    from launcher.submit import progress

    out = []
    for cfg, job, run_id, run_dir in zip(configs, submitted.jobs, submitted.run_ids, submitted.run_dirs):
        rd = RunDir(run_dir)
        if rungs.rule_of(rd) is not None:  # hydra.launcher.sweep: a paused point's job ends and starts again,
            while not rd.is_final() and not _job_done(job):  # so its run says when the point has ended
                time.sleep(1.0)
            if rd.status().state is Status.pruned:  # pruned at a rung: no value (its held job was dropped)
                out.append(JobReturn(overrides=_task(cfg), cfg=_app_of(cfg), hydra_cfg=cfg,
                                     task_name=str(cfg.hydra.job.name), status=JobStatus.COMPLETED,
                                     _return_value=None))
                continue
        try:
            progress.wait_done(job, rd.is_final)  # a job that left no result: seen ended in seconds
            ret = job.results()[0]
        except Exception as e:  # killed, cancelled, node lost: no JobReturn came back
            ret = JobReturn(overrides=_task(cfg), cfg=_app_of(cfg), hydra_cfg=cfg,
                            task_name=str(cfg.hydra.job.name), status=JobStatus.FAILED,
                            _return_value=RuntimeError(f"point {_point(cfg)}: run {run_id}, job {job.job_id} ended "
                                                       f"without a result: {e}"))
        out.append(ret)
    registry.record(submitted.runs_root, submitted.run_dirs)  # the final statuses
    return out
