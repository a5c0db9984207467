"""What the node-health ledger says of each node (pure: no files, no clock of its own).

A node's events (launcher.features.nodes.ledger) since the last time someone cleared it decide its state:

- ``suspect``: at least one event attributed to the node (a CUDA or NCCL error raised on it, the rank a
  hang waited for), fewer than ``exclude_after`` within ``window_s``;
- ``excluded``: ``exclude_after`` or more within ``window_s``: every later submission leaves it out;
- ``expired``: its last event is older than ``expire_s``: used again (the evidence stays in the ledger);
- ``ok``: nothing since it was cleared (or ever).

``exclusion`` picks the nodes a submission leaves out: never so many that the job cannot be placed.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

OK, SUSPECT, EXCLUDED, EXPIRED = "ok", "suspect", "excluded", "expired"
CLEARED = "cleared"  # the event `launcher nodes --clear NODE` appends: what came before it no longer counts
# what an event says of the node it names (every kind but a clearing counts against it)
KINDS = {
    "cuda_error": "a CUDA error raised on it (ECC, illegal address, device lost)",
    "nccl_error": "an NCCL error raised on it (a system or internal error, not a timeout)",
    "oom_node": "a rank on it ran out of GPU memory that other processes held (the node's, not the model's)",
    "hang": "the rank a hang waited for ran on it",
    "straggler": "a rank on it stayed slower than the others (cluster.health.straggler_ratio)",
    "crashed": "a rank on it was killed or crashed (SIGKILL, SIGSEGV, SIGBUS) without a word",
    "lost": "the scheduler lost it while a job ran on it (down, not responding) and requeued the job",
    CLEARED: "cleared by hand",
}


@dataclass(frozen=True)
class Event:
    """One line of the ledger: what a job saw of one node."""

    node: str
    time: float  # epoch seconds
    kind: str  # a key of KINDS
    run: str = ""  # the run dir
    attempt: int = 0
    job_id: str = ""
    rank: Optional[int] = None
    step: Optional[int] = None
    detail: str = ""

    def line(self) -> str:
        where = f"rank {self.rank}" if self.rank is not None else "a rank"
        at = f" at step {self.step}" if self.step is not None else ""
        return f"{self.kind}: {where}{at}, attempt {self.attempt} of {self.run or '?'}" + (
            f": {self.detail}" if self.detail else "")


@dataclass(frozen=True)
class Settings:
    """cluster.health, in seconds."""

    exclude_after: int = 2
    window_s: float = 24 * 3600.0
    expire_s: float = 24 * 3600.0


@dataclass
class NodeState:
    node: str
    state: str
    events: List[Event] = field(default_factory=list)  # since the last clearing, oldest first
    expires_at: Optional[float] = None  # when an excluded or suspect node is used again

    @property
    def runs(self) -> List[str]:
        return list(dict.fromkeys(e.run for e in self.events if e.run))

    @property
    def evidence(self) -> str:
        return "; ".join(e.line() for e in self.events[-3:])


def states(events: Iterable[Event], now: float, settings: Settings) -> Dict[str, NodeState]:
    """Each node's state at ``now`` from every event of the ledger (any order)."""
    by_node: Dict[str, List[Event]] = {}
    for e in sorted(events, key=lambda e: (e.time, e.kind)):
        by_node.setdefault(e.node, []).append(e)
    out: Dict[str, NodeState] = {}
    for node, evs in sorted(by_node.items()):
        cleared = max((i for i, e in enumerate(evs) if e.kind == CLEARED), default=-1)
        counted = [e for e in evs[cleared + 1:] if e.kind != CLEARED]
        if not counted:
            out[node] = NodeState(node, OK)
            continue
        last = counted[-1].time
        recent = [e for e in counted if now - e.time <= settings.window_s]
        expires = last + settings.expire_s
        if now >= expires:
            state = EXPIRED
        elif len(recent) >= settings.exclude_after:
            state = EXCLUDED
        else:
            state = SUSPECT
        out[node] = NodeState(node, state, counted, expires)
    return out


@dataclass(frozen=True)
class Exclusion:
    nodes: Tuple[str, ...]  # what the submission leaves out
    kept: Tuple[str, ...] = ()  # excluded in the ledger but left in: otherwise the job could not be placed
    why: str = ""  # the line a command prints ("" when nothing is excluded)


def exclusion(by_node: Dict[str, NodeState], job_nodes: int, usable: Optional[Sequence[str]] = None,
              also: Sequence[str] = ()) -> Exclusion:
    """The nodes a job of ``job_nodes`` nodes leaves out: the ledger's excluded ones, and ``also`` (the
    nodes the job itself just failed on). ``usable``: the partition's nodes that could run it (None:
    unknown, every excluded node is left out); never so many left out that fewer than ``job_nodes``
    remain: the nodes with the fewest recent events go back in first, and the line says so."""
    bad = [n for n, s in by_node.items() if s.state == EXCLUDED]
    ranked = list(dict.fromkeys([*also, *sorted(bad, key=lambda n: (-len(by_node[n].events), n))]))
    if not ranked:
        return Exclusion(())
    kept: List[str] = []
    if usable is not None:
        room = max(0, len(usable) - int(job_nodes))
        in_partition = [n for n in ranked if n in set(usable)]
        ranked, kept = in_partition[:room], in_partition[room:]
    if not ranked:
        return Exclusion((), tuple(kept), f"cluster.health: {', '.join(kept)} excluded by the node ledger but "
                         f"used: leaving them out would leave fewer than cluster.nodes={job_nodes} nodes")
    why = f"excluding {', '.join(ranked)} (the node ledger: `launcher nodes`)"
    if kept:
        why += (f"; {', '.join(kept)} used although excluded: leaving them out too would leave fewer than "
                f"cluster.nodes={job_nodes} nodes")
    return Exclusion(tuple(ranked), tuple(kept), why)
