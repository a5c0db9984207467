"""One attempt of a run on the node: what every job does around whatever it runs (the recipe, a
Hydra app's task function).

    with attempt(rd, settings) as a:     wait for the run dir, detect the distributed environment,
                                          adopt the sweep's shared files (rank 0), record the rank
                                          and the node (its local rank 0)
        if a.ended: return ...            (the scheduler started a job whose run has ended)
        a.running()                       rank 0: status running
        ... run it ...
        a.completed(summary) / a.fail(error) / a.end(Status.timeout, ...) / a.stopped(...)

Every status change a job makes goes through the Attempt; an exception that leaves the block with
no outcome recorded fails the run (rank error and status), so no job ends without saying why.

What each rank does to the shared run dir here costs the same at 8 ranks as at 4,096: the run's
shared records are written once (rank 0), the node's topology once per node (local rank 0), and each
rank's own record in one create and one rename, unflushed (RunDir.write_rank).
"""
from __future__ import annotations

import contextlib
import os
import socket
import sys
import time
import traceback
from typing import Any, Callable, Dict, Iterator, Mapping, Optional, Tuple

from launcher.archive import secrets, topology
from launcher.archive.secrets import from_env_reference, is_redacted, scrub, scrub_tree
from launcher.backends.local import process_start
from launcher.features.elastic.resize import GROW
from launcher.run.rundir import RunDir, now_iso
from launcher.run.status import Status
from launcher.runtime import env as dist_env, warm_start

# what a job reads from its run dir before it knows its place: (master port, environment variables)
Settings = Callable[[RunDir], Tuple[Optional[int], Mapping[str, Any]]]


def wait_for(rd: RunDir, timeout_s: float = 120.0) -> None:
    """The launcher makes the run dir visible right after submission returns; a task can start first."""
    deadline = time.time() + timeout_s
    while not rd.exists():
        if time.time() > deadline:
            raise FileNotFoundError(f"run dir {rd.path} never appeared (was the launch interrupted?)")
        time.sleep(0.2)


