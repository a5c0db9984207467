"""The list of runs under a runs root, with live status.

The run dirs are the truth: each holds run.json and status.json written by the launcher and the job.
A run whose job died without writing its outcome (cancelled, timed out, node lost) gets its status
from the scheduler: sacct for Slurm, the process table for local runs.
"""
from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional

from launcher.archive import atomic, bundle

SLURM_STATE = {
    "PENDING": "pending",
    "CONFIGURING": "pending",
    "RUNNING": "running",
    "COMPLETING": "running",
    "SUSPENDED": "running",
    "COMPLETED": "completed",
    "FAILED": "failed",
    "NODE_FAIL": "failed",
    "OUT_OF_MEMORY": "failed",
    "BOOT_FAIL": "failed",
    "DEADLINE": "failed",
    "CANCELLED": "cancelled",
    "TIMEOUT": "timeout",
    "PREEMPTED": "requeued",
    "REQUEUED": "requeued",
    "REQUEUE_HOLD": "requeued",
    "REQUEUE_FED": "requeued",
}


def default_root() -> Path:
    return Path(os.environ.get("LAUNCHER_RUNS", "runs")).expanduser().resolve()


def sacct_states(job_ids: Iterable[str]) -> Dict[str, str]:
    """Slurm state of each job id ("123" or "123_4"), from one sacct call. {} if sacct is unavailable."""
    ids = sorted(set(job_ids))
    if not ids:
        return {}
    try:
        res = subprocess.run(
            ["sacct", "-X", "-n", "-P", "--format=JobID,State", "-j", ",".join(ids)],
            capture_output=True, text=True, timeout=60,
        )
    except (OSError, subprocess.SubprocessError):
        return {}
    states: Dict[str, str] = {}
    for line in res.stdout.splitlines():
        jid, _, state = line.partition("|")
        states[jid.strip()] = state.split()[0] if state.strip() else ""
    return states


def _scheduler_status(job: Dict[str, Any], recorded: str, slurm: Dict[str, str]) -> Optional[str]:
    if job.get("backend") == "slurm":
        state = slurm.get(str(job.get("job_id")))
        if not state:
            return None
        mapped = SLURM_STATE.get(state.rstrip("+"), None)
        if mapped == "completed" and recorded != "completed":
            return "failed"  # the task exited 0 but the run never recorded completion
        return mapped
    if job.get("backend") == "local" and recorded in ("pending", "running"):
        pid = job.get("job_id")
        if pid and str(pid).isdigit() and not bundle.pid_alive(int(pid)):
            return "failed"
    return None


def list_runs(root: Optional[Path] = None, refresh: bool = True) -> List[Dict[str, Any]]:
    """Every run under root, oldest first, each with its current status."""
    root = Path(root) if root else default_root()
    rows = []
    for rdir in bundle.iter_run_dirs(root):
        meta = bundle.read_run(rdir)
        if not meta:
            continue
        rows.append((meta, rdir))
    rows.sort(key=lambda r: (r[0].get("created_ts", 0), r[0].get("sweep_id", ""), r[0].get("index", 0)))
    jobs = {str(rdir): atomic.read_json(rdir / bundle.JOB_FILE, {}) or {} for _, rdir in rows}
    statuses = {str(rdir): bundle.read_status(rdir) for _, rdir in rows}
    slurm: Dict[str, str] = {}
    if refresh:
        live = [
            j["job_id"] for k, j in jobs.items()
            if j.get("backend") == "slurm" and statuses[k].get("status") not in bundle.FINAL
        ]
        slurm = sacct_states(live)
    out = []
    for meta, rdir in rows:
        st = statuses[str(rdir)]
        status = st.get("status", "pending")
        if refresh and status not in bundle.FINAL:
            status = _scheduler_status(jobs[str(rdir)], status, slurm) or status
        summary = st.get("summary") or {}
        out.append(
            {
                "run_id": meta["run_id"],
                "sweep_id": meta["sweep_id"],
                "index": meta.get("index"),
                "name": meta.get("name"),
                "dir": str(rdir),
                "status": status,
                "exit_code": st.get("exit_code"),
                "job_id": jobs[str(rdir)].get("job_id"),
                "backend": meta.get("backend"),
                "created": meta.get("created"),
                "final_loss": summary.get("final_loss"),
                "tokens_per_s": summary.get("mean_tokens_per_s"),
                "error": st.get("error"),
            }
        )
    return out
