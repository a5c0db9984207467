"""The node-health ledger: a directory of events, one file each, that every job of a user (or of a team
sharing the directory) appends to and every submission reads (launcher.features.nodes.rule decides).

One file per event, written whole and renamed into place (launcher.archive.atomic): two jobs appending at
once on two nodes never interleave, on NFS too (where O_APPEND is not atomic across clients). Where:
``cluster.health.ledger``, else ``<submit.runs_root>/nodes``. Nothing here imports torch.
"""
from __future__ import annotations

import json
import os
import secrets
import sys
import time
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional

from launcher.archive import atomic
from launcher.features.nodes.rule import CLEARED, KINDS, Event, NodeState, Settings, states
from launcher.run.io import Unreadable, read_bounded

DIR = "nodes"  # under the runs root, unless cluster.health.ledger names another directory
EVENTS = "events"
EVENT_MAX = 64 * 1024  # an event is a few hundred bytes: a larger file is no event


def health_of(cfg: Mapping[str, Any]) -> Mapping[str, Any]:
    """A run config's ``cluster.health`` ({}: none: every default)."""
    return (cfg.get("cluster") or {}).get("health") or {}


def ledger_dir(cfg: Mapping[str, Any], runs_root: Optional[Path] = None) -> Path:
    """The ledger of a run's config (``cluster.health.ledger``, else the runs root's ``nodes/``)."""
    health = health_of(cfg)
    if health.get("ledger"):
        return Path(str(health["ledger"])).expanduser()
    root = runs_root if runs_root is not None else Path(str((cfg.get("submit") or {}).get("runs_root") or "runs"))
    return Path(root).expanduser() / DIR


def settings_of(cfg: Mapping[str, Any]) -> Settings:
    health = health_of(cfg)
    return Settings(exclude_after=int(health.get("exclude_after", 2)),
                    window_s=float(health.get("window_h", 24.0)) * 3600.0,
                    expire_s=float(health.get("expire_h", 24.0)) * 3600.0)


def enabled(cfg: Mapping[str, Any]) -> bool:
    return bool(health_of(cfg).get("enabled", True))


class Ledger:
    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    @property
    def events_dir(self) -> Path:
        return self.path / EVENTS

    def append(self, event: Event) -> Path:
        """One event, written whole; the file's name sorts by time."""
        if event.kind not in KINDS:
            raise ValueError(f"unknown node event kind {event.kind!r} (one of {', '.join(KINDS)})")
        name = f"{int(event.time * 1e6):020d}-{_safe(event.node)}-{secrets.token_hex(3)}.json"
        path = self.events_dir / name
        self.events_dir.mkdir(parents=True, exist_ok=True)
        atomic.write_json(path, asdict(event), visible=True)
        return path

    def events(self) -> List[Event]:
        """Every event; a file that is no event (junk, too large, a special file) is skipped, said once."""
        if not self.events_dir.is_dir():
            return []
        names = {f.name for f in fields(Event)}
        out: List[Event] = []
        skipped = 0
        for path in sorted(self.events_dir.glob("*.json")):
            try:
                raw = json.loads(read_bounded(path, EVENT_MAX))
                out.append(Event(**{k: v for k, v in raw.items() if k in names}))
            except (OSError, Unreadable, ValueError, TypeError, AttributeError):
                skipped += 1
        if skipped:
            print(f"launcher: the node ledger {self.path}: {skipped} file(s) that are no event skipped",
                  file=sys.stderr)
        return out

    def states(self, settings: Settings, now: Optional[float] = None) -> Dict[str, NodeState]:
        return states(self.events(), time.time() if now is None else now, settings)

    def clear(self, node: str, who: str = "") -> Path:
        return self.append(Event(node=node, time=time.time(), kind=CLEARED,
                                 detail=f"by {who or os.environ.get('USER') or 'hand'}"))


def _safe(node: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in node)[:64] or "node"
