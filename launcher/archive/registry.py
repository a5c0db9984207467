"""The list of runs under a runs root, with live status.

The run dirs are the truth: each holds run.json and status.json written by the launcher and the job.
Listing never writes a run dir: an unfinished run's row carries its scheduler's word (Slurm:
sacct/squeue; local: the process table) in ``job_state``, and ``job_ended`` where the job ended
without recording an outcome (launcher.run.outcome records it, for the commands that settle runs).
A failed run's row holds its doctor class, found once when the row is first indexed as final.

One bad run dir never takes the root down: a dir whose run.json, status.json or config.yaml cannot be
read is skipped, and every listing names it on stderr (the index keeps the list). An index that cannot
be written (a full disk, a read-only archive, a path too long for SQLite) is not needed to list: the
runs are then read from their dirs, with a warning, and nothing is written.
"""
from __future__ import annotations

import json
import os
import sqlite3
import sys
from contextlib import closing
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, NamedTuple, Optional, Set, Tuple

from launcher import backends
from launcher.archive import index
from launcher.run.job_record import JobRecord
from launcher.run.rundir import RunDir, Unreadable, runs as run_dirs, sweeps
from launcher.run.status import FINAL, Status

# what this command has said already (a `status --watch` lists the root every 2 s): said once
_said: Set[str] = set()


def new_command() -> None:
    """A new command begins (launcher.cli.main): what an earlier one said is said again."""
    _said.clear()


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


class Held(NamedTuple):
    """What a launch wrote into a run dir it just published: its run.json and job.json (its row is made
    from them instead of reading them back; a run no job has started has no status.json)."""
    run: Dict[str, Any]
    job: Optional[JobRecord]


def row_from_dir(rdir: Path, config: Optional[Dict[str, Any]] = None,
                 held: Optional[Held] = None) -> Optional[Dict[str, Any]]:
    """The index row of one run dir (None if it is not a complete run); ``config``: its config.yaml
    as already known to the caller (the launch that wrote it), else read; ``held``: its run.json and
    job.json as the launch wrote them (a run that ended already, refused, is read whole). Unreadable
    (naming the file and why) for a dir whose run.json, status.json or config.yaml is junk."""
    rd = RunDir(rdir)
    st = rd.status()
    if held is not None and st.state.value in FINAL:
        held = None
    meta = held.run if held is not None else rd.run()
    if not meta:
        return None
    for key in ("run_id", "sweep_id"):
        if not isinstance(meta.get(key), str) or not meta[key]:
            raise Unreadable(f"{RunDir.RUN} has no {key}", rd.path / RunDir.RUN)
    job = held.job if held is not None else rd.job()
    lost = None if held is not None else rd.lost_seal()
    summary = st.summary if isinstance(st.summary, dict) else {}
    if config is None:
        try:
            config = rd.config()
        except FileNotFoundError:
            config = {}
    ts, idx = meta.get("created_ts"), meta.get("index")
    return {
        "run_id": meta["run_id"], "sweep_id": meta["sweep_id"], "idx": idx if isinstance(idx, int) else None,
        "name": meta.get("name"), "dir": str(rdir), "status": st.state.value,
        "exit_code": st.exit_code, "job_id": job.job_id if job else None, "backend": meta.get("backend"),
        "created": meta.get("created"), "created_ts": float(ts) if isinstance(ts, (int, float)) else 0.0,
        "tags": meta.get("tags") or [],
        "config": config, "final_loss": summary.get("final_loss"), "tokens_per_s": summary.get("mean_tokens_per_s"),
        # a run whose seal or status was removed never reads as plain pending (one just queued has neither)
        "error": st.error or lost, "tampered": lost is not None,
        "failure_class": _failure_class(rd, st.state, config), "reproduces": meta.get("reproduces"),
        "_job": job.to_json() if job else {},
        "return_value": summary.get("return_value"),  # a Hydra app's run: what its task returned
    }


def _failure_class(rd: RunDir, state: Status, config: Optional[Dict[str, Any]] = None) -> Optional[str]:
    """Why a finished run did not complete (launcher doctor's class, from the run dir and its logs,
    no scheduler query); None for a completed or unfinished run. Indexed once, with the final row."""
    if state.value not in FINAL or state is Status.completed:
        return None
    from launcher import doctor  # lazy: the doctor only for a failed run's class

    return doctor.classify(rd, config=config).kind


