"""The list of runs under a runs root, with live status.

The run dirs are the truth: each holds run.json and status.json written by the launcher and the job.
A run whose job died without writing its outcome (cancelled, timed out, node lost) gets its status
from the scheduler: sacct for Slurm, the process table for local runs.
"""
from __future__ import annotations

import os
import subprocess
from contextlib import closing
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional

from launcher.archive import atomic, bundle, index

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


def record_lost_outcome(run_dir: Path, state: str) -> str:
    """A job ended without recording its outcome (killed, timed out, node lost): record the outcome
    its scheduler state implies (a clean exit that recorded nothing is a failure), then seal the run."""
    mapped = SLURM_STATE.get((state.split() or [""])[0].rstrip("+").upper())
    status = mapped if mapped in ("cancelled", "timeout") else "failed"
    bundle.set_status(run_dir, status, exit_code=None,
                      error=f"job ended without recording an outcome (scheduler state {state or '?'})")
    bundle.finalize(run_dir)
    return status


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


def row_from_dir(rdir: Path) -> Optional[Dict[str, Any]]:
    """The index row of one run dir (None if it is not a complete run)."""
    meta = bundle.read_run(rdir)
    if not meta:
        return None
    st = bundle.read_status(rdir)
    job = atomic.read_json(rdir / bundle.JOB_FILE, {}) or {}
    summary = st.get("summary") or {}
    try:
        config = bundle.load_config(rdir)
    except (OSError, ValueError):
        config = {}
    return {
        "run_id": meta["run_id"], "sweep_id": meta["sweep_id"], "idx": meta.get("index"),
        "name": meta.get("name"), "dir": str(rdir), "status": st.get("status", "pending"),
        "exit_code": st.get("exit_code"), "job_id": job.get("job_id"), "backend": meta.get("backend"),
        "created": meta.get("created"), "created_ts": meta.get("created_ts", 0.0), "tags": meta.get("tags") or [],
        "config": config, "final_loss": summary.get("final_loss"), "tokens_per_s": summary.get("mean_tokens_per_s"),
        "error": st.get("error"), "reproduces": meta.get("reproduces"), "_job": job,
    }


def scan(root: Path, sweeps: Optional[Iterable[str]] = None) -> List[Dict[str, Any]]:
    """Rows read from the run dirs (all sweeps, or only the named ones)."""
    root = Path(root)
    dirs = bundle.iter_run_dirs(root) if sweeps is None else [
        d for s in sweeps for d in bundle.iter_run_dirs(root, sweep=s)]
    return [r for r in (row_from_dir(d) for d in dirs) if r]


def reindex(root: Optional[Path] = None) -> int:
    """Rebuild the SQLite index from the run dirs; returns the number of runs."""
    root = Path(root) if root else default_root()
    found = scan(root)
    index.replace_all(root, found)
    return len(found)


def record(root: Path, run_dirs: Iterable[Path]) -> None:
    """Add or refresh the index rows of these run dirs (called by launch after submission)."""
    new = [r for r in (row_from_dir(Path(d)) for d in run_dirs) if r]
    with closing(index.connect(root)) as conn:
        index.upsert(conn, new)


def _refresh(rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Re-read unfinished runs from their dirs and ask the scheduler about them; returns changed rows."""
    live = [r for r in rows if r["status"] not in bundle.FINAL]
    fresh = {r["run_id"]: row_from_dir(Path(r["dir"])) for r in live}
    jobs = {rid: (f or {}).get("_job") or {} for rid, f in fresh.items()}
    slurm = sacct_states(
        j["job_id"] for rid, j in jobs.items()
        if j.get("backend") == "slurm" and (fresh[rid] or {}).get("status") not in bundle.FINAL)
    changed = []
    for r in live:
        f = fresh.get(r["run_id"])
        if f is None:
            continue
        status = f["status"]
        if status not in bundle.FINAL:
            derived = _scheduler_status(jobs[r["run_id"]], status, slurm)
            if derived in bundle.FINAL:
                state = slurm.get(str(jobs[r["run_id"]].get("job_id")), "") or derived
                record_lost_outcome(Path(r["dir"]), state.upper())
                f = row_from_dir(Path(r["dir"])) or f
            elif derived:
                f["status"] = derived
        if any(f.get(k) != r.get(k) for k in ("status", "exit_code", "job_id", "final_loss", "error")):
            changed.append(f)
    return changed


def list_runs(root: Optional[Path] = None, refresh: bool = True) -> List[Dict[str, Any]]:
    """Every run under root, oldest first, with current status (from the index, refreshed)."""
    root = Path(root) if root else default_root()
    if not root.is_dir():
        return []
    with closing(index.connect(root)) as conn:
        rows = index.rows(conn)
        known = {r["sweep_id"] for r in rows}
        unknown = [d.name for d in bundle.iter_sweep_dirs(root) if d.name not in known]
        if unknown:  # runs the index has not seen (e.g. the index was deleted): add them
            found = scan(root, unknown)
            index.upsert(conn, found)
            rows = index.rows(conn)
        if refresh:
            changed = _refresh(rows)
            if changed:
                index.upsert(conn, changed)
                rows = index.rows(conn)
    return [public(r) for r in rows]


def public(r: Dict[str, Any]) -> Dict[str, Any]:
    """The JSON shape of `launcher runs --json`."""
    return {
        "run_id": r["run_id"], "sweep_id": r["sweep_id"], "index": r["idx"], "name": r["name"], "dir": r["dir"],
        "status": r["status"], "exit_code": r["exit_code"], "job_id": r["job_id"], "backend": r["backend"],
        "created": r["created"], "tags": r.get("tags") or [], "final_loss": r["final_loss"],
        "tokens_per_s": r["tokens_per_s"], "error": r["error"], "reproduces": r.get("reproduces"),
        "config": r.get("config") or {},
    }


def matches(run: Dict[str, Any], where: Dict[str, Any]) -> bool:
    """key=value filters over the resolved config (values compared after YAML parsing)."""
    for key, want in where.items():
        got = index.lookup(run.get("config") or {}, key)
        if got != want and str(got) != str(want):
            return False
    return True
