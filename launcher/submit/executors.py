"""submitit executors built from ClusterConfig, and the exact sbatch text they will submit.

Values reach the sbatch script only through submitit's flag writer, which shell-quotes each one;
environment lines are quoted here with shlex.quote. Setup lines are the user's own shell, verbatim.
"""
from __future__ import annotations

import contextlib
import os
import shlex
import sys
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

from launcher.schema import enum_value


def env_lines(env: Dict[str, Any]) -> List[str]:
    """`export K=V` lines, every value quoted so `;`, `$()` and spaces stay text. Secret-named
    variables are left out: they reach the job through the submitting environment instead, so their
    values never land in a script or the archive."""
    from launcher.archive.secrets import is_secret

    lines = []
    for k, v in sorted(env.items()):
        if not str(k).isidentifier():
            raise ValueError(f"cluster.env: {k!r} is not a valid environment variable name")
        if not is_secret(k):
            lines.append(f"export {k}={shlex.quote(str(v))}")
    return lines


def code_lines(code_dir: Optional[Path]) -> List[str]:
    """Jobs import the code snapshot first, so they run the code as it was at submission."""
    if code_dir is None:
        return []
    return [f"export PYTHONPATH={shlex.quote(str(code_dir))}${{PYTHONPATH:+:$PYTHONPATH}}"]


@contextlib.contextmanager
def job_environment(cfg: Any, code_dir: Optional[Path]) -> Iterator[None]:
    """The submitting process's environment while it submits (both backends pass it on): secret
    cluster.env values, and for local jobs the snapshot as working directory and first on PYTHONPATH
    (Slurm jobs get those from their sbatch script)."""
    from launcher.archive.secrets import is_secret

    saved_env, saved_cwd = dict(os.environ), os.getcwd()
    try:
        for k, v in dict(cfg.cluster.env).items():
            if is_secret(k):
                os.environ[str(k)] = str(v)
        if code_dir is not None and enum_value(cfg.cluster.backend) == "local":
            os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(code_dir), os.environ.get("PYTHONPATH")]))
            os.chdir(code_dir)
        yield
    finally:
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)


def slurm_parameters(cfg: Any, code_dir: Optional[Path] = None) -> Dict[str, Any]:
    """SlurmExecutor parameters for one run config (one task per GPU / process)."""
    cl = cfg.cluster
    params: Dict[str, Any] = {
        "job_name": str(cfg.submit.job_name),
        "time": int(cl.time_min),
        "nodes": int(cl.nodes),
        "ntasks_per_node": int(cl.gpus_per_node),
        "cpus_per_task": int(cl.cpus_per_task),
        "array_parallelism": int(cl.array_parallelism),
        "setup": list(cl.setup) + env_lines(dict(cl.env)) + code_lines(code_dir),
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
    extra = {str(k): v for k, v in cl.sbatch_extra.items()}
    if code_dir is not None:
        extra.setdefault("chdir", str(code_dir))  # `python -m` puts the working dir first on sys.path
    if extra:
        params["additional_parameters"] = extra
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


def sbatch_text(cfg: Any, folder: Path, n_points: int, code_dir: Optional[Path] = None) -> str:
    """The sbatch script submitit would write for these points, without submitting anything."""
    from submitit.slurm.slurm import _make_sbatch_string

    params = slurm_parameters(cfg, code_dir)
    if n_points > 1:
        params["map_count"] = n_points
    return _make_sbatch_string(command=submitit_command(folder), folder=folder, **params)


def make_executor(cfg: Any, folder: Path, code_dir: Optional[Path] = None):
    """A submitit executor for this config's cluster."""
    backend = enum_value(cfg.cluster.backend)
    if backend == "slurm":
        from submitit import SlurmExecutor

        ex = SlurmExecutor(folder=folder)
        ex.update_parameters(**slurm_parameters(cfg, code_dir))
        return ex
    from submitit import LocalExecutor

    ex = LocalExecutor(folder=folder)
    ex.update_parameters(**local_parameters(cfg))
    return ex
