"""Submission: staged runs out to the scheduler, the one way every launcher does it.

    group -> arrays (split under the scheduler's limits)  ->  one executor batch per array
          -> each run's JobRecord (job.json)  ->  the submitted script archived into each run
          -> submitit's scripts scrubbed of secrets  ->  the caller's publish

``launch -m`` (launcher.submit.pipeline), the Hydra-app launcher (hydra_plugins...generic) and
``launcher resume`` / ``retry`` (launcher.submit.resume) all go through ``arrays`` and ``submit``; they
differ only in what they stage (the Run each point becomes) and in how they publish. Executors,
job ids and submitted scripts are spelled here and in launcher/backends only.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Dict, Generic, Hashable, List, Optional, Sequence, Tuple, TypeVar

from launcher import backends
from launcher.archive import atomic, secrets
from launcher.config import schema
from launcher.features.elastic import resize as elastic
from launcher.run.job_record import JobRecord
from launcher.run.rundir import RunDir
from launcher.run.status import Status
from launcher.submit import signals
from launcher.submit.spread import in_processes
from launcher.sweeps import Unschedulable, first_points, plan_arrays, wave_cut

T = TypeVar("T")
SUBMIT_SCOPE = ("account", "partition", "qos")  # the cluster.* keys that choose which submit limits apply


@dataclass
class Array(Generic[T]):
    """One submission: points of one group, at most the scheduler's MaxArraySize of them, throttled
    to ``parallelism`` tasks at once (sbatch --array=0-<n-1>%<parallelism>)."""

    points: List[T]
    parallelism: int
    pack_nodes: Optional[int] = None  # cluster.pack: one job of this many nodes runs the points as job steps


def arrays(items: Sequence[T], cfg: Callable[[T], Any],
           key: Callable[[T], Hashable] = lambda _: None,
           preview: Optional[List[str]] = None, left: Optional[List[T]] = None) -> List[Array[T]]:
    """Points with the same backend grouping key (equal resources; and equal ``key``, e.g. their
    sweep dir) share one submission; each group split into arrays under its backend's limits
    (Backend.array_limits, asked once per backend; the smallest cluster.max_array_size /
    max_submit_jobs of the points override them), each group's throttle the smallest
    cluster.array_parallelism of its points. Raises launcher.sweeps.Unschedulable, before anything is
    written or submitted, when a request is one the scheduler could never run (Backend.request_problems:
    a world larger than the cluster, a job name too long), and its TooManyJobs when the points need
    more jobs than the scheduler will hold now. ``preview`` (a dry run's notes): planned from the limits
    alone, as if nothing were queued (a full cluster is when a user previews); the room the queue leaves
    at this moment, when smaller than the points, is a line appended to it. ``left`` (a list: the sweep is
    queued in waves, launcher.submit.waves): the points past the room are appended to it, in order, instead
    of TooManyJobs raised, and one slot of the room is kept for the wave job that queues them."""
    grouped: Dict[Tuple[str, Hashable, str], List[T]] = {}
    asks: Dict[Tuple[str, str, str, str], Any] = {}  # one config per request the scheduler is asked about
    for x in items:
        c = cfg(x)
        backend = backends.of(c)
        grouped.setdefault((backend.name, key(x), gk := backend.group_key(c)), []).append(x)
        submit = getattr(c, "submit", None)
        asks.setdefault((backend.name, gk, str(_get(submit, "job_name")), str(_get(submit, "runs_root"))), c)
    problems = list(dict.fromkeys(p for (name, *_), c in asks.items() for p in backends.get(name).request_problems(c)))
    if problems:
        raise Unschedulable("the scheduler could never run this; nothing was submitted:\n"
                            + "\n".join(f"  - {p}" for p in problems))
    out: List[Array[T]] = []
    packs = [g for g in grouped.values() if _packed(cfg(g[0]))]
    sized = [(g, pack_size([cfg(x) for x in g])) for g in packs]
    problems = [p for _, (_, probs) in sized for p in probs]
    if problems:
        raise Unschedulable("the scheduler could never run this; nothing was submitted:\n"
                            + "\n".join(f"  - {p}" for p in dict.fromkeys(problems)))
    # a pack is one job, whatever its points: one more job against the submit limits (sbatch judges)
    out.extend(Array(g, len(g), pack_nodes=nodes) for g, (nodes, _) in sized)
    by_backend: Dict[str, List[List[T]]] = {}
    for (name, _, _), g in grouped.items():
        if not _packed(cfg(g[0])):
            by_backend.setdefault(name, []).append(g)
    for name, gs in by_backend.items():
        cfgs = [cfg(x) for g in gs for x in g]
        overrides = {"max_array_size": _smallest(cfgs, "max_array_size"),
                     "max_submit_jobs": _smallest(cfgs, "max_submit_jobs")}
        # the account, partition and QOS pick the submit limits that apply; points that differ in them
        # are held to the tightest (every point's job counted against it)
        scopes = dict.fromkeys(tuple(c.cluster.get(k) for k in SUBMIT_SCOPE) for c in cfgs)
        asked = [SimpleNamespace(cluster={**overrides, **dict(zip(SUBMIT_SCOPE, s))}) for s in scopes]
        limits = min((backends.get(name).array_limits(a) for a in asked), key=lambda lim: lim.room)
        throttle = [min(int(cfg(x).cluster.array_parallelism) for x in g) for g in gs]
        if preview is not None:
            total = sum(len(g) for g in gs)
            if total > limits.room:
                preview.append(f"{max(int(limits.room), 0)} of these {total} points can be submitted at this moment "
                               f"({limits.bound}: {limits.queued} jobs queued now); " + (
                                   "the launch would queue the rest in waves" if left is not None else
                                   "the launch itself would be refused until the queue has room"))
            limits = replace(limits, queued=0)
        if left is not None and sum(len(g) for g in gs) > limits.room >= 1:  # (no room at all: refused)
            keep = first_points(gs, wave_cut(sum(len(g) for g in gs), limits.room))
            kept = {id(x) for g in keep for x in g}
            left.extend(x for g in gs for x in g if id(x) not in kept)
            gs, throttle = keep, throttle[:len(keep)]
        chunks = plan_arrays([len(g) for g in gs], limits, throttle)
        out.extend(Array(gs[ch.group][ch.start:ch.stop], ch.parallelism) for ch in chunks)
    return out


def _packed(c: Any) -> bool:
    cl = getattr(c, "cluster", None)
    return bool(cl is not None and hasattr(cl, "get") and cl.get("pack"))


def pack_size(cfgs: Sequence[Any]) -> Tuple[int, List[str]]:
    """The nodes of one pack (schema.pack_nodes; when not given, no more than its partition has) and
    why its points could never run in it (``key: why``): a point wider than the pack, a pack wider
    than the partition."""
    cl = cfgs[0].cluster
    nodes = schema.pack_nodes(cl, len(cfgs))
    limit = backends.of(cfgs[0]).pack_node_limit(cfgs[0])
    wide = max(int(c.cluster.nodes) for c in cfgs)
    if limit is not None and not cl.get("pack_nodes"):
        nodes = max(wide, min(nodes, limit))
    problems = []
    if wide > nodes:
        problems.append(f"cluster.pack_nodes: is {nodes}; a point asks cluster.nodes={wide} (fix: "
                        f"cluster.pack_nodes={wide} or more, or null)")
    if limit is not None and nodes > limit:
        problems.append(f"cluster.pack_nodes: asks {nodes} whole nodes; the partition has {limit} (sinfo; fix: "
                        f"cluster.pack_nodes={limit} or fewer, or null)")
    return nodes, problems


@dataclass
class Run:
    """One staged run, as submission needs it."""

    run_id: str
    rundir: RunDir  # where the job finds it
    task: Any  # what the job runs (launcher.runtime.task.RunTask, a Hydra app's job)
    cfg: Any  # the config its executor is made from (cluster.*, submit.job_name)
    code_dir: Path  # the code snapshot the job imports
    folder: Path  # submitit's folder
    shared: RunDir  # where an array's script is written once, to be linked into its runs
    stage: Optional[RunDir] = None  # where its records go now (a launch's hidden staging dir; default: rundir)
    num_tasks: Optional[int] = None
    earlier: Optional[JobRecord] = None  # the job of the run's previous attempt (resume, retry)

    @property
    def staged(self) -> RunDir:
        return self.stage if self.stage is not None else self.rundir


@dataclass
class SubmittedRun:
    run_id: str
    rundir: RunDir
    job_id: Optional[str] = None
    job: Any = None  # submitit's Job
    record: Optional[JobRecord] = None

    @property
    def run_dir(self) -> Path:
        return self.rundir.path


def _get(node: Any, key: str) -> Any:
    return node.get(key) if node is not None and hasattr(node, "get") else None


def _smallest(cfgs: Sequence[Any], key: str) -> Optional[int]:
    """The smallest cluster.<key> the points set, or None when none does."""
    values = [int(v) for v in (c.cluster.get(key) for c in cfgs) if v]
    return min(values) if values else None


def submit(planned: Sequence[Array[Run]], known: Dict[str, str],
           publish: Callable[[List[SubmittedRun], List[str]], Any],
           job_name: Callable[[Array[Run]], Optional[str]] = lambda _: None,
           refused: str = "submission failed",
           queued: Callable[[str, List[Run]], Any] = lambda _job_id, _runs: None,
           whole: bool = False,
           unsent: Optional[Callable[[List[Run], str], Any]] = None) -> Tuple[List[SubmittedRun], List[str]]:
    """Submit every array, in order; then ``publish(runs, job_ids)`` (on an error too, with the runs
    submitted so far). A refused array's runs are failed (``refused: <error>``) and every later
    array's "not submitted", unsealed (publish seals what ended), and SubmissionRefused is raised;
    ``whole`` (a launch: queued whole or not at all): the arrays queued before it are cancelled. SIGINT,
    SIGTERM and SIGHUP are held while an array is submitted and recorded (``queued(job_id, runs)`` is
    told the moment sbatch returns, before any run's job.json) and while publishing: an interrupt
    lands between arrays, the later arrays' runs are cancelled "not submitted", what was queued is
    published, and the interrupt is raised (``unsent``: what becomes of those runs instead, e.g. a sweep in
    waves puts them back to waiting). Returns the submitted runs and one job id per array."""
    signals.install()
    runs: List[SubmittedRun] = []
    job_ids: List[str] = []
    done = 0  # arrays submitted and recorded
    try:
        with atomic.deferred_sync(private=True):  # job.json of every run: flushed once, before publishing
            for i, arr in enumerate(planned):
                with signals.shielded():  # an sbatch and the record of what it queued: never one alone
                    try:
                        submitted = _submit_array(arr, known, job_name(arr), queued)
                    except Exception as e:
                        for r in arr.points:
                            r.staged.finish(Status.failed, seal=False, exit_code=None,
                                            error=secrets.scrub(f"{refused}: {e}", known))
                        for r in (r for later in planned[i + 1:] for r in later.points):
                            r.staged.finish(Status.failed, seal=False, exit_code=None, error=secrets.scrub(
                                f"not submitted: an earlier array of the sweep was refused ({e})", known))
                        said = f"{refused}: array {i + 1} of {len(planned)} ({len(arr.points)} run(s)) was refused: {e}"
                        if whole and runs:
                            said += "; " + _cancel_queued(planned[:i], job_ids, e, known)
                        raise SubmissionRefused(secrets.scrub(said, known)) from e
                    runs.extend(submitted)
                    job_ids.append(submitted[0].record.submission_id if len(submitted) > 1 else submitted[0].job_id)
                    done = i + 1
    except KeyboardInterrupt as e:  # Terminated too: held inside an array's submission, raised here
        with signals.shielded():
            why = f"not submitted: the launch was interrupted ({e or 'SIGINT received'})"
            later = [r for arr in planned[done:] for r in arr.points]
            if unsent is not None:
                unsent(later, why)
            for r in later if unsent is None else ():
                r.staged.finish(Status.cancelled, seal=False, exit_code=None, error=why)
        raise
    finally:
        with signals.shielded():  # half a publish hides runs whose jobs are queued
            publish(runs, job_ids)
    return runs, job_ids


class SubmissionRefused(RuntimeError):
    """The scheduler refused an array (sbatch failed); its runs and the later ones are recorded failed."""


def _cancel_queued(queued: Sequence[Array[Run]], job_ids: List[str], why: Exception, known: Dict[str, str]) -> str:
    """Cancel the arrays a refused launch had queued, their runs recorded cancelled; what was done."""
    backend = backends.of(queued[0].points[0].cfg)
    folder = str(queued[0].points[0].folder)  # the arrays' own batch scripts: the backend checks they are ours
    for job_id in job_ids:
        backend.cancel(JobRecord(backend=backend.name, job_id=job_id, submitit_folder=folder))
    for r in (r for arr in queued for r in arr.points):
        r.staged.finish(Status.cancelled, seal=False, exit_code=None, error=secrets.scrub(
            f"cancelled: a later array of the sweep was refused ({why}); a sweep is queued whole or not at all", known))
    return f"the {len(job_ids)} array(s) queued before it ({', '.join(job_ids)}) were cancelled: none of the sweep runs"


def _submit_array(arr: Array[Run], known: Dict[str, str], job_name: Optional[str],
                  queued: Callable[[str, List[Run]], Any]) -> List[SubmittedRun]:
    """One executor batch (one array job; a lone run, one job); ``queued`` told its id; each run's
    job.json and script."""
    first = arr.points[0]
    backend = backends.of(first.cfg)
    if arr.pack_nodes is not None:
        return _submit_pack(arr, known, job_name, queued)
    with backend.environment(first.cfg, first.code_dir):
        ex = backend.executor(first.cfg, first.folder, first.code_dir, job_name=job_name, parallelism=arr.parallelism)
        try:
            with ex.batch():
                jobs = [ex.submit(r.task) for r in arr.points]
        finally:  # submitit keeps the script it submitted (cluster.setup verbatim) in its folder
            secrets.scrub_files(Path(first.folder).glob("*.sh"), known)
    queued(backend.job_record(jobs[0]).submission_id, list(arr.points))
    script = backend.submitted_script(jobs[0])
    if script is not None:  # one script for the whole array: written once, linked into each run
        first.shared.write_script(secrets.scrub(script, known))

    records = [backend.job_record(job, run.num_tasks).after(run.earlier) for run, job in zip(arr.points, jobs)]

    def write(i: int) -> None:  # a run stays pending (no status.json) until it starts
        if script is not None:
            arr.points[i].staged.archive_script(first.shared)
        arr.points[i].staged.write_job(records[i])

    try:
        # staged runs are hidden until published: their job.json written in place, flushed once before
        with atomic.deferred_sync(private=all(r.stage is not None for r in arr.points)):
            in_processes(write, list(range(len(records))))
        submitted = [SubmittedRun(run_id=run.run_id, rundir=run.rundir, job_id=rec.job_id, job=job, record=rec)
                     for run, job, rec in zip(arr.points, jobs, records)]
    finally:  # each run holds its array's own; the next array writes a file of its own
        if script is not None:
            (first.shared.path / RunDir.SCRIPT).unlink(missing_ok=True)
    if elastic.settings(first.cfg)["enabled"]:
        _queue_elastic(backend, arr.points, submitted)
    return submitted


def _queue_elastic(backend: Any, points: Sequence[Run], submitted: Sequence[SubmittedRun]) -> None:
    """cluster.elastic: each run's deciding job, queued after its job (afternotok: it runs only where the
    job did not end well, launcher.features.elastic.regrow); a refusal is said, the run goes on without it."""
    cl = points[0].cfg.cluster
    scope = {k: str(cl.get(k)) for k in SUBMIT_SCOPE if cl.get(k)}
    for run, sub in zip(points, submitted):
        try:
            backend.elastic_after_job(run.rundir.path, sub.job_id, Path(run.folder), "afternotok", scope)
        except Exception as e:
            print(f"warning: {sub.run_id}: cluster.elastic's job was not queued ({e}): a lost node ends this run",
                  file=sys.stderr)


def _submit_pack(arr: Array[Run], known: Dict[str, str], job_name: Optional[str],
                 queued: Callable[[str, List[Run]], Any]) -> List[SubmittedRun]:
    """One pack (cluster.pack): ONE job whose runner starts each run as a job step (launcher.features.pack.runner);
    each run's job.json names the pack's job and the run's place in its queue (its logs are its own)."""
    from dataclasses import replace

    from launcher.features.pack.runner import Need, PackPoint, PackRunner, plan_memory  # lazy: only a pack needs it

    first = arr.points[0]
    backend = backends.of(first.cfg)
    points = []
    for i, r in enumerate(arr.points):
        cl = r.cfg.cluster
        plan = r.staged.plan()
        points.append(PackPoint(i, r.run_id, str(r.rundir.path), r.task, Need(
            nodes=int(cl.nodes), tasks=int(cl.gpus_per_node), cpus_per_task=int(cl.cpus_per_task),
            gpus=bool(cl.use_gpus), mem_per_task=plan_memory(plan))))
    gpu_mem = float(first.cfg.cluster.gpu.get("memory_gb") or 0) if first.cfg.cluster.get("gpu") else 0
    with backend.environment(first.cfg, first.code_dir):
        ex = backend.pack_executor(first.cfg, first.folder, first.code_dir, job_name, int(arr.pack_nodes or 1))
        try:
            job = ex.submit(PackRunner(points, str(first.folder), int(gpu_mem * (1 << 30)) or None, backend.name))
        finally:
            secrets.scrub_files(Path(first.folder).glob("*.sh"), known)
    record = backend.job_record(job)
    queued(record.job_id, list(arr.points))
    script = backend.submitted_script(job)
    if script is not None:
        first.shared.write_script(secrets.scrub(script, known))
    out = []
    try:
        for i, r in enumerate(arr.points):
            rec = replace(record, num_tasks=r.num_tasks, pack_index=i)
            rec = replace(rec, stdout=str(backend.log_path(rec, 0)), stderr=str(backend.log_path(rec, 0, err=True)))
            rec = rec.after(r.earlier)
            if script is not None:
                r.staged.archive_script(first.shared)
            r.staged.write_job(rec)
            out.append(SubmittedRun(run_id=r.run_id, rundir=r.rundir, job_id=rec.job_id, job=job, record=rec))
    finally:
        if script is not None:
            (first.shared.path / RunDir.SCRIPT).unlink(missing_ok=True)
    return out
