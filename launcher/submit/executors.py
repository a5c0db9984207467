"""submitit executors built from ClusterConfig, and the exact sbatch text they will submit.

Values reach the sbatch script only through submitit's flag writer, which shell-quotes each one;
environment lines are quoted here with shlex.quote. Setup lines are the user's own shell, verbatim.
"""
from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Any, Dict, List

from launcher.schema import enum_value


def env_lines(env: Dict[str, Any]) -> List[str]:
    """`export K=V` lines, every value quoted so `;`, `$()` and spaces stay text."""
    lines = []
    for k, v in sorted(env.items()):
        if not str(k).isidentifier():
            raise ValueError(f"cluster.env: {k!r} is not a valid environment variable name")
        lines.append(f"export {k}={shlex.quote(str(v))}")
    return lines


def slurm_parameters(cfg: Any) -> Dict[str, Any]:
    """SlurmExecutor parameters for one run config (one task per GPU / process)."""
    cl = cfg.cluster
    params: Dict[str, Any] = {
        "job_name": str(cfg.submit.job_name),
        "time": int(cl.time_min),
        "nodes": int(cl.nodes),
        "ntasks_per_node": int(cl.gpus_per_node),
        "cpus_per_task": int(cl.cpus_per_task),
        "array_parallelism": int(cl.array_parallelism),
        "setup": list(cl.setup) + env_lines(dict(cl.env)),
        # Slurm signals the job 120 s before its time limit so it can checkpoint and requeue
        "signal_delay_s": 120,
        # one rank failing ends the step at once instead of leaving the others in a collective
        "srun_args": ["--kill-on-bad-exit=1"],
    }
    if cl.use_gpus:
        params["gpus_per_node"] = int(cl.gpus_per_node)
    for key in ("partition", "account", "qos", "constraint"):
        value = cl.get(key)
        if value:
            params[key] = str(value)
    if cl.mem_gb:
        params["mem"] = f"{int(cl.mem_gb)}GB"
    if cl.sbatch_extra:
        params["additional_parameters"] = {str(k): v for k, v in cl.sbatch_extra.items()}
    return params


def local_parameters(cfg: Any) -> Dict[str, Any]:
    cl = cfg.cluster
    return {
        "timeout_min": int(cl.time_min),
        "tasks_per_node": int(cl.gpus_per_node),
        "nodes": 1,
    }


def executor_key(cfg: Any) -> str:
    """Points with the same key share one submission (one Slurm array)."""
    backend = enum_value(cfg.cluster.backend)
    params = slurm_parameters(cfg) if backend == "slurm" else local_parameters(cfg)
    return backend + ":" + repr(sorted(params.items()))


def submitit_command(folder: Path) -> str:
    """The command submitit's SlurmExecutor runs in each task (kept identical for dry runs)."""
    return " ".join([shlex.quote(sys.executable), "-u -m submitit.core._submit", shlex.quote(str(folder))])


def sbatch_text(cfg: Any, folder: Path, n_points: int) -> str:
    """The sbatch script submitit would write for these points, without submitting anything."""
    from submitit.slurm.slurm import _make_sbatch_string

    params = slurm_parameters(cfg)
    if n_points > 1:
        params["map_count"] = n_points
    return _make_sbatch_string(command=submitit_command(folder), folder=folder, **params)


def make_executor(cfg: Any, folder: Path):
    """A submitit executor for this config's cluster."""
    backend = enum_value(cfg.cluster.backend)
    if backend == "slurm":
        from submitit import SlurmExecutor

        ex = SlurmExecutor(folder=folder)
        ex.update_parameters(**slurm_parameters(cfg))
        return ex
    from submitit import LocalExecutor

    ex = LocalExecutor(folder=folder)
    ex.update_parameters(**local_parameters(cfg))
    return ex
