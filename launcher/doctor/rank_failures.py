"""The doctor's rules over what the ranks left (pure): their recorded errors (the first primary one,
or a killed rank when every error only says a peer went away), their logs when no rank recorded an
error, and status.json's error alone."""
from __future__ import annotations

import re
from typing import Dict, List, Optional

from launcher.doctor.evidence import Evidence
from launcher.doctor.failure_text import (
    COLLECTIVE_TIMEOUT,
    KILLED,
    KILLED_BY_SCHEDULER,
    OOM,
    SCHEDULER_STATE,
    clip,
    exception_line,
    first_line,
    is_primary,
    last_traceback,
    line_at,
    line_with,
    node_oom,
    oom_phase,
    raising_frame,
    ranks_str,
    text_kind,
)
from launcher.doctor.kinds import Diagnosis
from launcher.run.status import Status


# ---- 3: what the ranks recorded ---------------------------------------------------------------------
def from_rank_errors(ev: Evidence) -> Optional[Diagnosis]:
    if not ev.errors:
        return None
    order = [r for r in ev.error_order if r in ev.errors] + [r for r in sorted(ev.errors) if r not in ev.error_order]
    primary = [r for r in order if is_primary(ev.errors[r])]
    if not primary:
        return _killed(ev, peers=order)
    failed = ev.status.failed_rank
    rank = int(failed) if failed is not None and int(failed) in primary else primary[0]
    return _from_text(ev, rank, ev.errors[rank], source=f"ranks: rank {rank}'s recorded error")


def _from_text(ev: Evidence, rank: Optional[int], text: str, source: str) -> Diagnosis:
    kind = text_kind(text)
    exc = exception_line(text) or first_line(text)
    frame = raising_frame(text)
    detail = [f"{source}: {clip(exc, 300)}"]
    if frame:
        detail.append(f"raised at {frame}")
    who = f"rank {rank}" if rank is not None else "a rank"
    if kind == "oom":
        phase, how = oom_phase(text, ev.last_step)
        others = [r for r, t in ev.errors.items() if r != rank and text_kind(t) == "oom"]
        if others:
            detail.append(f"also out of memory: {ranks_str(others)}")
        mbs = ev.config.get("train.micro_batch_size")
        if phase == "step" and mbs is not None:
            detail.append(f"train.micro_batch_size={mbs}, model.seq_len={ev.config.get('model.seq_len')}, "
                          f"train.recompute={ev.config.get('train.recompute')}")
        if phase == "startup":
            detail.append(f"layout: zero.stage={ev.config.get('zero.stage')}, parallelism.tp="
                          f"{ev.config.get('parallelism.tp')}, parallelism.pp={ev.config.get('parallelism.pp')}")
        return Diagnosis("oom_" + phase, f"{who} ran out of memory {how}", rank=rank, detail=detail)
    if kind == "collective_timeout":
        timed_out = [r for r, t in ev.errors.items() if text_kind(t) == "collective_timeout"]
        suspects = [r for r in _all_ranks(ev) if r not in timed_out and r not in _primary_others(ev, timed_out)]
        where = f" at {frame}" if frame else ""
        summary = f"{ranks_str(timed_out or [rank])} timed out in a collective{where}"
        if suspects:
            summary += f", waiting for {ranks_str(suspects)}"
            detail.append(f"{ranks_str(suspects)} recorded no timeout: the rank(s) the collective waited for")
        return Diagnosis("collective_timeout", summary, rank=suspects[0] if suspects else rank, detail=detail)
    if kind == "rendezvous":
        at = f" at {ev.master}" if ev.master else ""
        m = re.search(r"EADDRINUSE|address already in use|Connection refused|timed out(?: after \d+ms)?"
                      r"|Name or service not known|No route to host", text, re.I)
        what = m.group(0) if m else "rendezvous failed"
        if ev.master:
            detail.append(f"ranks: MASTER_ADDR:MASTER_PORT = {ev.master}"
                          + (f" (cluster.master_port={ev.config['cluster.master_port']})"
                             if ev.config.get("cluster.master_port") else " (derived from the job id)"))
        return Diagnosis("rendezvous", f"{who} could not join the process group{at}: {what}", rank=rank,
                         detail=detail)
    if kind == "hang":
        return Diagnosis("hang", f"{who}: {clip(text, 300)}", rank=rank, detail=detail)
    if kind == "node_fault":
        held = node_oom(text)  # out of memory because other processes held the GPU: the node's too
        what = f"{held}: the node's, not the model's" if held else \
            f"the device or its link failed on its node: {clip(exc, 200)}"
        return Diagnosis("node_fault", f"{who}: {what}", rank=rank, detail=detail)
    if kind == "disk_full":
        where = f" at {frame}" if frame else ""
        return Diagnosis("disk_full", f"{who} could not write: the file system is full{where} ({clip(exc, 160)})",
                         rank=rank, detail=detail)
    summary = f"{who} raised {clip(exc, 200)}" + (f" at {frame}" if frame else "")
    return Diagnosis("exception", summary, rank=rank, detail=detail)


