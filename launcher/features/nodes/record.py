"""The node side of the ledger: a job appends what it saw of a node (no torch). Never fails the job: a
ledger that cannot be written is said on stderr and the run goes on."""
from __future__ import annotations

import sys
import time
from typing import Any, Dict, List, Mapping, Optional, Sequence

from launcher.doctor.failure_text import node_oom
from launcher.features.nodes import straggler
from launcher.features.nodes.ledger import Ledger, enabled, ledger_dir, settings_of
from launcher.features.nodes.rule import EXCLUDED, SUSPECT, Event, Exclusion, exclusion

LOST = "lost"  # the kind of a node the scheduler lost under a job (launcher.features.nodes.rule.KINDS)
STRAGGLER = "straggler"  # the kind of its ledger events, and the stop reason of a run requeued without one


def kind_of(error: str) -> str:
    """A node fault's kind in the ledger: GPU memory other processes held, an NCCL error, else a CUDA one."""
    if node_oom(error):
        return "oom_node"
    return "nccl_error" if "nccl" in error.lower() else "cuda_error"


def fault_detail(error: str) -> str:
    """What a node fault's ledger event says: for GPU memory other processes held, that first (what held
    it, how much), then the error."""
    held = node_oom(error)
    return f"{held}; {error}" if held else error


def ledger_of(cfg: Mapping[str, Any], rd: Any) -> Ledger:
    """The ledger of a run (its runs root's, unless cluster.health.ledger names one)."""
    return Ledger(ledger_dir(cfg, runs_root=rd.path.parent.parent))


def note(cfg: Mapping[str, Any], rd: Any, node: Optional[str], kind: str, *, attempt: int = 0,
         job_id: Optional[str] = None, rank: Optional[int] = None, step: Optional[int] = None,
         detail: str = "") -> Optional[Event]:
    """Append one event against ``node`` (None, or cluster.health.enabled=false: nothing)."""
    if not node or not enabled(cfg):
        return None
    event = Event(node=str(node), time=time.time(), kind=kind, run=str(rd.path), attempt=int(attempt or 0),
                  job_id=str(job_id or ""), rank=rank, step=step, detail=detail[:300])
    try:
        ledger_of(cfg, rd).append(event)
    except OSError as e:
        print(f"launcher: the node ledger was not written ({e}); node {node}: {event.line()}", file=sys.stderr,
              flush=True)
        return None
    print(f"launcher: node {node} noted in the node ledger: {event.line()}", file=sys.stderr, flush=True)
    return event


def note_lost(cfg: Mapping[str, Any], rd: Any, backend: Any, attempt: int, job_id: Optional[str]) -> List[Event]:
    """Rank 0 at the start of an attempt the scheduler restarted with no request of the run's (its
    restart row's reason ``scheduler``, or ``preempted``: the TERM of a job Slurm ends for a lost node
    is caught like a preemption's): each node the scheduler lost while the last attempt ran, noted."""
    rows = rd.restarts()
    last = rows[-1] if rows else {}
    if attempt < 2 or last.get("attempt") != attempt or last.get("reason") not in ("scheduler", "preempted") \
            or not enabled(cfg):
        return []
    try:
        lost = backend.lost_nodes(job_id)
    except Exception as e:  # (the scheduler's records unreadable: nothing attributed)
        print(f"launcher: the nodes lost by the last attempt were not asked ({type(e).__name__}: {e})",
              file=sys.stderr, flush=True)
        return []
    out = [note(cfg, rd, node, LOST, attempt=attempt - 1, job_id=job_id,
                detail=f"the scheduler lost it ({why}) and requeued the job") for node, why in sorted(lost.items())]
    return [e for e in out if e is not None]


def for_requeue(cfg: Mapping[str, Any], rd: Any, usable: Optional[Sequence[str]] = None) -> Exclusion:
    """What this run's next attempt leaves out: every node this run failed on (while its events count:
    not cleared, not expired) and the nodes the ledger excludes, never so many that it cannot be placed."""
    if not enabled(cfg):
        return Exclusion(())
    try:
        by_node = ledger_of(cfg, rd).states(settings_of(cfg))
    except OSError:
        return Exclusion(())
    mine = [n for n, s in by_node.items() if s.state in (SUSPECT, EXCLUDED) and str(rd.path) in s.runs]
    job_nodes = int(((cfg.get("cluster") or {}).get("nodes")) or 1)
    return exclusion(by_node, job_nodes, usable, also=mine)


