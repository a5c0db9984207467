"""The callable submitit runs in every task of a run: bootstrap, call the recipe, record the outcome.

It holds only the run dir; the config and the layout are read from what was archived there at launch
time, so the job runs exactly that (the node never recomputes the layout).
"""
from __future__ import annotations

import os
import socket
import sys
import traceback
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict

from hydra.utils import get_method

from launcher import backends
from launcher.archive import topology
from launcher.archive.secrets import scrub
from launcher.config.faults import requeue_step
from launcher.config.recipe_target import is_script
from launcher.config.schema import hang_timeout_s, startup_timeout_s, typed
from launcher.features.elastic.resize import GROW
from launcher.features.nodes import record as node_ledger
from launcher.features.pbt import population
from launcher.run.rundir import RunDir
from launcher.run.status import Status
from launcher.runtime import env as dist_env, restart_policy, restarts, script, teardown, time_guard, watchdog
from launcher.runtime.attempt import attempt, job_ending
from launcher.runtime.context import RunContext

if TYPE_CHECKING:
    from launcher.config.schema import RunConfig

# ProcessGroupNCCL's error handling switch, and its deprecated name: a value the user set is kept
NCCL_ERROR_HANDLING = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING")
FLIGHT_RECORDER = "TORCH_NCCL_TRACE_BUFFER_SIZE"  # > 0: each rank keeps its last N collectives
# where a dump goes (rank appended): torch's newer and older names
FLIGHT_RECORDER_FILE = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")


class RunTask:
    def __init__(self, run_dir: str):
        self.run_dir = str(run_dir)

    def __call__(self) -> Dict[str, Any]:
        return run(RunDir(self.run_dir))

    def __repr__(self) -> str:
        return f"RunTask({self.run_dir!r})"