class Scan(NamedTuple):
    rows: List[Dict[str, Any]]  # the runs read
    skipped: Dict[str, str]  # the run dirs that could not be read: why, by dir


def read_dir(rdir: Path,
             config: Optional[Dict[str, Any]] = None) -> Tuple[Optional[Dict[str, Any]], Optional[str]]:
    """(its row, None) for a run dir; (None, why) for one that cannot be read; (None, None) for a dir
    that is no run (any more). ``config``: its config.yaml as already indexed (never changes: not read)."""
    try:
        return row_from_dir(rdir, config), None
    except Unreadable as e:
        return None, str(e)
    except OSError as e:  # e.g. a symlink loop, a file made unreadable
        return None, f"cannot be read ({e.strerror or e})"


def scan(root: Path, sweep_ids: Optional[Iterable[str]] = None) -> Scan:
    """Rows read from the run dirs (all sweeps, or only the named ones), and the dirs skipped."""
    root = Path(root)
    dirs = list(run_dirs(root)) if sweep_ids is None else [d for s in sweep_ids for d in run_dirs(root, sweep=s)]
    rows, skipped = [], {}
    for d in dirs:
        row, why = read_dir(d.path)
        if row:
            rows.append(row)
        elif why:
            skipped[str(d.path)] = why
    return Scan(rows, skipped)


def reindex(root: Optional[Path] = None) -> int:
    """Rebuild the SQLite index from the run dirs; returns the number of runs (the dirs skipped are
    named on stderr). sqlite3.OperationalError or OSError where the index cannot be written."""
    root = Path(root) if root else default_root()
    found = scan(root)
    name_skipped(found.skipped)
    index.replace_all(root, found.rows, found.skipped)
    return len(found.rows)


def name_skipped(skipped: Dict[str, str]) -> None:
    """Each run dir that could not be read, on stderr (once per command)."""
    for d, why in sorted(skipped.items()):
        say(f"launcher: skipped {d}: {why} (not a run this launcher can read; fix or move it away)")


def say(line: str) -> None:
    """``line`` on stderr, unless this command said it already."""
    if line not in _said:
        _said.add(line)
        print(line, file=sys.stderr)


def _rebuild_unreadable(root: Path, err: Exception) -> None:
    print(f"launcher: the run index {index.db_path(root)} is unreadable or of an older layout ({err}); "
          "rebuilding it from the run dirs", file=sys.stderr)
    reindex(root)


def unwritable(root: Path, err: Exception) -> str:
    """Why the index of ``root`` cannot be opened or written, in words."""
    why = index.path_problem(root) or str(err)
    return f"the run index {index.db_path(root)} cannot be written ({why})"


def record(root: Path, run_dirs: Iterable[Path], configs: Optional[Dict[str, Dict[str, Any]]] = None,
           held: Optional[Dict[str, Held]] = None) -> None:
    """Add or refresh the index rows of these run dirs (called by launch after submission; ``configs``:
    run dir -> the config it archived, ``held``: run dir -> its run.json and job.json as written, when
    the caller has them). An unreadable index is rebuilt from the run dirs (they are the truth)."""
    configs, held = configs or {}, held or {}
    new, skipped = [], {}
    for d in run_dirs:
        try:
            row = row_from_dir(Path(d), configs.get(os.fspath(d)), held.get(os.fspath(d)))
        except Unreadable as e:  # e.g. a run resumed whose status.json went bad since
            skipped[os.fspath(d)] = str(e)
            continue
        if row:
            new.append(row)
    name_skipped(skipped)
    try:
        try:
            with closing(index.connect(root)) as conn:
                index.upsert(conn, new)
        except sqlite3.OperationalError:
            raise
        except sqlite3.DatabaseError as e:
            _rebuild_unreadable(Path(root), e)
    except (sqlite3.OperationalError, OSError) as e:  # the runs are archived and submitted: say so, go on
        say(f"launcher: warning: {unwritable(Path(root), e)}; the runs are archived in their dirs, and "
            "`launcher runs` lists them from there")


