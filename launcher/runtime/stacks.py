"""Reading the Python stacks the hang watchdog dumps (faulthandler's format), pure functions.

A hang looks like this: one rank is stuck somewhere that is not a collective (a dead loop, a sleep,
a blocked read, a deadlock) while every other rank waits for it inside a collective. So each rank's
main thread is classified by its innermost frames: inside torch.distributed (which collective) or not
(the frame it is stuck in).
"""
from __future__ import annotations

import re
from typing import Dict, List, Optional, Tuple

_THREAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-f]+)")
_FRAME = re.compile(r'^\s+File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')
MAIN_MARKERS = ("launcher/runtime/task.py", "submitit/core/_submit.py", "submitit/core/submission.py")
COLLECTIVE_FILES = ("torch/distributed/", "deepspeed/comm/")
# innermost frames that wait for other ranks without a torch.distributed Python frame on top:
# (file, function) -> what the rank waits in
WAITING_FRAMES = {
    ("torch/autograd/graph.py", "_engine_run_backward"): "backward (DDP/ZeRO gradient reduction)",
}


def threads(dump: str) -> List[List[Tuple[str, int, str]]]:
    """Each thread's frames, innermost first: (file, line, function)."""
    out: List[List[Tuple[str, int, str]]] = []
    for line in dump.splitlines():
        if _THREAD.match(line):
            out.append([])
            continue
        m = _FRAME.match(line)
        if m and out:
            out[-1].append((m["file"], int(m["line"]), m["func"]))
    return out


def main_thread(dump: str) -> List[Tuple[str, int, str]]:
    """The frames of the thread that runs the job (the one whose stack holds the task's entry)."""
    for frames in threads(dump):
        if any(any(mark in f for mark in MAIN_MARKERS) for f, _, _ in frames):
            return frames
    ts = threads(dump)
    return ts[-1] if ts else []


def where(dump: str) -> Dict[str, Optional[str]]:
    """{"collective": name or None, "frame": "file:line in func" of the innermost frame outside
    torch.distributed and the standard library's threading}."""
    frames = main_thread(dump)
    collective = None
    if frames:
        f, _, func = frames[0]
        collective = next((name for (file, fn), name in WAITING_FRAMES.items() if f.endswith(file) and fn == func),
                          None)
        if collective is None and "/torch/" in f and not any(c in f for c in COLLECTIVE_FILES):
            # inside torch without a Python frame of torch.distributed on top: a C++ collective that
            # torch issues itself (DDP's buffer broadcast or bucket rebuild in forward, ...)
            collective = f"{func} ({_short(f)})"
    for f, _, func in frames if collective is None else []:
        if any(c in f for c in COLLECTIVE_FILES):
            if collective is None or "distributed_c10d" in f:
                collective = func
        elif collective is not None:
            break
    own = next(((f, ln, fn) for f, ln, fn in frames if not any(c in f for c in COLLECTIVE_FILES)
                and "/threading.py" not in f and "/torch/" not in f), None)
    frame = f"{_short(own[0])}:{own[1]} in {own[2]}" if own else None
    return {"collective": collective, "frame": frame}


_COUNTS = re.compile(r"^# collectives issued: (?P<counts>.*)$", re.M)


def counts_line(counts: Dict[str, int]) -> str:
    """The dump's header line of how many collectives this rank has issued, per process group."""
    return "# collectives issued: " + " ".join(f"{g}={n}" for g, n in sorted(counts.items())) + "\n"


def counts(dump: str) -> Dict[str, int]:
    """The counts of ``counts_line`` in a dump (empty: none recorded, e.g. no process group)."""
    m = _COUNTS.search(dump)
    out: Dict[str, int] = {}
    for item in (m["counts"].split() if m else []):
        group, _, n = item.rpartition("=")
        if group and n.isdigit():
            out[group] = int(n)
    return out


def missed(by_rank: Dict[int, Dict[str, int]], waiting: Dict[int, str], world: int) -> Optional[Dict[str, object]]:
    """The collective the hang waits in, by its sequence number: the group and number the waiting ranks
    issued last (the highest), the kind they wait in, and the ranks that never issued it (behind on that
    group's count, or no dump at all). None where the ranks recorded no counts."""
    best: Optional[Tuple[str, int]] = None
    for r in waiting:
        for group, n in by_rank.get(r, {}).items():
            behind = [q for q in range(world) if by_rank.get(q, {}).get(group, -1) < n]
            if behind and (best is None or n > best[1]):
                best = (group, n)
    if best is None:
        return None
    group, n = best
    in_it = sorted(r for r in waiting if by_rank.get(r, {}).get(group) == n)
    kinds = sorted({waiting[r] for r in in_it})
    return {"group": group, "seq": n, "kind": "/".join(kinds), "waiting": in_it,
            "missing": [q for q in range(world) if by_rank.get(q, {}).get(group, -1) < n]}


def finding(dumps: Dict[int, str], world: int, step: Optional[int], timeout_s: float) -> Dict[str, object]:
    """hang.json: which ranks are stuck outside a collective (the cause), which wait in one, and which
    left no stack at all (dead, or stuck where Python cannot run); where the ranks recorded how many
    collectives they issued, the collective the others wait in that the stuck ones never joined."""
    stuck, waiting, frames = [], {}, {}
    for rank in sorted(dumps):
        w = where(dumps[rank])
        frames[rank] = w["frame"]
        if w["collective"]:
            waiting[rank] = w["collective"]
        else:
            stuck.append(rank)
    silent = [r for r in range(world) if r not in dumps]
    out: Dict[str, object] = {"step": step, "timeout_s": timeout_s, "stuck_ranks": stuck + silent,
                              "waiting": waiting, "frames": frames, "no_stack": silent}
    collective = missed({r: counts(d) for r, d in dumps.items()}, waiting, world)
    if collective is not None:
        out["collective"] = collective
    return out


def missed_line(f: Dict[str, object]) -> str:
    """One line naming the collective a hang's stuck ranks never joined ("" where none was recorded)."""
    c = f.get("collective") or {}
    if not isinstance(c, dict) or not c.get("missing"):
        return ""
    missing = ", ".join(str(r) for r in c["missing"])
    return (f"rank(s) {missing} never joined collective #{c['seq']} ({c.get('kind') or '?'}) of process group "
            f"{c['group']}, which rank(s) {', '.join(str(r) for r in c.get('waiting') or [])} wait in")


def describe(f: Dict[str, object]) -> str:
    stuck = f.get("stuck_ranks") or []
    frames = f.get("frames") or {}
    parts = []
    for r in stuck:
        at = frames.get(r) or frames.get(str(r))
        parts.append(f"rank {r} stuck " + (f"in {at}" if at else "(no stack: dead or outside Python)"))
    waiting = f.get("waiting") or {}
    line = missed_line(f)
    if line:
        parts.append(line)
    elif waiting:
        names = sorted(set(waiting.values()))
        parts.append(f"rank(s) {', '.join(str(r) for r in sorted(waiting, key=int))} wait in {'/'.join(names)}")
    return "; ".join(parts) or "no rank finished a step"


def _short(path: str) -> str:
    for root in ("recipes/", "launcher/", "torch/", "deepspeed/"):
        i = path.rfind("/" + root)
        if i >= 0:
            return path[i + 1:]
    return path