def run(rd: RunDir) -> Dict[str, Any]:
    """The recipe, inside this rank's attempt (launcher.runtime.attempt): the attempt recorded, the
    hang watchdog, requeue on a failure or the time limit while the restart budget lasts."""
    rd = RunDir(rd.path.absolute())  # the job changes into the run's work dir below
    archived: Dict[str, Any] = {}

    def settings(rd: RunDir):
        archived.update(population.apply(rd, rd.config()))  # sweep=pbt: the member's explored values now
        cluster = archived.get("cluster", {})
        return cluster.get("master_port"), cluster.get("env") or {}

    with attempt(rd, settings) as a:
        if a.ended:  # the scheduler started a job whose run has ended (e.g. requeued after a cancel)
            return rd.status().summary or {}
        # the run's own working dir: relative paths of every point of a sweep would otherwise land in
        # the sweep's shared code snapshot (the job's start dir), overwriting each other (recipe=script's
        # script starts in its launch dir in the run's mirror of the snapshot: runtime.script.work_dir)
        rd.work_dir.mkdir(exist_ok=True)
        os.chdir(rd.work_dir)
        denv, cluster, train = a.denv, archived.get("cluster", {}), archived.get("train", {})
        backend = backends.get(str(cluster.get("backend", "local")))
        max_restarts = int(train.get("max_restarts", 0))
        stop_flag = restarts.StopFlag().install()
        n: Dict[str, int] = {"n": 0}

        def requeue(reason: str, detail: str, step: Any = None, failure: Any = None) -> bool:
            asked = restarts.request_requeue(rd, backend, attempt=n["n"] or 1, max_restarts=max_restarts,
                                             reason=reason, detail=scrub(detail, os.environ), rank=denv.rank,
                                             step=step, job_id=denv.job_id, failure=failure)
            if asked:
                a.requeued()
            return asked

        def on_hang(message: str) -> int:
            if rd.is_final():
                return 1
            a.rank_error(message, echo=False)
            node_ledger.note_hang(archived, rd, rd.hang(), denv.rank, dist_env.node_name(), n["n"] or 1,
                                  denv.job_id)
            if requeue("hang", message):
                return backend.requeue_exit_code
            a.fail(message)
            return 1

        # on by default on several nodes (schema.hang_timeout_s): a lost peer there often blocks the others
        hang_s = hang_timeout_s(train, int(cluster.get("nodes") or 1))
        own_process = is_script(archived.get("recipe"))  # recipe=script: the user's script runs as a process
        startup_s = startup_timeout_s(train, int(cluster.get("nodes") or 1), own_process)
        watch = watchdog.start(rd, denv.rank, world=denv.world_size, hang_timeout_s=float(hang_s), on_hang=on_hang,
                               startup_timeout_s=float(startup_s))
        if denv.rank == 0:  # (a script's ranks import no torch: its own process imports what it uses)
            a.record_environment(topology.runtime_software(import_torch=not own_process))
        try:
            if denv.rank == 0:
                n["n"] = restarts.begin_attempt(
                    rd, max_restarts, denv.job_id, world=denv.world_size,
                    hosts=denv.hostnames if len(denv.hostnames) == denv.num_nodes else None)
                a.running()
                node_ledger.note_lost(archived, rd, backend, n["n"], denv.job_id)  # a node Slurm lost under it
                # the note the step's teardown decides by when no rank records an outcome (runtime.after_step)
                restarts.leave_note(rd, n["n"], None, denv.job_id, backend=backend.name, max_restarts=max_restarts)
            summary = _run_recipe(rd, archived, denv, watch, stop_flag, n)
        except restarts.AtRung as e:  # sweep=asha: paused or pruned at a rung (recorded by features.asha.rungs)
            watch.set()
            a.at_rung(e.verdict, e.step)
            return {}
        except restarts.Interrupted as e:  # signalled; the recipe saved a checkpoint at a step boundary
            watch.set()
            if e.reason == GROW:  # cluster.elastic: nodes are back; the job queued after this one grows the run
                a.ended_to_grow(e.step)
                return {}
            detail = script.stop_detail(e.reason, e.step) if own_process else \
                f"{e.reason.replace('_', ' ')} signal, checkpoint saved after step {e.step}"
            if e.reason == node_ledger.STRAGGLER:  # saved; its node (noted in the ledger) is left out
                detail = f"{e.why or 'a straggler'}; checkpoint saved after step {e.step}"
            if e.reason in ("time_limit", node_ledger.STRAGGLER):
                if requeue(e.reason, detail, e.step):
                    raise SystemExit(backend.requeue_exit_code) from None
                if e.reason == node_ledger.STRAGGLER:
                    a.fail(detail + "; not requeued: the restart budget is spent")
                else:
                    a.end(Status.timeout, detail + "; restart budget spent")
            else:  # TERM: the scheduler is ending the job (preemption, requeue or cancel): asked which
                a.after_term(job_ending(backend, denv.job_id),
                             {"reason": e.reason, "detail": detail, "rank": None, "step": e.step})  # no rank failed
            raise SystemExit(1) from None
        except BaseException as e:  # record, then re-raise so the task exits non-zero
            watch.set()
            a.rank_error(traceback.format_exc())
            error = scrub(f"{type(e).__name__}: {e}", os.environ)
            refused: Dict[str, Any] = {}
            ending = (job_ending(backend, denv.job_id)
                      if stop_flag.reason == "preempted" and not isinstance(e, SystemExit) else None)
            if ending is not None:  # the job's TERM came first: this error is its echo (a peer gone
                a.after_term(ending, {"reason": "preempted", "rank": denv.rank, "step": watch.step,  # with it)
                                      "detail": f"preempted signal, then {error}"})
                raise
            if not isinstance(e, (KeyboardInterrupt, SystemExit)):
                # a failure the next attempt would repeat ends the run now (launcher.runtime.restart_policy)
                failure, decision = restart_policy.judge(rd, e, error, attempt=n["n"] or int(rd.status().attempt or 1),
                                                         watch_step=watch.step, since=a.t0, node=dist_env.node_name())
                if failure.kind == "node_fault":  # the node's, not the program's: the ledger keeps it
                    node_ledger.note(archived, rd, failure.node, node_ledger.kind_of(error), attempt=failure.attempt,
                                     job_id=denv.job_id, rank=denv.rank, step=failure.step,
                                     detail=node_ledger.fault_detail(error))
                if decision.restart and requeue("failure", f"rank {denv.rank}: {error}", failure.step,
                                                failure.to_json()):
                    raise SystemExit(backend.requeue_exit_code) from e
                if not decision.restart and restarts.budget_left(rd, max_restarts):
                    refused = {"no_restart": decision.to_json()}
                    error = f"{error} (not restarted: {decision.why})"
            # the first rank to fail holds the root cause; the others fail because it went away
            if isinstance(e, KeyboardInterrupt):
                a.end(Status.cancelled, error, failed_rank=denv.rank)
            else:
                a.fail(error, **refused)
            raise
        finally:
            watch.set()
        a.completed(summary, attempt=n["n"], restarts=len(rd.restarts()))
        return summary


def _select_device(cfg: RunConfig, denv) -> bool:
    """Bind this rank to its GPU (True), or stay on CPU (False) where no GPU was promised; a job that
    was promised GPUs and has none fails here, with the reason, instead of training on CPU."""
    import torch  # torch: only on the node

    visible_env = os.environ.get("CUDA_VISIBLE_DEVICES")
    cl = cfg.cluster
    backend = backends.get(str(cl.backend))
    promised = "cluster.use_gpus=true" if bool(cl.use_gpus) else \
        "this host has NVIDIA GPUs (cluster=local uses them)" if backend.host_has_gpus() else ""
    problem = dist_env.cuda_problem(bool(promised), torch.cuda.is_available(), torch.version.cuda, visible_env,
                                    promised)
    if problem:
        raise dist_env.DeviceError(problem)
    if not torch.cuda.is_available():
        return False
    index = dist_env.device_index(denv.local_rank, denv.local_world_size, torch.cuda.device_count(), visible_env)
    torch.cuda.set_device(index)
    if index != denv.local_rank:  # one GPU per task: libraries that pick the device by LOCAL_RANK
        os.environ["LOCAL_RANK"] = str(index)  # (DeepSpeed) must pick the one this task sees
    # TF32 matmuls for fp32 (MFU is reported against the 16-bit peak); precision.tf32=false for exact fp32
    tf32 = bool(cfg.precision.get("tf32", True))
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = tf32
    return True