def note_hang(cfg: Mapping[str, Any], rd: Any, finding: Optional[Mapping[str, Any]], rank: int, node: Optional[str],
              attempt: int, job_id: Optional[str]) -> None:
    """A hang's events: each stuck rank that can still run Python notes its own node; the lowest rank that
    is not stuck notes the nodes of the ranks that left no stack (dead, or stopped), from their records."""
    if not finding:
        return
    stuck = [int(r) for r in finding.get("stuck_ranks") or []]
    silent = [int(r) for r in finding.get("no_stack") or []]
    waiting = finding.get("waiting") or {}
    kinds = "/".join(sorted(set(str(v) for v in waiting.values()))) or "a collective"
    step = finding.get("step")
    missed = f"the others waited in {kinds} after step {step}"
    c = finding.get("collective") or {}
    if isinstance(c, dict) and c.get("seq") is not None:
        missed = (f"the others waited in collective #{c['seq']} ({c.get('kind') or kinds}) of process group "
                  f"{c.get('group')} after step {step}")
    if rank in stuck and rank not in silent:
        note(cfg, rd, node, "hang", attempt=attempt, job_id=job_id, rank=rank, step=step,
             detail=f"rank {rank} stuck; {missed}")
    others = [r for r in sorted(int(k) for k in waiting)]
    if silent and others and rank == others[0]:
        nodes = rank_nodes(rd)
        for r in silent:
            note(cfg, rd, nodes.get(r), "hang", attempt=attempt, job_id=job_id, rank=r, step=step,
                 detail=f"rank {r} left no stack (stopped or dead); {missed}")


class Stragglers:
    """A rank's straggler watch (launcher.features.nodes.straggler): every rank feeds it every rank's
    timings of a step and gets the same verdict. A straggler is named once per attempt: its own rank notes
    its node in the ledger, rank 0 says so in the log. Returns STRAGGLER where the run must stop to be
    requeued without it (past the requeue ratio, while ``can_requeue``: the restart budget lasts)."""

    def __init__(self, cfg: Mapping[str, Any], rd: Any, rank: int, world: int, node: Optional[str], *,
                 attempt: int, job_id: Optional[str], can_requeue: bool) -> None:
        self.cfg, self.rd, self.rank, self.node = cfg, rd, int(rank), node
        self.attempt, self.job_id, self.can_requeue = attempt, job_id, can_requeue
        self.thresholds = straggler.thresholds_of(cfg)
        self.detector = straggler.Detector(self.thresholds, world)
        self.named: set = set()
        self.line = ""  # the last straggler's line (the requeue's detail)

    @property
    def on(self) -> bool:
        return self.thresholds.on and self.detector.world > 1

    def feed(self, own: Sequence[float], data: Sequence[float], step: Optional[int]) -> Optional[str]:
        found = self.detector.feed(own, data)
        if found is None:
            return None
        requeue = found.requeue and self.can_requeue
        key = (found.rank, found.kind)
        if key not in self.named or (requeue and (*key, "requeue") not in self.named):
            node = self.node if found.rank == self.rank else rank_nodes(self.rd).get(found.rank)
            self.line = found.line(node, self.thresholds.window)
            if found.rank == self.rank and key not in self.named:  # one ledger event per straggler an attempt
                note(self.cfg, self.rd, self.node, STRAGGLER, attempt=self.attempt, job_id=self.job_id,
                     rank=self.rank, step=step, detail=self.line)
            if self.rank == 0:
                print(f"launcher: {self.line}" + ("; saving, then requeued without that node" if requeue else ""),
                      file=sys.stderr, flush=True)
            self.named.update({key, *([(*key, "requeue")] if requeue else [])})
        return STRAGGLER if requeue else None



def rank_nodes(rd: Any) -> Dict[int, Optional[str]]:
    """Each rank's node, from the run's rank records (the scheduler's name for it, else the hostname)."""
    return {int(r["rank"]): r.get("slurmd_nodename") or r.get("hostname") for r in rd.ranks() if "rank" in r}
