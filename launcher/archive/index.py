"""The run registry: an SQLite index over the run dirs under a runs root.

The run dirs are the truth and the index can always be rebuilt from them (`reindex`). Only the
login-node side (launch, the CLI) writes it; compute nodes write only their own run dir, so a
100-task array never contends for the database file.
"""
from __future__ import annotations

import json
import os
import sqlite3
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional

DB_NAME = "registry.sqlite"

COLUMNS = (
    "run_id", "sweep_id", "idx", "name", "dir", "status", "exit_code", "job_id", "backend", "created",
    "created_ts", "tags", "config", "final_loss", "tokens_per_s", "error", "reproduces", "return_value",
    "failure_class",
)
SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
  run_id TEXT PRIMARY KEY, sweep_id TEXT, idx INTEGER, name TEXT, dir TEXT, status TEXT,
  exit_code INTEGER, job_id TEXT, backend TEXT, created TEXT, created_ts REAL, tags TEXT,
  config TEXT, final_loss REAL, tokens_per_s REAL, error TEXT, reproduces TEXT, return_value TEXT,
  failure_class TEXT
);
CREATE INDEX IF NOT EXISTS runs_sweep ON runs (sweep_id);
CREATE INDEX IF NOT EXISTS runs_status ON runs (status);
"""


def db_path(root: Path) -> Path:
    return Path(root) / DB_NAME


def connect(root: Path) -> sqlite3.Connection:
    Path(root).mkdir(parents=True, exist_ok=True)
    # rollback journal, not WAL: WAL needs shared memory, which network filesystems do not give
    conn = sqlite3.connect(str(db_path(root)), timeout=60)
    conn.row_factory = sqlite3.Row
    conn.executescript(SCHEMA)
    have = [r[1] for r in conn.execute("PRAGMA table_info(runs)")]
    if have != list(COLUMNS):  # an index of an older layout: the caller rebuilds it from the run dirs
        conn.close()
        raise sqlite3.DatabaseError(f"the index has the columns of an older layout ({len(have)} of {len(COLUMNS)})")
    return conn


_INSERT = f"INSERT OR REPLACE INTO runs ({', '.join(COLUMNS)}) VALUES ({', '.join('?' for _ in COLUMNS)})"


def _tuples(rows: Iterable[Dict[str, Any]]) -> List[tuple]:
    data = []
    for r in rows:
        r = dict(r)
        r["tags"] = json.dumps(r.get("tags") or [])
        r["config"] = json.dumps(r.get("config") or {})
        r["return_value"] = None if r.get("return_value") is None else json.dumps(r["return_value"], default=str)
        data.append(tuple(r.get(c) for c in COLUMNS))
    return data


def upsert(conn: sqlite3.Connection, rows: Iterable[Dict[str, Any]]) -> None:
    with conn:
        conn.executemany(_INSERT, _tuples(rows))


def rows(conn: sqlite3.Connection) -> List[Dict[str, Any]]:
    out = []
    for rec in conn.execute("SELECT * FROM runs ORDER BY created_ts, sweep_id, idx"):
        d = dict(rec)
        d["tags"] = json.loads(d["tags"] or "[]")
        d["config"] = json.loads(d["config"] or "{}")
        d["return_value"] = json.loads(d["return_value"]) if d.get("return_value") else None
        out.append(d)
    return out


def replace_all(root: Path, new_rows: List[Dict[str, Any]]) -> None:
    """Rebuild the index into a new file, then rename it over the old one: readers see the old index
    or the new one, and an unreadable (corrupt) old file does not matter."""
    path = db_path(root)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    conn = sqlite3.connect(str(tmp), timeout=60)
    try:
        with conn:
            conn.executescript(SCHEMA)
            conn.executemany(_INSERT, _tuples(new_rows))
    finally:
        conn.close()
    os.replace(tmp, path)


def lookup(value: Any, dotted: str) -> Optional[Any]:
    node = value
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node