def nccl_env(environ: Dict[str, str], run_dir: Path) -> Dict[str, str]:
    """What a rank on NCCL adds to its environment before its process group (pure): error handling 2 (a
    failed or timed-out collective aborts the communicator and raises in Python, where the run records it
    and asks for the requeue; 1 and 3 end the process in C++, with no word) unless set; with the flight
    recorder on (TORCH_NCCL_TRACE_BUFFER_SIZE, the GPU templates), its dumps in the run dir's stacks/
    beside the hang watchdog's, not in the node's /tmp."""
    out: Dict[str, str] = {}
    if not any(k in environ for k in NCCL_ERROR_HANDLING):
        out[NCCL_ERROR_HANDLING[0]] = "2"
    if str(environ.get(FLIGHT_RECORDER, "0")).strip() not in ("", "0"):
        for key in FLIGHT_RECORDER_FILE:
            if key not in environ:
                out[key] = str(Path(run_dir) / "stacks" / "nccl_trace_rank_")
    return out


def _run_recipe(rd: RunDir, cfg_plain: Dict[str, Any], denv, watch, stop_flag,
                attempt: Dict[str, int]) -> Dict[str, Any]:
    if is_script(cfg_plain.get("recipe")):  # the script makes its own process group (docs/scripts.md)
        return script.run(rd, cfg_plain, denv, watch, stop_flag, attempt)
    # torch: only on the node
    import torch
    import torch.distributed as dist

    cfg = typed(cfg_plain)
    layout = rd.layout()
    if layout.world_size != denv.world_size:  # the scheduler gave another shape than was archived
        raise RuntimeError(f"the job has {denv.world_size} processes but the archived layout needs "
                           f"{layout.world_size} (dp {layout.dp} x pp {layout.pp} x tp {layout.tp})")
    use_cuda = _select_device(cfg, denv)
    if bool(cfg.train.get("deterministic", False)):
        dist_env.deterministic_kernels()
    backend = "nccl" if use_cuda else "gloo"
    if use_cuda:
        added = nccl_env(dict(os.environ), rd.path)
        os.environ.update(added)
        if any(k in added for k in FLIGHT_RECORDER_FILE):
            (rd.path / "stacks").mkdir(exist_ok=True)
    device = f"cuda:{torch.cuda.current_device()}" if use_cuda else "cpu"
    dist.init_process_group(
        backend=backend,
        init_method="env://",
        rank=denv.rank,
        world_size=denv.world_size,
        timeout=timedelta(seconds=int(cfg.train.dist_timeout_s)),
        # NCCL communicators are created at once, on this device (not lazily at the first collective)
        **({"device_id": torch.device(device)} if use_cuda else {}),
    )
    dist.barrier()  # rank 0 has recorded this attempt (before it joined the rendezvous)
    watch.progress()  # the process group is up and its first collective done (the start-up watch)
    attempt["n"] = int(rd.status().attempt or 1)
    # rank 0 stops the run before its time limit where a save like the last would not fit the warning's margin
    guard = time_guard.start(backends.get(str(cfg.cluster.backend)), denv.job_id, float(cfg.cluster.signal_delay_s),
                             stop_flag) if denv.rank == 0 else None
    ctx = RunContext(
        rank=denv.rank,
        world_size=denv.world_size,
        local_rank=denv.local_rank,
        local_world_size=denv.local_world_size,
        node_rank=denv.node_rank,
        hostname=socket.gethostname(),
        rundir=rd,
        layout=layout,
        device=device,
        backend=backend,
        attempt=attempt["n"],
        watch=watch,
        stop_flag=stop_flag,
        stop_after=requeue_step(cfg.train, attempt["n"]),
        time_guard=guard,
        stragglers=node_ledger.Stragglers(
            cfg_plain, rd, denv.rank, denv.world_size, dist_env.node_name(), attempt=attempt["n"],
            job_id=denv.job_id, can_requeue=restarts.budget_left(rd, int(cfg.train.max_restarts))),
    )
    try:
        recipe = get_method(cfg.recipe._target_)
        summary = recipe(cfg, ctx) or {}
        dist.barrier()
    except Exception as e:
        if ctx.abort_on_error and not isinstance(e, (restarts.Interrupted, restarts.AtRung)):
            print(f"rank {denv.rank}: {type(e).__name__}: {e}: aborting (abort_on_error)", file=sys.stderr, flush=True)
            os.abort()  # as ProcessGroupNCCL's teardown: no handler runs, no outcome recorded
        if not isinstance(e, (restarts.Interrupted, restarts.AtRung)):
            # the save in flight is in host memory: written and committed before this rank's failure (which
            # ends the others, their writer threads with them) is recorded; the next attempt resumes from it
            saver = sys.modules.get("launcher.training.async_save")
            if saver is not None:
                saver.settle_in_flight()
        raise
    finally:
        if guard is not None:
            guard.close()
        teardown.step(ctx.close, "closing the run context")
        if dist.is_initialized():
            teardown.step(dist.destroy_process_group, "destroying the process group")
    return summary
