"""The run registry: an SQLite index over the run dirs under a runs root.

The run dirs are the truth and the index can always be rebuilt from them (`reindex`). Only the
login-node side (launch, the CLI) writes it; compute nodes write only their own run dir, so a
100-task array never contends for the database file. A row is keyed by its run dir: a copied run
dir claims its original's run id, and both stay listed. The run dirs that could not be read are kept
too (``skipped``), so that every listing can name them.
"""
from __future__ import annotations

import json
import os
import sqlite3
import tempfile
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Set

DB_NAME = "registry.sqlite"

# tampered: an unfinished run's seal or status was removed (launcher.run.sealing.lost_seal; its error says how)
COLUMNS = (
    "run_id", "sweep_id", "idx", "name", "dir", "status", "exit_code", "job_id", "backend", "created",
    "created_ts", "tags", "config", "final_loss", "tokens_per_s", "error", "reproduces", "return_value",
    "failure_class", "tampered",
)
SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
  run_id TEXT, sweep_id TEXT, idx INTEGER, name TEXT, dir TEXT PRIMARY KEY, status TEXT,
  exit_code INTEGER, job_id TEXT, backend TEXT, created TEXT, created_ts REAL, tags TEXT,
  config TEXT, final_loss REAL, tokens_per_s REAL, error TEXT, reproduces TEXT, return_value TEXT,
  failure_class TEXT, tampered INTEGER
);
CREATE INDEX IF NOT EXISTS runs_sweep ON runs (sweep_id);
CREATE INDEX IF NOT EXISTS runs_order ON runs (created_ts, sweep_id, idx);
CREATE INDEX IF NOT EXISTS runs_status ON runs (status);
CREATE INDEX IF NOT EXISTS runs_id ON runs (run_id);
CREATE TABLE IF NOT EXISTS skipped (dir TEXT PRIMARY KEY, reason TEXT);
"""
# SQLite's unix VFS opens no path of 512 characters or more, and it opens <db>-journal beside the db
MAX_PATH = 511 - len("-journal")


def db_path(root: Path) -> Path:
    return Path(root) / DB_NAME


def path_problem(root: Path) -> Optional[str]:
    """Why SQLite could not open the index of ``root`` (its path too long), or None."""
    path = str(db_path(Path(root).absolute()))
    if len(path) <= MAX_PATH:
        return None
    return (f"the run index {DB_NAME} would lie at a path of {len(path)} characters, and SQLite opens none "
            f"longer than {MAX_PATH}; fix: a runs root of at most {MAX_PATH - len(DB_NAME) - 1} characters")


MIN_FREE_BYTES = 64 << 20  # a runs root on a file system with less free space takes no launch


def root_problem(root: Path) -> Optional[str]:
    """Why ``root`` cannot be a runs root, found before anything is written: a file on its path, a place
    no directory can be made (/proc, a read-only or a full file system), or an index path too long for
    SQLite. The check makes and removes one empty directory beside where the root goes, so what answers
    is the file system itself. None: usable."""
    root = Path(root).absolute()
    existing = root
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is a file, not a directory: no runs root can be made at {root}"
    try:
        probe = Path(tempfile.mkdtemp(prefix=".launcher-probe-", dir=existing))
        probe.rmdir()
    except OSError as e:
        return f"no directory can be made in {existing} ({e.strerror or e}): no runs root at {root}"
    try:
        st = os.statvfs(existing)
        free = st.f_bavail * st.f_frsize
    except OSError:
        free = None
    if free is not None and free < MIN_FREE_BYTES:
        return (f"the file system of {existing} has {free / (1 << 20):.1f} MiB free, less than the "
                f"{MIN_FREE_BYTES >> 20} MiB a launch writes (snapshot, records, checkpoints)")
    return path_problem(root)


def connect(root: Path) -> sqlite3.Connection:
    Path(root).mkdir(parents=True, exist_ok=True)
    # rollback journal, not WAL: WAL needs shared memory, which network filesystems do not give
    conn = sqlite3.connect(str(db_path(root)), timeout=60)
    conn.row_factory = sqlite3.Row
    conn.executescript(SCHEMA)
    info = list(conn.execute("PRAGMA table_info(runs)"))
    have, key = [r[1] for r in info], [r[1] for r in info if r[5]]
    if have == list(COLUMNS[:-1]) and key == ["dir"]:  # the layout before `tampered`: one column added, not
        with conn:                                      # a rebuild (a root of 100,000 runs reads every dir)
            conn.execute("ALTER TABLE runs ADD COLUMN tampered INTEGER")
        have = list(COLUMNS)
    if have != list(COLUMNS) or key != ["dir"]:  # an index of an older layout: the caller rebuilds it
        conn.close()
        raise sqlite3.DatabaseError(f"the index has the columns of an older layout ({len(have)} of {len(COLUMNS)}, "
                                    f"keyed by {', '.join(key) or 'nothing'})")
    return conn


_INSERT = f"INSERT OR REPLACE INTO runs ({', '.join(COLUMNS)}) VALUES ({', '.join('?' for _ in COLUMNS)})"


def _tuples(rows: Iterable[Dict[str, Any]]) -> List[tuple]:
    data = []
    for r in rows:
        r = dict(r)
        r["tags"] = json.dumps(r.get("tags") or [])
        # a row read without its config (rows(configs=False)) keeps the text it was read with
        r["config"] = r["config_json"] if r.get("config") is None and "config_json" in r else \
            json.dumps(r.get("config") or {})
        r["tampered"] = int(bool(r.get("tampered")))
        r["return_value"] = None if r.get("return_value") is None else json.dumps(r["return_value"], default=str)
        data.append(tuple(r.get(c) for c in COLUMNS))
    return data


def upsert(conn: sqlite3.Connection, rows: Iterable[Dict[str, Any]]) -> None:
    with conn:
        conn.executemany(_INSERT, _tuples(rows))


def rows(conn: sqlite3.Connection, sweep_ids: Optional[Iterable[str]] = None, newest: Optional[int] = None,
         configs: bool = True) -> List[Dict[str, Any]]:
    """The indexed runs, oldest first: of these sweeps only (``sweep_ids``), the ``newest`` n only,
    each with its config parsed, or (``configs=False``: a listing that shows none; ~25 us a run) its
    text kept as ``config_json`` and ``config`` None."""
    sql, args = "SELECT * FROM runs", []
    if sweep_ids is not None:
        ids = sorted(set(sweep_ids))
        sql += f" WHERE sweep_id IN ({', '.join('?' for _ in ids)})"
        args += ids
    if newest is not None:
        sql += " ORDER BY created_ts DESC, sweep_id DESC, idx DESC LIMIT ?"
        args.append(max(0, int(newest)))
    else:
        sql += " ORDER BY created_ts, sweep_id, idx"
    out = []
    for rec in conn.execute(sql, args):
        d = dict(rec)
        d["tags"] = json.loads(d["tags"] or "[]")
        if configs:
            d["config"] = json.loads(d["config"] or "{}")
        else:
            d["config_json"], d["config"] = d["config"] or "{}", None
        d["return_value"] = json.loads(d["return_value"]) if d.get("return_value") else None
        d["tampered"] = bool(d.get("tampered"))
        out.append(d)
    return out[::-1] if newest is not None else out


def count(conn: sqlite3.Connection, sweep_ids: Optional[Iterable[str]] = None) -> int:
    """How many runs the index holds (of these sweeps)."""
    if sweep_ids is None:
        return int(conn.execute("SELECT COUNT(*) FROM runs").fetchone()[0])
    ids = sorted(set(sweep_ids))
    return int(conn.execute(f"SELECT COUNT(*) FROM runs WHERE sweep_id IN ({', '.join('?' for _ in ids)})",
                            ids).fetchone()[0])


def sweep_ids(conn: sqlite3.Connection) -> Set[str]:
    """The sweeps the index holds runs of."""
    return {sid for (sid,) in conn.execute("SELECT DISTINCT sweep_id FROM runs")}


def skipped(conn: sqlite3.Connection) -> Dict[str, str]:
    """The run dirs a scan could not read: why, by dir."""
    return {d: reason for d, reason in conn.execute("SELECT dir, reason FROM skipped ORDER BY dir")}


def set_skipped(conn: sqlite3.Connection, found: Dict[str, str], gone: Iterable[str] = ()) -> None:
    """Record these unreadable run dirs (dir -> why) and forget ``gone`` (read since, or removed)."""
    with conn:
        conn.executemany("DELETE FROM skipped WHERE dir = ?", [(d,) for d in gone])
        conn.executemany("INSERT OR REPLACE INTO skipped (dir, reason) VALUES (?, ?)", sorted(found.items()))


def replace_all(root: Path, new_rows: List[Dict[str, Any]], unreadable: Optional[Dict[str, str]] = None) -> None:
    """Rebuild the index into a new file, then rename it over the old one: readers see the old index
    or the new one, and an unreadable (corrupt) old file does not matter. On an error (a full disk, a
    read-only root) the new file is removed and the old one stays."""
    path = db_path(root)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.unlink(missing_ok=True)
        conn = sqlite3.connect(str(tmp), timeout=60)
        try:
            with conn:
                conn.executescript(SCHEMA)
                conn.executemany(_INSERT, _tuples(new_rows))
            set_skipped(conn, unreadable or {})
        finally:
            conn.close()
        os.replace(tmp, path)
    except BaseException:
        for leftover in (tmp, tmp.with_name(tmp.name + "-journal")):
            try:
                leftover.unlink(missing_ok=True)
            except OSError:
                pass
        raise


def lookup(value: Any, dotted: str) -> Optional[Any]:
    node = value
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node
