"""The callable submitit runs in every task of a run: bootstrap, call the recipe, record the outcome.

It holds only the run dir; the config and the layout are read from what was archived there at launch
time, so the job runs exactly that (the node never recomputes the layout).
"""
from __future__ import annotations

import os
import socket
import sys
import time
import traceback
from datetime import timedelta
from typing import Any, Dict

from launcher.rundir import RunDir, Status, now_iso


class RunTask:
    def __init__(self, run_dir: str):
        self.run_dir = str(run_dir)

    def __call__(self) -> Dict[str, Any]:
        return run(RunDir(self.run_dir))

    def __repr__(self) -> str:
        return f"RunTask({self.run_dir!r})"


def _record_rank(rd: RunDir, denv) -> None:
    rd.write_rank(denv.rank, {
        "rank": denv.rank,
        "local_rank": denv.local_rank,
        "node_rank": denv.node_rank,
        "hostname": socket.gethostname(),
        "slurmd_nodename": os.environ.get("SLURMD_NODENAME"),
        "pid": os.getpid(),
        "job_id": denv.job_id,
        "array_job_id": denv.array_job_id,
        "array_task_id": denv.array_task_id,
        "master_addr": denv.master_addr,
        "master_port": denv.master_port,
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "started": now_iso(),
    })


def _wait_for(rd: RunDir, timeout_s: float = 120.0) -> None:
    """The launcher makes the run dir visible right after submission returns; a task can start first."""
    deadline = time.time() + timeout_s
    while not rd.exists():
        if time.time() > deadline:
            raise FileNotFoundError(f"run dir {rd.path} never appeared (was the launch interrupted?)")
        time.sleep(0.2)


def _record_node(rd: RunDir, denv) -> None:
    """Topology once per node (its local rank 0); the training environment and runtime versions once."""
    from launcher.archive import secrets, topology

    if denv.local_rank == 0:
        rd.write_topology(os.environ.get("SLURMD_NODENAME") or socket.gethostname(), denv.node_rank,
                          topology.gather())
    if denv.rank == 0:
        rd.write_environment(secrets.training_env(os.environ), topology.runtime_software())


def _record_early_failure(rd: RunDir, tb: str) -> None:
    """A rank that fails before it knows its place: its traceback as a rank error (rank from the
    launcher's environment), the run failed."""
    from launcher.archive.secrets import scrub

    try:
        import submitit

        rank = int(submitit.JobEnvironment().global_rank)
    except Exception:  # not in a submitit job (or its environment is what failed)
        rank = next((int(os.environ[k]) for k in ("RANK", "SLURM_PROCID") if os.environ.get(k, "").isdigit()), 0)
    print(tb, file=sys.stderr, flush=True)
    if not rd.is_final():
        rd.write_rank_error(rank, scrub(tb, os.environ))
        rd.finish(Status.failed, exit_code=1, error=scrub(tb.strip().splitlines()[-1], os.environ), failed_rank=rank)


