"""The login side of the ledger: what every submission leaves out (no torch).

Every way a job is queued (launch, sweeps and their waves, resume, retry, reproduce, preflight, packs,
the jobs a run queues for itself) builds its scheduler parameters through the backend, which asks here
once per submission: the ledger is read once per process while it is unchanged (a 10,000-point sweep
reads it once), and the line saying what is left out is printed once.
"""
from __future__ import annotations

import functools
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Tuple

from launcher.features.nodes.ledger import EVENTS, Ledger, enabled, health_of, ledger_dir, settings_of
from launcher.features.nodes.rule import Exclusion, exclusion

_said: set = set()
_recent: Dict[Tuple[Any, ...], Tuple[float, Dict[str, Any]]] = {}  # the ledger's states by where and how it is read
FRESH_S = 1.0  # read again at most this often: a sweep of 10,000 points asks per point, in a few seconds


def _stamp(path: Path) -> int:
    try:
        return (path / EVENTS).stat().st_mtime_ns
    except OSError:
        return 0


@functools.lru_cache(maxsize=16)
def _states(path: str, stamp: int, settings: Any, minute: int) -> dict:
    # (cached while the events dir is unchanged, re-read each minute for expiries)
    return Ledger(Path(path)).states(settings)


def _node_states(cfg: Mapping[str, Any], runs_root: Optional[Path]) -> Dict[str, Any]:
    health = health_of(cfg)
    key = (health.get("ledger"), str(runs_root or (cfg.get("submit") or {}).get("runs_root")),
           health.get("exclude_after"), health.get("window_h"), health.get("expire_h"))
    now = time.monotonic()
    hit = _recent.get(key)
    if hit is not None and now - hit[0] < FRESH_S:
        return hit[1]
    path = ledger_dir(cfg, runs_root)
    by_node = _states(str(path), _stamp(path), settings_of(cfg), int(time.time() // 60))
    _recent[key] = (now, by_node)
    return by_node


def for_job(cfg: Mapping[str, Any], job_nodes: int, usable: Optional[Callable[[], Optional[Sequence[str]]]] = None,
            also: Sequence[str] = (), runs_root: Optional[Path] = None) -> Exclusion:
    """What a job of ``job_nodes`` nodes of the run config ``cfg`` leaves out. ``usable``: the partition's
    node names, asked only where the ledger excludes something (None: unknown)."""
    if not enabled(cfg):
        return Exclusion(())
    by_node = _node_states(cfg, runs_root)
    if not also and not any(s.state == "excluded" for s in by_node.values()):
        return Exclusion(())
    return exclusion(by_node, job_nodes, usable() if usable is not None else None, also)


def say(ex: Exclusion, out=None) -> None:
    """The exclusion's line, once per process (a sweep of many arrays says it once)."""
    if ex.why and ex.why not in _said:
        _said.add(ex.why)
        print(f"launcher: {ex.why}", file=out or sys.stderr, flush=True)


def merged(existing: Optional[str], nodes: Tuple[str, ...]) -> str:
    """sbatch --exclude's value: the user's own list and the ledger's, each node once."""
    mine = [n for n in str(existing or "").split(",") if n.strip()]
    return ",".join(dict.fromkeys([*mine, *nodes]))