def _all_ranks(ev: Evidence) -> List[int]:
    if ev.world_size:
        return list(range(int(ev.world_size)))
    return sorted(set(ev.started) | set(ev.errors))


def _primary_others(ev: Evidence, exclude: List[int]) -> List[int]:
    return [r for r, t in ev.errors.items() if r not in exclude and is_primary(t)]


def _watchdog_ended(ev: Evidence) -> List[int]:
    """Ranks the run's own watchdog ended because a peer had failed (their log says so)."""
    out = []
    for r, text in ev.logs.items():
        if re.search(rf"\[watchdog\] rank {r}: \S+ failed; ending this rank", text):
            out.append(r)
    return out


def _signal_lines(ev: Evidence) -> Dict[int, str]:
    """rank -> the log line that says it was killed by a signal (srun's ``task N: Killed``, a rank's own
    last words)."""
    out: Dict[int, str] = {}
    for r, text in sorted(ev.logs.items()):
        for m in (m for p in (KILLED, *KILLED_BY_SCHEDULER) for m in p.finditer(text)):
            groups = m.groupdict()
            n = groups.get("task") or groups.get("rank")
            out.setdefault(int(n) if n is not None else r, line_at(text, m.start(), m.end()))
    return out


def _killed(ev: Evidence, peers: List[int]) -> Diagnosis:
    """Every recorded error only says a peer went away: the rank that left no error died."""
    signalled = _signal_lines(ev)
    ended = set(_watchdog_ended(ev))
    silent = [r for r in _all_ranks(ev) if r not in ev.errors and r not in ended]
    # a rank that recorded a peer's symptom and was then killed by the scheduler (srun's kill-on-bad-exit
    # while it sealed the run) did not die first: the signalled ranks without an error did
    dead = (sorted((set(signalled) - set(ev.errors)) | set(silent)) or sorted(set(signalled))
            or sorted(set(_all_ranks(ev)) - set(ev.errors)))
    first = peers[0]
    detail = [f"ranks: {ranks_str(peers)} recorded only that a peer went away: "
              f"{clip(exception_line(ev.errors[first]) or first_line(ev.errors[first]), 200)}"]
    for r in dead:
        if r in signalled:
            detail.append(f"log: {signalled[r]}")
        elif r in ev.started or not ev.started:
            detail.append(f"rank {r} recorded no error and its log has no traceback")
    if ended:
        detail.append(f"{ranks_str(ended)} ended by the run's watchdog after the failure")
    if not dead:
        return Diagnosis("killed_rank", "a rank died without a trace: its peers saw the connection drop",
                         detail=detail)
    how = " (SIGKILL)" if any(r in signalled for r in dead) else " (no error recorded: killed by a signal?)"
    return Diagnosis("killed_rank", f"{ranks_str(dead)} died{how}; its peers only saw the connection drop",
                     rank=dead[0], detail=detail)


# ---- 4: the logs, when no rank recorded an error ------------------------------------------------------
def from_logs(ev: Evidence) -> Optional[Diagnosis]:
    for r, text in sorted(ev.logs.items()):
        if OOM.search(text):
            tb = last_traceback(text)
            return _from_text(ev, r, tb if tb and OOM.search(tb) else line_with(text, OOM), source=f"log of rank {r}")
    signalled = _signal_lines(ev)
    if signalled:
        r = min(signalled)
        return Diagnosis("killed_rank", f"{ranks_str(signalled)} killed by a signal", rank=r,
                         detail=[f"log: {line}" for line in signalled.values()])
    # NCCL's watchdog aborts the process: a log line, no Python traceback
    timed = [r for r, text in sorted(ev.logs.items()) if COLLECTIVE_TIMEOUT.search(text)]
    if timed:
        suspects = [r for r in _all_ranks(ev) if r not in timed]
        summary = f"{ranks_str(timed)} timed out in a collective"
        detail = [f"log of rank {timed[0]}: " + clip(line_with(ev.logs[timed[0]], COLLECTIVE_TIMEOUT), 300)]
        if suspects:
            summary += f", waiting for {ranks_str(suspects)}"
            detail.append(f"{ranks_str(suspects)} logged no timeout: the rank(s) the collective waited for")
        return Diagnosis("collective_timeout", summary, rank=suspects[0] if suspects else timed[0], detail=detail)
    for r, text in sorted(ev.logs.items()):
        tb = last_traceback(text)
        if tb and is_primary(tb):
            return _from_text(ev, r, tb, source=f"log of rank {r}")
    return None


# ---- 5: only status.json's error ---------------------------------------------------------------------
def from_status_text(ev: Evidence) -> Optional[Diagnosis]:
    err = str(ev.status.error or "")
    if not err or ev.status.state is Status.cancelled or SCHEDULER_STATE.search(err):
        return None
    if text_kind(err) == "peer_gone":
        return _killed(ev, peers=[int(ev.status.failed_rank or 0)]) if ev.errors else None
    rank = ev.status.failed_rank
    return _from_text(ev, int(rank) if rank is not None else None, err, source="status")
