"""The list of runs under a runs root, with live status.

The run dirs are the truth: each holds run.json and status.json written by the launcher and the job.
Listing never writes a run dir: an unfinished run's row carries its scheduler's word (Slurm:
sacct/squeue; local: the process table) in ``job_state``, and ``job_ended`` where the job ended
without recording an outcome (launcher.outcome records it, for the commands that settle runs).
A failed run's row holds its doctor class, found once when the row is first indexed as final.
"""
from __future__ import annotations

import os
import sqlite3
import sys
from contextlib import closing
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Tuple

from launcher import backends
from launcher.archive import index
from launcher.rundir import RunDir, runs as run_dirs, sweeps
from launcher.status import FINAL, Status


def default_root() -> Path:
    return Path(os.environ.get("LAUNCHER_RUNS", "runs")).expanduser().resolve()


def job_states(jobs: Iterable[Dict[str, Any]]) -> Dict[str, backends.JobState]:
    """Scheduler state of each job (job.json records), one query per backend."""
    by_backend: Dict[str, List[Dict[str, Any]]] = {}
    for j in jobs:
        if j.get("backend") and j.get("job_id"):
            by_backend.setdefault(str(j["backend"]), []).append(j)
    out: Dict[str, backends.JobState] = {}
    for name, js in by_backend.items():
        out.update(backends.get(name).states(js))
    return out


def row_from_dir(rdir: Path, config: Optional[Dict[str, Any]] = None) -> Optional[Dict[str, Any]]:
    """The index row of one run dir (None if it is not a complete run); ``config``: its config.yaml
    as already known to the caller (the launch that wrote it), else read."""
    rd = RunDir(rdir)
    meta = rd.run()
    if not meta:
        return None
    st = rd.status()
    job = rd.job()
    summary = st.summary or {}
    if config is None:
        try:
            config = rd.config()
        except (OSError, ValueError):
            config = {}
    return {
        "run_id": meta["run_id"], "sweep_id": meta["sweep_id"], "idx": meta.get("index"),
        "name": meta.get("name"), "dir": str(rdir), "status": st.state.value,
        "exit_code": st.exit_code, "job_id": job.job_id if job else None, "backend": meta.get("backend"),
        "created": meta.get("created"), "created_ts": meta.get("created_ts", 0.0), "tags": meta.get("tags") or [],
        "config": config, "final_loss": summary.get("final_loss"), "tokens_per_s": summary.get("mean_tokens_per_s"),
        "error": st.error or rd.lost_seal(),  # a run whose seal or status was removed never reads as plain pending
        "failure_class": _failure_class(rd, st.state), "reproduces": meta.get("reproduces"),
        "_job": job.to_json() if job else {},
        "return_value": summary.get("return_value"),  # a Hydra app's run: what its task returned
    }


def _failure_class(rd: RunDir, state: Status) -> Optional[str]:
    """Why a finished run did not complete (launcher doctor's class, from the run dir and its logs,
    no scheduler query); None for a completed or unfinished run. Indexed once, with the final row."""
    if state.value not in FINAL or state is Status.completed:
        return None
    from launcher import doctor  # lazy: the doctor only for a failed run's class

    return doctor.classify(rd).kind


def scan(root: Path, sweep_ids: Optional[Iterable[str]] = None) -> List[Dict[str, Any]]:
    """Rows read from the run dirs (all sweeps, or only the named ones)."""
    root = Path(root)
    dirs = list(run_dirs(root)) if sweep_ids is None else [d for s in sweep_ids for d in run_dirs(root, sweep=s)]
    return [r for r in (row_from_dir(d.path) for d in dirs) if r]


def reindex(root: Optional[Path] = None) -> int:
    """Rebuild the SQLite index from the run dirs; returns the number of runs."""
    root = Path(root) if root else default_root()
    found = scan(root)
    index.replace_all(root, found)
    return len(found)


def _rebuild_unreadable(root: Path, err: Exception) -> None:
    print(f"launcher: the run index {index.db_path(root)} is unreadable or of an older layout ({err}); "
          "rebuilding it from the run dirs", file=sys.stderr)
    reindex(root)


