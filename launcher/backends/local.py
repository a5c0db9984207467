"""Local processes on this machine (submitit's LocalExecutor): the default, no cluster needed."""
from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional

from launcher.backends.base import Backend, JobState
from launcher.rundir import Status


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class LocalBackend(Backend):
    name = "local"
    waits = True
    shares_host_memory = True

    def parameters(self, cfg: Any, code_dir: Optional[Path] = None) -> Dict[str, Any]:
        cl = cfg.cluster
        return {"timeout_min": int(cl.time_min), "tasks_per_node": int(cl.gpus_per_node), "nodes": 1}

    def executor(self, cfg: Any, folder: Path, code_dir: Optional[Path] = None) -> Any:
        from submitit import LocalExecutor

        ex = LocalExecutor(folder=folder)
        ex.update_parameters(**self.parameters(cfg))
        return ex

    def _prepare(self, cfg: Any, code_dir: Optional[Path]) -> None:
        # local jobs inherit this process's working dir and PYTHONPATH: run them from the snapshot
        if code_dir is not None:
            os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(code_dir), os.environ.get("PYTHONPATH")]))
            os.chdir(code_dir)

    def preview(self, cfg: Any, folder: Path, points: List[int], code_dir: Optional[Path] = None) -> str:
        return f"# ---- local: points {points}, {cfg.cluster.gpus_per_node} process(es) each"

    def states(self, jobs: Iterable[Dict[str, Any]]) -> Dict[str, JobState]:
        # the job id is the pid of submitit's local job process; once it is gone the job has ended
        out = {}
        for job in jobs:
            pid = str(job.get("job_id") or "")
            if pid.isdigit():
                alive = pid_alive(int(pid))
                out[pid] = JobState(Status.running if alive else Status.failed, "RUNNING" if alive else "EXITED")
        return out

    def cancel(self, job: Dict[str, Any]) -> None:
        pid = str(job.get("job_id") or "")
        if pid.isdigit():
            try:
                os.kill(int(pid), signal.SIGTERM)
            except ProcessLookupError:
                pass


BACKEND = LocalBackend()