def _refresh(rows: List[Dict[str, Any]]) -> Tuple[List[Dict[str, Any]], Dict[str, Dict[str, Any]]]:
    """Re-read unfinished runs from their dirs and ask their schedulers about them: (rows whose run
    dir changed, the scheduler's word by run id: job_state, job_ended). Writes no run dir."""
    live = [r for r in rows if r["status"] not in FINAL]
    # the records that change (run.json, status.json, job.json) re-read; config.yaml never changes once
    # staged: the indexed copy serves (parsing it was most of a refresh). A dir gone junk since: as indexed
    fresh = {r["dir"]: read_dir(Path(r["dir"]), _config(r))[0] for r in live}
    states = job_states(f["_job"] for f in fresh.values() if f and f["status"] not in FINAL)
    changed, words = [], {}
    for r in live:
        f = fresh.get(r["dir"])
        if f is None:
            continue
        state = states.get(str(f["_job"].get("job_id"))) if f["status"] not in FINAL else None
        if state is not None:
            words[r["dir"]] = {"job_state": state.raw or state.status.value, "job_ended": state.ended}
        if any(f.get(k) != r.get(k) for k in ("status", "exit_code", "job_id", "final_loss", "error", "return_value",
                                              "tampered")):
            changed.append(f)
    return changed, words


