"""The evidence of a run for ``launcher doctor``: ``Evidence`` (everything ``diagnose`` reads) and
``gather``, which reads it from a run dir: status.json, each rank's recorded traceback, the tail of each
rank's logs, the hang finding and stacks, the restart records, earlier attempts' files, the last step,
the config values the fixes name and (optionally) the scheduler's state of the job."""
from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Tuple

from launcher import backends
from launcher.doctor.failure_text import HANG_MESSAGE
from launcher.features.nodes.ledger import Ledger, enabled, ledger_dir, settings_of
from launcher.features.nodes.rule import EXCLUDED, states
from launcher.run.io import Unreadable, read_tail
from launcher.run.rundir import RunDir
from launcher.run.status import RunStatus, Status


# ---- the evidence ----------------------------------------------------------------------------------
@dataclass
class Evidence:
    """Everything ``diagnose`` reads; built by ``gather`` from a run dir, or by hand in tests."""

    run_id: str = ""
    status: RunStatus = field(default_factory=RunStatus)  # status.json (a mapping of it is read as one)
    world_size: Optional[int] = None
    started: List[int] = field(default_factory=list)  # ranks that recorded their start
    master: Optional[str] = None  # MASTER_ADDR:MASTER_PORT the ranks used
    errors: Dict[int, str] = field(default_factory=dict)  # rank -> recorded traceback (this attempt)
    error_order: List[int] = field(default_factory=list)  # ranks, in the order their errors were recorded
    logs: Dict[int, str] = field(default_factory=dict)  # rank -> tail of its stderr and stdout
    scheduler: Optional[str] = None  # the scheduler's word for the job (TIMEOUT, NODE_FAIL, ...)
    scheduler_ended: Optional[bool] = None  # whether that state is a final one (the backend's mapping)
    hang: Optional[Dict[str, Any]] = None  # hang.json
    stacks: Dict[int, str] = field(default_factory=dict)  # rank -> faulthandler dump
    restarts: List[Dict[str, Any]] = field(default_factory=list)  # restarts.jsonl
    fallbacks: List[Dict[str, Any]] = field(default_factory=list)  # checkpoint_fallbacks.jsonl
    attempts: Dict[int, Evidence] = field(default_factory=dict)  # what earlier attempts left
    last_step: int = 0  # the last step in metrics.jsonl (0: none finished)
    steps: Optional[int] = None  # train.steps
    config: Dict[str, Any] = field(default_factory=dict)  # the values the fixes name (dotted keys)
    free_bytes: Optional[int] = None  # free space of the run dir's file system when gathered
    nodes: List[str] = field(default_factory=list)  # the node ledger's word on the nodes this run failed on

    def __post_init__(self) -> None:
        self.status = RunStatus.of(self.status)

    def errors_of_hang(self) -> bool:
        return bool(self.hang) or any(HANG_MESSAGE.search(t) for t in self.errors.values())

    def to_json(self) -> Dict[str, Any]:
        d = asdict(self)
        d["attempts"] = {a: e.to_json() for a, e in self.attempts.items()}
        d["status"] = self.status.to_json()
        return d


# ---- gathering the evidence from a run dir -----------------------------------------------------------
LOG_TAIL = 64 * 1024  # bytes of each log read from its end


def _tail(path: Path, limit: int = LOG_TAIL) -> str:
    """The end of a log (a FIFO, a device or a socket in its place is never opened for reading: none)."""
    try:
        return read_tail(path, limit).decode("utf-8", errors="replace")
    except (OSError, Unreadable):
        return ""


def _last_metrics_step(path: Path) -> int:
    for line in reversed(_tail(path, 8192).splitlines()):
        try:
            return int(json.loads(line).get("step") or 0)
        except (ValueError, AttributeError):
            continue
    return 0


def _flat(cfg: Dict[str, Any], keys: Iterable[str]) -> Dict[str, Any]:
    out = {}
    for key in keys:
        node: Any = cfg
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        out[key] = node
    return out


CONFIG_KEYS = ("train.steps", "train.micro_batch_size", "train.global_batch_size", "train.recompute",
               "train.hang_timeout_s", "train.dist_timeout_s", "train.max_restarts", "model.seq_len", "zero.stage",
               "parallelism.tp", "parallelism.pp", "cluster.master_port", "cluster.time_min", "cluster.nodes")


def _rank_of(name: str) -> int:
    """``rank_3`` (RunDir.failed_ranks) -> 3."""
    return int(name.rsplit("_", 1)[-1])