class Attempt:
    """This rank's part of the run's current attempt: its place (``denv``) and its records."""

    def __init__(self, rd: RunDir, denv: Any) -> None:
        self.rd, self.denv = rd, denv
        self.ended = rd.is_final()  # nothing to run: the run ended before this job started
        self.job_ids = {"job_id": denv.job_id, "array_job_id": denv.array_job_id,
                        "array_task_id": denv.array_task_id}
        self.t0 = time.time()  # when it started (epoch: metrics rows after it are this attempt's)
        self._started = time.monotonic()  # its duration: a clock that never steps back
        self.recorded = False  # an outcome (or a stop) was recorded by this rank

    @property
    def duration_s(self) -> float:
        return round(time.monotonic() - self._started, 3)

    def record_rank(self) -> None:
        d = self.denv
        self.rd.write_rank(d.rank, {
            "rank": d.rank, "local_rank": d.local_rank, "node_rank": d.node_rank, "hostname": socket.gethostname(),
            "slurmd_nodename": dist_env.scheduler_node_name(), "pid": os.getpid(),
            "process_start": process_start(os.getpid()), "job_id": d.job_id,
            "array_job_id": d.array_job_id, "array_task_id": d.array_task_id, "master_addr": d.master_addr,
            "master_port": d.master_port, "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "started": now_iso(),
        })

    def record_node(self) -> None:
        """The node's topology, once per node (its local rank 0)."""
        if self.denv.local_rank == 0:
            self.rd.write_topology(dist_env.node_name(), self.denv.node_rank, topology.gather())

    def record_environment(self, runtime: Dict[str, Any]) -> None:
        """The training environment (secrets redacted) and the runtime software, once (rank 0)."""
        if self.denv.rank == 0:
            backend = dist_env.scheduler()  # its own variables too (Slurm's SLURM_*)
            prefixes = backend.env_prefixes if backend is not None else ()
            self.rd.write_environment(secrets.training_env(os.environ, prefixes), runtime)

    def running(self, **extra: Any) -> None:
        if self.denv.rank == 0:
            self.rd.set_status(Status.running, **self.job_ids, hosts=self.denv.hostnames,
                               world_size=self.denv.world_size, **extra)

    def rank_error(self, text: str, echo: bool = True) -> str:
        """This rank's error (a traceback), printed to its log and, unless another rank recorded the
        outcome already (and sealed), kept as its rank error; returns it scrubbed of secrets."""
        if echo:
            print(text, file=sys.stderr, flush=True)
        text = scrub(text, os.environ)  # a secret in an exception message stays out of the archive
        if not self.rd.is_final():
            self.rd.write_rank_error(self.denv.rank, text)
        return text

    def end(self, status: Status, error: str, **extra: Any) -> bool:
        """A final outcome this rank saw (failed, cancelled, timeout), with the error; the seal. A job
        requeued since it started (its ASHA pause's requeuehold, a requeue racing the end) is dropped
        from the queue: nothing will run in it again."""
        self.recorded = True
        done = self.rd.finish_in_job(status, exit_code=1, error=scrub(error, os.environ), **{**self.job_ids, **extra})
        if done:
            from launcher import backends
            from launcher.runtime.after_step import drop_requeued_job

            drop_requeued_job(self.rd, backends.get(self.rd.backend_name()), self.denv.job_id)
        return done

    def fail(self, error: str, **extra: Any) -> bool:
        """This rank failed (the first rank to fail holds the root cause: a later one changes nothing)."""
        return self.end(Status.failed, error, failed_rank=self.denv.rank, **extra)

    def completed(self, summary: Dict[str, Any], **extra: Any) -> bool:
        """Rank 0, when no rank recorded an error: the run completed (and is sealed)."""
        self.recorded = True
        if self.denv.rank != 0 or self.rd.failed_ranks():
            return False
        summary = scrub_tree(summary, os.environ)  # a recipe may return what it was given (a secret too)
        return self.rd.finish_in_job(Status.completed, exit_code=0, summary=summary, duration_s=self.duration_s,
                              **{**self.job_ids, **extra})

    def stopped(self, **extra: Any) -> None:
        """Stopped for the scheduler to decide what follows (preemption, requeue, cancel): requeued."""
        self.recorded = True
        self.rd.set_status(Status.requeued, **extra)

    def after_term(self, ending: Optional[str], stop: Dict[str, Any]) -> None:
        """A TERM ended this rank's work (``stop``: its reason, step, detail). The scheduler, not the
        signal, tells what it was (``ending``: ``job_ending``'s answer): a job ending for good
        (scancel, an administrator, a preemption that cancels) ends the run ``cancelled`` (its time
        limit: ``timeout``) and nothing requeues it; a requeued job, or one the scheduler cannot
        answer for, is left ``requeued`` for the next attempt to resume."""
        if ending in ("cancelled", "timeout"):
            why = ("the scheduler ended the job for good (scancel, an administrator or a preemption that "
                   "does not requeue)" if ending == "cancelled" else "the job reached its time limit")
            self.end(Status.cancelled if ending == "cancelled" else Status.timeout,
                     f"{why}; stopped after step {stop.get('step')}", stop={**stop, "scheduler": ending})
        else:
            self.stopped(stop=stop)

    def at_rung(self, verdict: str, step: int) -> None:
        """sweep=asha: the run stopped at a rung, paused or pruned (rank 0 recorded which,
        launcher.features.asha.rungs); the job ends cleanly."""
        self.recorded = True
        if self.denv.rank == 0:
            print(f"run {self.rd.path}: {'paused' if verdict == 'wait' else verdict} at rung step {step}", flush=True)

    def ended_to_grow(self, step: int) -> None:
        """cluster.elastic: nodes are back; every rank stopped at the checkpoint after ``step``; rank 0 records
        the run requeued to grow, for the job queued after this one (launcher.features.elastic.decide); the job
        ends cleanly."""
        self.recorded = True
        if self.denv.rank == 0:
            self.rd.set_status(Status.requeued, stop={"reason": GROW, "rank": 0, "step": step, "detail": (
                f"nodes back: the job ended at the checkpoint after step {step} to grow")})
            print(f"run {self.rd.path}: ended at the checkpoint after step {step} to grow back", flush=True)

    def requeued(self) -> None:
        """The next attempt was asked for (launcher.runtime.restarts.request_requeue)."""
        self.recorded = True