def _config(row: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """The indexed config of a row (parsed here where the listing read it as text), None if none."""
    if row.get("config") is None and row.get("config_json"):
        return json.loads(row["config_json"]) or None
    return row.get("config") or None


# which of the indexed rows a command asks about (the rows as indexed, oldest first -> those it wants)
Select = Callable[[List[Dict[str, Any]]], List[Dict[str, Any]]]


def list_runs(root: Optional[Path] = None, refresh: bool = True, select: Optional[Select] = None,
              sweep_ids: Optional[Iterable[str]] = None, newest: Optional[int] = None,
              configs: bool = True) -> List[Dict[str, Any]]:
    """Every run under root, oldest first, with current status (from the index; ``refresh``: the
    unfinished runs re-read from their dirs, with their scheduler's word). Narrowed before anything is
    refreshed, so that a command costs the runs it names, not the whole root: ``sweep_ids``, only the
    runs of these sweeps (read from the index by sweep); ``newest``, only the newest n; ``select``, the
    runs a command asks about among those (a sweep, a run). ``configs=False``: each run's ``config`` is
    None (a listing that shows none skips parsing them). Writes no run dir."""
    root = Path(root) if root else default_root()
    if not root.is_dir():
        return []
    narrow = Narrow(None if sweep_ids is None else sorted(set(sweep_ids)), newest, configs)
    try:
        try:
            out = _list(root, refresh, select, narrow)
        except sqlite3.OperationalError:
            raise
        except sqlite3.DatabaseError as e:
            _rebuild_unreadable(root, e)
            out = _list(root, refresh, select, narrow)
    except (sqlite3.OperationalError, OSError) as e:  # listing needs no index: read the dirs, write nothing
        say(f"launcher: warning: {unwritable(root, e)}; listing the runs from their dirs")
        out = _unindexed(root, refresh, select, narrow)
    _name_shared_ids(out)
    return out


def count(root: Path, sweep_ids: Optional[Iterable[str]] = None) -> int:
    """How many runs the index of ``root`` holds (of these sweeps); 0 where it cannot be read."""
    try:
        with closing(index.connect(Path(root))) as conn:
            return index.count(conn, sweep_ids)
    except (sqlite3.Error, OSError):
        return 0


def list_named(root: Path, ident: str, select: Select, refresh: bool = True) -> List[Dict[str, Any]]:
    """list_runs of the runs ``select`` picks, read by the sweeps ``ident`` names (sweeps_named); where
    that finds none, from the whole root (a run dir copied into another sweep: its run.json names its own)."""
    found = list_runs(root, refresh=refresh, select=select, sweep_ids=sweeps_named(ident))
    return found or list_runs(root, refresh=refresh, select=select)


def sweeps_named(ident: str) -> List[str]:
    """The sweeps a sweep id, run id (``<sweep_id>-<index>``) or run dir names, as a hint for list_runs'
    ``sweep_ids`` (a run dir copied into another sweep keeps its own run.json's: a caller that finds
    nothing this way lists the whole root)."""
    head, sep, tail = ident.rpartition("-")
    p = Path(ident)
    return sorted({x for x in (ident, head if sep and tail.isdigit() else "", p.name, p.parent.name) if x})


class Narrow(NamedTuple):
    """Which indexed runs a listing reads (list_runs' sweep_ids, newest, configs)."""
    sweep_ids: Optional[List[str]]
    newest: Optional[int]
    configs: bool


def _list(root: Path, refresh: bool, select: Optional[Select], narrow: Narrow) -> List[Dict[str, Any]]:
    with closing(index.connect(root)) as conn:
        old = index.skipped(conn)
        known = index.sweep_ids(conn) | {Path(d).parent.name for d in old}
        unknown = [d.sweep_id for d in sweeps(root) if d.sweep_id not in known]
        found = scan(root, unknown) if unknown else Scan([], {})  # runs the index has not seen: added
        again = {d: read_dir(Path(d)) for d in old}  # a dir skipped before: fixed or gone since?
        found.rows.extend(row for row, _ in again.values() if row)
        found.skipped.update({d: why for d, (_, why) in again.items() if why})
        if found.rows or set(found.skipped) != set(old):
            index.upsert(conn, found.rows)
            index.set_skipped(conn, found.skipped, gone=[d for d in old if d not in found.skipped])
        name_skipped(found.skipped)
        rows = index.rows(conn, narrow.sweep_ids, narrow.newest, narrow.configs)
        if select is not None:
            rows = select(rows)
        words: Dict[str, Dict[str, Any]] = {}
        if refresh:
            changed, words = _refresh(rows)
            if changed:
                index.upsert(conn, changed)
                now = {r["dir"]: r for r in changed}
                rows = [now.get(r["dir"], r) for r in rows]
    return [{**public(r), **words.get(r["dir"], {})} for r in rows]


def _unindexed(root: Path, refresh: bool, select: Optional[Select], narrow: Narrow) -> List[Dict[str, Any]]:
    """list_runs without the index: every run read from its dir (as the index would order them)."""
    found = scan(root, narrow.sweep_ids)
    name_skipped(found.skipped)
    rows = sorted(found.rows, key=lambda r: (r["created_ts"], r["sweep_id"], r["idx"] if r["idx"] is not None else -1))
    if narrow.newest is not None:
        rows = rows[len(rows) - min(len(rows), max(0, narrow.newest)):]
    if select is not None:
        rows = select(rows)
    words: Dict[str, Dict[str, Any]] = _refresh(rows)[1] if refresh else {}
    return [{**public(r), **words.get(r["dir"], {})} for r in rows]


def _name_shared_ids(runs: List[Dict[str, Any]]) -> None:
    """Run dirs that claim one run id (a run dir copied whole): each stays listed under its own dir."""
    dirs: Dict[str, List[str]] = {}
    for r in runs:
        dirs.setdefault(r["run_id"], []).append(r["dir"])
    for run_id, ds in dirs.items():
        if len(ds) > 1:
            say(f"launcher: warning: {len(ds)} run dirs claim run id {run_id} (a run dir copied?): "
                f"{', '.join(ds)}; name the run by its dir")


def public(r: Dict[str, Any]) -> Dict[str, Any]:
    """The JSON shape of `launcher runs --json` (``class``: launcher doctor's class of a run that did not
    complete; ``job_state``, ``job_ended``: the scheduler's word on an unfinished run, where refreshed)."""
    return {
        "run_id": r["run_id"], "sweep_id": r["sweep_id"], "index": r["idx"], "name": r["name"], "dir": r["dir"],
        "status": r["status"], "exit_code": r["exit_code"], "job_id": r["job_id"], "backend": r["backend"],
        "created": r["created"], "tags": r.get("tags") or [], "final_loss": r["final_loss"],
        "tokens_per_s": r["tokens_per_s"], "error": r["error"], "reproduces": r.get("reproduces"),
        "return_value": r.get("return_value"), "config": r.get("config") or {},
        "class": r.get("failure_class"), "tampered": bool(r.get("tampered")), "job_state": None, "job_ended": False,
    }


def matches(run: Dict[str, Any], where: Dict[str, Any]) -> bool:
    """key=value filters over the resolved config (values compared after YAML parsing)."""
    for key, want in where.items():
        got = index.lookup(run.get("config") or {}, key)
        if got != want and str(got) != str(want):
            return False
    return True