def _errors(rd: Any) -> Tuple[Dict[int, str], List[int]]:
    """Each rank's recorded error text, and the ranks in the order they recorded them."""
    texts: Dict[int, str] = {}
    mtimes: Dict[int, float] = {}
    for name in rd.failed_ranks():
        r = _rank_of(name)
        p = rd.rank_error_path(r)  # (an older launcher's in ranks/ too)
        if not p.is_file():  # absent, or no file (a FIFO is never read)
            continue
        try:
            texts[r] = _tail(p, 256 * 1024)
            mtimes[r] = p.stat().st_mtime
        except OSError:
            continue
    return texts, sorted(texts, key=lambda r: (mtimes.get(r, 0.0), r))


def _files(rd: Any) -> Evidence:
    """What the run dir (or an attempt's dir) holds about a failure: errors, hang finding, stacks."""
    errors, order = _errors(rd)
    return Evidence(errors=errors, error_order=order, hang=rd.hang(), stacks=rd.stacks())


def gather(rd: Any, scheduler: bool = False, logs: bool = True, config: Optional[Dict[str, Any]] = None) -> Evidence:
    """The evidence of one run (a RunDir). ``scheduler``: ask the backend for the job's state (one query;
    skipped for a completed run); ``logs``: read the tail of every rank's stderr and stdout; ``config``:
    its config.yaml as the caller read it already (the run index)."""
    rd = rd if isinstance(rd, RunDir) else RunDir(rd)
    meta = rd.run() or {}
    ev = _files(rd)
    ev.run_id = str(meta.get("run_id") or rd.path.name)
    ev.status = rd.status()
    layout = meta.get("layout") or {}
    ev.world_size = layout.get("world_size") or ev.status.world_size
    rank_rows = rd.ranks()
    ev.started = sorted(int(r["rank"]) for r in rank_rows if "rank" in r)
    if rank_rows and rank_rows[0].get("master_addr"):
        ev.master = f"{rank_rows[0]['master_addr']}:{rank_rows[0].get('master_port')}"
    ev.restarts = rd.restarts()
    ev.fallbacks = rd.fallbacks()
    for a in range(1, int(ev.status.attempt or 1) + 1):  # attempts/<a>/ has the run dir's layout
        if rd.attempt_dir(a).is_dir():
            ev.attempts[a] = _files(RunDir(rd.attempt_dir(a)))
    try:
        cfg = config if config is not None else rd.config()
    except (OSError, ValueError):
        cfg = {}
    ev.config = _flat(cfg or {}, CONFIG_KEYS)
    ev.steps = ev.config.get("train.steps")
    ev.last_step = _last_metrics_step(rd.metrics_path)
    ev.nodes = _ledger_lines(rd, cfg or {})
    try:  # a job that died of a full disk may have written nothing else that says so
        st = os.statvfs(rd.path)
        ev.free_bytes = st.f_bavail * st.f_frsize
    except OSError:
        pass
    job = rd.job()
    job = job.read_in(rd.path.parent) if job is not None else None  # a copied archive's own logs
    if job is not None and job.backend and job.job_id and (logs or scheduler):
        try:
            backend = backends.get(job.backend)
        except ValueError:
            backend = None
        if backend is not None and logs:
            for r in range(int(ev.world_size or len(ev.started) or 1)):
                text = ""
                for err in (True, False):
                    try:
                        text += _tail(backend.log_path(job, r, err=err))
                    except (KeyError, TypeError, ValueError):
                        pass
                if text:
                    ev.logs[r] = text
        if backend is not None and scheduler and ev.status.state is not Status.completed:
            try:
                state = backend.states([job.to_json()]).get(job.job_id)
            except Exception:  # a scheduler that cannot be asked leaves the run dir's word
                state = None
            if state is not None:
                ev.scheduler, ev.scheduler_ended = state.raw or state.status.value, state.ended
    return ev


def _ledger_lines(rd: RunDir, cfg: Dict[str, Any]) -> List[str]:
    """What the node ledger (launcher.features.nodes) holds against the nodes this run failed on."""
    if not enabled(cfg):
        return []
    try:
        led = Ledger(ledger_dir(cfg, runs_root=rd.path.parent.parent))
        events = led.events()
    except OSError:
        return []
    mine = [e for e in events if e.run == str(rd.path)]
    if not mine:
        return []
    by_node = states(events, time.time(), settings_of(cfg))
    lines = []
    for node in dict.fromkeys(e.node for e in mine):
        s = by_node.get(node)
        state = s.state if s is not None else "?"
        what = "excluded: left out of every later submission" if state == EXCLUDED else state
        last = [e for e in mine if e.node == node][-1]  # what it saw there (the collective a hang missed, ...)
        lines.append(f"node {node}: {', '.join(dict.fromkeys(e.kind for e in mine if e.node == node))} in this "
                     f"run; the node ledger says {what} ({len(s.events) if s else 0} event(s); `launcher nodes`)"
                     + (f"; the last: {last.detail[:240]}" if last.detail else ""))
    return lines