def job_ending(backend: Any, job_id: Optional[str]) -> Optional[str]:
    """``Backend.job_ending``: what the scheduler does with this job after its TERM (None: unknown)."""
    try:
        return backend.job_ending(job_id)
    except Exception:  # the scheduler did not answer: its own end of the job decides
        return None


def _early_failure(rd: RunDir, tb: str) -> None:
    """A rank that fails before it knows its place: its traceback as a rank error (rank from the
    job's environment), the run failed."""
    try:  # the scheduler's word (its backend reads it); failing that, torchrun's
        backend = dist_env.scheduler()
        rank = backend.place(os.environ).rank if backend is not None else int(os.environ["RANK"])
    except Exception:  # not in a job (or its environment is what failed)
        rank = int(os.environ["RANK"]) if os.environ.get("RANK", "").isdigit() else 0
    print(tb, file=sys.stderr, flush=True)
    if not rd.is_final():
        rd.write_rank_error(rank, scrub(tb, os.environ))
        rd.finish_in_job(Status.failed, exit_code=1, error=scrub(tb.strip().splitlines()[-1], os.environ),
                         failed_rank=rank)


@contextlib.contextmanager
def attempt(rd: RunDir, settings: Optional[Settings] = None) -> Iterator[Attempt]:
    """Wait for the run dir, detect the distributed environment (``settings``: the master port and
    the environment variables the job sets, read from the run dir) and export it; rank 0 adopts the
    sweep's shared files; then record this rank and its node (unless the run has ended already).
    An exception that leaves the block with no outcome recorded fails the run."""
    wait_for(rd)
    try:
        port, env = settings(rd) if settings is not None else (None, {})
        # a job started for a run that ended (cancelled while queued, then started before the
        # scheduler dropped it) writes nothing into its sealed dir: no address file, no records
        ended = rd.is_final()
        denv = dist_env.detect(master_port=port, addr_file=None if ended else rd.master_addr_path)
        if denv.rank == 0 and not ended:  # the sweep's code and software records, the point's seeds and
            rd.adopt_shared()  # overrides, once: until then the other ranks read the sweep's own
    except BaseException:  # before any watch starts: recorded, so that the other ranks' watches end them
        _early_failure(rd, traceback.format_exc())  # (instead of their waiting in the rendezvous)
        raise
    denv.export()  # RANK, WORLD_SIZE, MASTER_ADDR/PORT
    for k, v in (env or {}).items():
        v = from_env_reference(v, os.environ)  # a secret: a reference to the variable that carries it
        if v is not None and not is_redacted(v):  # (the submitting environment), never the archive
            os.environ.setdefault(str(k), str(v))  # before torch loads (OMP_NUM_THREADS etc.)
    warm_start.apply_thread_settings(os.environ)  # or after, in a process forked with torch loaded
    a = Attempt(rd, denv)
    if a.ended:
        print(f"run {rd.path} already ended ({rd.status().state.value}): nothing to do", flush=True)
    else:
        a.record_rank()
        a.record_node()
    try:
        yield a
    except BaseException as e:
        if not a.recorded and not a.ended:
            error = f"{type(e).__name__}: {e}"
            a.rank_error(traceback.format_exc())
            a.end(Status.cancelled if isinstance(e, KeyboardInterrupt) else Status.failed, error, failed_rank=denv.rank)
        raise
