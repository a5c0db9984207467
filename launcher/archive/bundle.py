"""The run directory: what the launcher writes before submission and what the job adds.

Layout of one run dir (runs_root/<sweep_id>/<index>/):
  run.json        identity: run_id, sweep_id, index, created, seed, argv, layout, backend
  config.yaml     the RESOLVED config (interpolations resolved) the job runs with
  overrides.yaml  the command-line overrides and config-group choices that produced it
  code/           git.json (commit, branch, dirty) and patch.diff (uncommitted + untracked changes)
  env/            software.json (versions) and pip-freeze.txt
  job.json        submission: backend, job id, array ids, submitit folder, log paths
  sbatch.sh       the exact sbatch script (Slurm only)
  status.json     status, exit code, timestamps, error (written by the job)
  ranks/          rank_<r>.json: hostname, Slurm node name, pid of every rank
  metrics.jsonl   one JSON object per training step (rank 0)
"""
from __future__ import annotations

import datetime as _dt
import os
import secrets
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import yaml

from launcher.archive import atomic

STATUSES = ("pending", "running", "completed", "failed", "cancelled", "timeout", "requeued")
FINAL = ("completed", "failed", "cancelled", "timeout")

RUN_FILE = "run.json"
STATUS_FILE = "status.json"
CONFIG_FILE = "config.yaml"
JOB_FILE = "job.json"
METRICS_FILE = "metrics.jsonl"


def now_iso() -> str:
    return _dt.datetime.now().astimezone().isoformat(timespec="seconds")


def new_sweep_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(2)


def run_id_for(sweep_id: str, index: int) -> str:
    return f"{sweep_id}-{index}"


def write_run(
    run_dir: Path,
    *,
    run_id: str,
    sweep_id: str,
    index: int,
    resolved: Dict[str, Any],
    overrides: List[str],
    choices: Dict[str, Any],
    argv: List[str],
    layout: Dict[str, Any],
    code: Dict[str, Any],
    software: Dict[str, Any],
    pip_freeze: str,
    extra: Optional[Dict[str, Any]] = None,
) -> None:
    """Write everything known before submission. run.json goes last: a dir without it is not a run."""
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic.write_text(run_dir / CONFIG_FILE, yaml.safe_dump(resolved, sort_keys=False))
    atomic.write_text(
        run_dir / "overrides.yaml",
        yaml.safe_dump({"overrides": list(overrides), "choices": dict(choices)}, sort_keys=False),
    )
    atomic.write_json(run_dir / "code" / "git.json", {k: v for k, v in code.items() if k != "patch"})
    atomic.write_text(run_dir / "code" / "patch.diff", str(code.get("patch") or ""))
    atomic.write_json(run_dir / "env" / "software.json", software)
    atomic.write_text(run_dir / "env" / "pip-freeze.txt", pip_freeze)
    set_status(run_dir, "pending")
    atomic.write_json(
        run_dir / RUN_FILE,
        {
            "run_id": run_id,
            "sweep_id": sweep_id,
            "index": index,
            "name": resolved.get("name"),
            "created": now_iso(),
            "created_ts": time.time(),
            "seed": resolved.get("seed"),
            "tags": resolved.get("tags", []),
            "backend": resolved.get("cluster", {}).get("backend"),
            "argv": list(argv),
            "layout": layout,
            **(extra or {}),
        },
    )


def set_status(run_dir: Path, status: str, **extra: Any) -> None:
    assert status in STATUSES, status
    prev = atomic.read_json(run_dir / STATUS_FILE, {}) or {}
    record = {**prev, **extra, "status": status, "updated": now_iso()}
    if status == "running" and "started" not in record:
        record["started"] = now_iso()
    if status in FINAL:
        record["ended"] = now_iso()
    atomic.write_json(run_dir / STATUS_FILE, record)


def read_status(run_dir: Path) -> Dict[str, Any]:
    return atomic.read_json(Path(run_dir) / STATUS_FILE, {}) or {}


def read_run(run_dir: Path) -> Optional[Dict[str, Any]]:
    return atomic.read_json(Path(run_dir) / RUN_FILE)


def load_config(run_dir: Path) -> Dict[str, Any]:
    return yaml.safe_load((Path(run_dir) / CONFIG_FILE).read_text())


def read_metrics(run_dir: Path) -> List[Dict[str, Any]]:
    import json

    path = Path(run_dir) / METRICS_FILE
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written right now
            pass
    return rows


def iter_sweep_dirs(runs_root: Path) -> List[Path]:
    root = Path(runs_root)
    if not root.is_dir():
        return []
    return sorted(d for d in root.iterdir() if d.is_dir() and not d.name.startswith("."))


def iter_run_dirs(runs_root: Path, sweep: Optional[str] = None) -> List[Path]:
    """Every archived run under runs_root (a dir counts once its run.json exists; staging dirs,
    whose names start with '.', never count)."""
    sweeps = [Path(runs_root) / sweep] if sweep else iter_sweep_dirs(runs_root)
    out = []
    for sd in sweeps:
        if not sd.is_dir():
            continue
        for rd in sorted(sd.iterdir(), key=lambda p: (len(p.name), p.name)):
            if not rd.name.startswith(".") and (rd / RUN_FILE).is_file():
                out.append(rd)
    return out


def rank_file(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / "ranks" / f"rank_{rank}.json"


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


MANIFEST_FILE = "manifest.json"


def _sha256(path: Path) -> str:
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def finalize(run_dir: Path) -> Dict[str, Any]:
    """Seal a run whose status is final: manifest.json with the sha256 of every file, then every
    file read-only. Idempotent."""
    run_dir = Path(run_dir)
    files = {}
    for p in sorted(run_dir.rglob("*")):
        if p.is_file() and p.name != MANIFEST_FILE and not p.name.endswith(".tmp"):
            files[str(p.relative_to(run_dir))] = _sha256(p)
    manifest = {"run_dir": str(run_dir), "sealed": now_iso(), "status": read_status(run_dir).get("status"),
                "files": files}
    mpath = run_dir / MANIFEST_FILE
    if mpath.exists():
        os.chmod(mpath, 0o644)
    atomic.write_json(mpath, manifest)
    for p in run_dir.rglob("*"):
        if p.is_file():
            os.chmod(p, p.stat().st_mode & ~0o222)
    return manifest


def verify(run_dir: Path) -> List[str]:
    """Files whose content no longer matches the manifest (empty = intact)."""
    manifest = atomic.read_json(Path(run_dir) / MANIFEST_FILE)
    if not manifest:
        return ["manifest.json missing"]
    bad = []
    for rel, digest in manifest["files"].items():
        p = Path(run_dir) / rel
        if not p.is_file() or _sha256(p) != digest:
            bad.append(rel)
    return bad