def run(rd: RunDir) -> Dict[str, Any]:
    from launcher import backends
    from launcher.archive.secrets import is_redacted, scrub
    from launcher.runtime import env as dist_env
    from launcher.runtime import restarts, watchdog

    _wait_for(rd)
    try:
        rd.adopt_shared()
        cfg_plain = rd.config()
        cluster, train = cfg_plain.get("cluster", {}), cfg_plain.get("train", {})
        denv = dist_env.detect(master_port=cluster.get("master_port"))
    except BaseException:  # before the watches start: recorded, so that the other ranks' watches end them
        _record_early_failure(rd, traceback.format_exc())  # (instead of their waiting in the rendezvous)
        raise
    denv.export()
    for k, v in (cluster.get("env") or {}).items():
        if not is_redacted(v):  # a secret comes through the submitting environment, never the archive
            os.environ.setdefault(str(k), str(v))  # before torch loads (OMP_NUM_THREADS etc.)
    if rd.is_final():  # the scheduler started a job whose run has ended (e.g. requeued after a cancel)
        print(f"run {rd.path} already ended ({rd.status().state.value}): nothing to do", flush=True)
        return rd.status().summary or {}
    backend = backends.get(str(cluster.get("backend", "local")))
    max_restarts = int(train.get("max_restarts", 0))
    job_ids = {"job_id": denv.job_id, "array_job_id": denv.array_job_id, "array_task_id": denv.array_task_id}
    stop_flag = restarts.StopFlag().install()
    attempt: Dict[str, int] = {"n": 0}

    def requeue(reason: str, detail: str, step: Any = None) -> bool:
        return restarts.request_requeue(rd, backend, attempt=attempt["n"] or 1, max_restarts=max_restarts,
                                        reason=reason, detail=scrub(detail, os.environ), rank=denv.rank, step=step,
                                        job_id=denv.job_id)

    def on_hang(message: str) -> int:
        if rd.is_final():
            return 1
        rd.write_rank_error(denv.rank, message)
        if requeue("hang", message):
            return backend.requeue_exit_code
        rd.finish(Status.failed, exit_code=1, error=message, failed_rank=denv.rank, **job_ids)
        return 1

    watch = watchdog.start(rd, denv.rank, world=denv.world_size,
                           hang_timeout_s=float(train.get("hang_timeout_s") or 0), on_hang=on_hang)
    _record_rank(rd, denv)
    _record_node(rd, denv)
    t0 = time.time()
    try:
        if denv.rank == 0:
            attempt["n"] = restarts.begin_attempt(rd, max_restarts, denv.job_id)
            rd.set_status(Status.running, **job_ids, hosts=denv.hostnames, world_size=denv.world_size)
        summary = _run_recipe(rd, cfg_plain, denv, watch, stop_flag, attempt)
    except restarts.Interrupted as e:  # signalled; the recipe saved a checkpoint at a step boundary
        watch.set()
        detail = f"{e.reason.replace('_', ' ')} signal, checkpoint saved after step {e.step}"
        if e.reason == "time_limit":
            if requeue(e.reason, detail, e.step):
                raise SystemExit(backend.requeue_exit_code)
            rd.finish(Status.timeout, exit_code=1, error=detail + "; restart budget spent", **job_ids)
        else:  # TERM: the scheduler is ending the job (preemption, requeue or cancel): it decides what follows
            rd.set_status(Status.requeued, stop={"reason": e.reason, "detail": detail, "rank": denv.rank, "step": e.step})
        raise SystemExit(1)
    except BaseException as e:  # record, then re-raise so the task exits non-zero
        watch.set()
        tb = traceback.format_exc()
        print(tb, file=sys.stderr, flush=True)
        tb = scrub(tb, os.environ)  # a secret in an exception message stays out of the archive
        if not rd.is_final():  # once another rank recorded the outcome (and sealed), the log keeps this one
            rd.write_rank_error(denv.rank, tb)
        error = scrub(f"{type(e).__name__}: {e}", os.environ)
        if not isinstance(e, (KeyboardInterrupt, SystemExit)) and requeue("failure", f"rank {denv.rank}: {error}"):
            raise SystemExit(backend.requeue_exit_code) from e
        # the first rank to fail holds the root cause; the others fail because it went away
        rd.finish(Status.cancelled if isinstance(e, KeyboardInterrupt) else Status.failed, exit_code=1,
                  error=error, failed_rank=denv.rank, **job_ids)
        raise
    finally:
        watch.set()
    if denv.rank == 0 and not rd.failed_ranks():
        rd.finish(Status.completed, exit_code=0, summary=summary, duration_s=round(time.time() - t0, 3),
                  attempt=attempt["n"], restarts=len(rd.restarts()), **job_ids)
    return summary


def _select_device(cfg: Any, denv) -> bool:
    """Bind this rank to its GPU (True), or stay on CPU (False) where no GPU was promised; a job that
    was promised GPUs and has none fails here, with the reason, instead of training on CPU."""
    import torch

    from launcher import backends
    from launcher.runtime import env as dist_env

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


def _run_recipe(rd: RunDir, cfg_plain: Dict[str, Any], denv, watch, stop_flag, attempt: Dict[str, int]) -> Dict[str, Any]:
    import torch
    import torch.distributed as dist
    from hydra.utils import get_method

    from launcher.runtime.context import RunContext
    from launcher.schema import typed

    cfg = typed(cfg_plain)
    layout = rd.layout()
    if layout.world_size != denv.world_size:  # the scheduler gave another shape than was archived
        raise RuntimeError(f"the job has {denv.world_size} processes but the archived layout needs "
                           f"{layout.world_size} (dp {layout.dp} x pp {layout.pp} x tp {layout.tp})")
    use_cuda = _select_device(cfg, denv)
    backend = "nccl" if use_cuda else "gloo"
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
    attempt["n"] = int(rd.status().attempt or 1)
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
    )
    try:
        recipe = get_method(cfg.recipe._target_)
        summary = recipe(cfg, ctx) or {}
        dist.barrier()
    finally:
        ctx.close()
        if dist.is_initialized():
            dist.destroy_process_group()
    return summary