def record(root: Path, run_dirs: Iterable[Path], configs: Optional[Dict[str, Dict[str, Any]]] = None) -> None:
    """Add or refresh the index rows of these run dirs (called by launch after submission; ``configs``:
    run dir -> the config it archived, when the caller has it). An unreadable index is rebuilt from
    the run dirs (they are the truth)."""
    configs = configs or {}
    new = [r for r in (row_from_dir(Path(d), configs.get(os.fspath(d))) for d in run_dirs) if r]
    try:
        with closing(index.connect(root)) as conn:
            index.upsert(conn, new)
    except sqlite3.DatabaseError as e:
        _rebuild_unreadable(Path(root), e)


def _refresh(rows: List[Dict[str, Any]]) -> Tuple[List[Dict[str, Any]], Dict[str, Dict[str, Any]]]:
    """Re-read unfinished runs from their dirs and ask their schedulers about them: (rows whose run
    dir changed, the scheduler's word by run id: job_state, job_ended). Writes no run dir."""
    live = [r for r in rows if r["status"] not in FINAL]
    fresh = {r["run_id"]: row_from_dir(Path(r["dir"])) for r in live}
    states = job_states(f["_job"] for f in fresh.values() if f and f["status"] not in FINAL)
    changed, words = [], {}
    for r in live:
        f = fresh.get(r["run_id"])
        if f is None:
            continue
        state = states.get(str(f["_job"].get("job_id"))) if f["status"] not in FINAL else None
        if state is not None:
            words[r["run_id"]] = {"job_state": state.raw or state.status.value, "job_ended": state.ended}
        if any(f.get(k) != r.get(k) for k in ("status", "exit_code", "job_id", "final_loss", "error", "return_value")):
            changed.append(f)
    return changed, words


def list_runs(root: Optional[Path] = None, refresh: bool = True) -> List[Dict[str, Any]]:
    """Every run under root, oldest first, with current status (from the index; ``refresh``: the
    unfinished runs re-read from their dirs, with their scheduler's word). Writes no run dir."""
    root = Path(root) if root else default_root()
    if not root.is_dir():
        return []
    try:
        return _list(root, refresh)
    except sqlite3.DatabaseError as e:
        _rebuild_unreadable(root, e)
        return _list(root, refresh)


def _list(root: Path, refresh: bool) -> List[Dict[str, Any]]:
    with closing(index.connect(root)) as conn:
        rows = index.rows(conn)
        known = {r["sweep_id"] for r in rows}
        unknown = [d.sweep_id for d in sweeps(root) if d.sweep_id not in known]
        if unknown:  # runs the index has not seen (e.g. the index was deleted): add them
            found = scan(root, unknown)
            index.upsert(conn, found)
            rows = index.rows(conn)
        words: Dict[str, Dict[str, Any]] = {}
        if refresh:
            changed, words = _refresh(rows)
            if changed:
                index.upsert(conn, changed)
                rows = index.rows(conn)
    return [{**public(r), **words.get(r["run_id"], {})} for r in rows]


def public(r: Dict[str, Any]) -> Dict[str, Any]:
    """The JSON shape of `launcher runs --json` (``class``: launcher doctor's class of a run that did not
    complete; ``job_state``, ``job_ended``: the scheduler's word on an unfinished run, where refreshed)."""
    return {
        "run_id": r["run_id"], "sweep_id": r["sweep_id"], "index": r["idx"], "name": r["name"], "dir": r["dir"],
        "status": r["status"], "exit_code": r["exit_code"], "job_id": r["job_id"], "backend": r["backend"],
        "created": r["created"], "tags": r.get("tags") or [], "final_loss": r["final_loss"],
        "tokens_per_s": r["tokens_per_s"], "error": r["error"], "reproduces": r.get("reproduces"),
        "return_value": r.get("return_value"), "config": r.get("config") or {},
        "class": r.get("failure_class"), "job_state": None, "job_ended": False,
    }


def matches(run: Dict[str, Any], where: Dict[str, Any]) -> bool:
    """key=value filters over the resolved config (values compared after YAML parsing)."""
    for key, want in where.items():
        got = index.lookup(run.get("config") or {}, key)
        if got != want and str(got) != str(want):
            return False
    return True
