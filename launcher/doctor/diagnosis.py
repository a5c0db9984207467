"""``diagnose`` (pure: one Diagnosis for the evidence) and ``classify`` (gather + diagnose): the order
of the rules (the hang watchdog, the scheduler, the ranks' errors, their logs, status.json), the live
and completed states, the restart history, and the hang and scheduler rules themselves."""
from __future__ import annotations

import re
from typing import Any, Dict, List, Optional

from launcher.doctor.evidence import Evidence, gather
from launcher.doctor.failure_text import (
    HANG_MESSAGE,
    SCHEDULER_ENDED,
    SCHEDULER_STATE,
    SILENT_DEATH,
    clip,
    is_library,
    line_at,
    oom_phase,
    short_path,
    text_kind,
)
from launcher.doctor.kinds import FIXES, NOT_FAILED, Diagnosis
from launcher.doctor.rank_failures import from_logs, from_rank_errors, from_status_text
from launcher.run.rundir import RESTARTED_BY_USER
from launcher.run.status import RunStatus, Status
from launcher.runtime.stacks import missed_line


# ---- the diagnosis ---------------------------------------------------------------------------------
def diagnose(ev: Evidence) -> Diagnosis:
    """One diagnosis for the evidence (pure: reads nothing)."""
    d = _diagnose(ev)
    refused = ev.status.no_restart or {}  # the run ended at once: a restart would fail the same way
    if refused.get("why") and d.kind not in NOT_FAILED:
        d.detail.append(f"not restarted: {refused['why']}")
        d.fix = d.fix or str(refused.get("fix") or "")
    d.fix = d.fix or FIXES[d.kind]
    for fb in ev.fallbacks:  # a resume that skipped a checkpoint failing verification (not a restart)
        why = "; ".join(p for ps in (fb.get("rejected") or {}).values() for p in ps)
        d.detail.append(f"attempt {fb.get('attempt')} resumed from {fb.get('resumed_from')}, "
                        f"past a checkpoint that failed verification: {clip(why, 300)}")
    history = restarts_line(ev)
    if history:
        d.detail.append(history)
        if d.kind == "completed":
            d.summary += f" after {history}"
    d.detail.extend(ev.nodes)  # the nodes it failed on, as the node ledger holds them
    return d


def restarts_line(ev: Evidence) -> Optional[str]:
    """``2 restarts: failure (rank 1: RuntimeError ...), hang`` from the run's restart records."""
    rows = [r for r in ev.restarts if r.get("reason") not in RESTARTED_BY_USER]
    if not rows:
        return None
    parts = []
    for r in rows:
        reason = str(r.get("reason") or "?")
        a = r.get("attempt")
        prev = ev.attempts.get(int(a) - 1) if isinstance(a, int) else None
        kind = _diagnose(_with(prev, ev)).kind if prev is not None and (prev.errors or prev.hang) else None
        what = reason + (f" [{kind}]" if kind and kind != reason else "")
        if r.get("detail"):
            what += f" ({clip(str(r['detail']), 120)})"
        if r.get("from_step") is not None:
            what += f", resumed from step {r['from_step']}"
        parts.append(what)
    n = len(rows)
    return f"{n} restart{'s' if n != 1 else ''}: " + "; ".join(parts)


def _diagnose(ev: Evidence) -> Diagnosis:
    st = ev.status
    status = st.state.value
    if status == "completed":
        return Diagnosis("completed", f"completed {ev.last_step or ev.steps or 0} steps")
    ended = ev.scheduler_ended if ev.scheduler_ended is not None else bool(ev.scheduler)
    if status == "waiting":  # a point past the scheduler's room: no job yet (launcher.submit.waves)
        return Diagnosis("pending", "waiting for room in the queue: the sweep's wave job queues it (waves.json)")
    if status in ("pending", "running", "requeued") and not ended:
        return _live(ev, status)

    # the restart budget was spent when the job started again: the cause is what the last attempt left
    err = str(st.error or "")
    if status == "failed" and err.startswith("restart budget spent") and not ev.errors_of_hang() and ev.attempts:
        last = ev.attempts[max(ev.attempts)]
        inner = _diagnose(_with(last, ev))
        inner.summary = f"restart budget spent (train.max_restarts={ev.config.get('train.max_restarts')}); " \
                        f"last attempt: {inner.summary}"
        inner.detail.insert(0, f"status: {err}")
        return inner

    for fn in (_hang, _scheduler):
        d = fn(ev)
        if d is not None:
            return d
    if status == "cancelled":
        return Diagnosis("cancelled", f"cancelled: {err or 'by a user'}", detail=[f"status: {err}"] if err else [])
    if status == "timeout":
        return Diagnosis("time_limit", f"the job reached its time limit ({_time_limit(ev)}) at step {ev.last_step}",
                         detail=["status: timeout" + (f" ({err})" if err else "")])
    for fn in (from_rank_errors, from_logs, _silent, from_status_text, _full_disk):
        d = fn(ev)
        if d is not None:
            return d
    last = _last_restart(ev)
    if last in ("preempted", "time_limit"):
        return Diagnosis(last, f"the run ended after a {last.replace('_', ' ')} restart", detail=[f"restarts: {last}"])
    lines = [f"status: {status}" + (f" ({err})" if err else "")]
    if ev.scheduler:
        lines.append(f"scheduler: {ev.scheduler}")
    for r, text in sorted(ev.logs.items()):
        tail = [ln for ln in text.splitlines() if ln.strip()][-2:]
        if tail:
            lines.append(f"rank {r} log ends: " + clip(" | ".join(tail), 200))
    return Diagnosis("unknown", f"{status}: no recognisable cause recorded", detail=lines)


def _silent(ev: Evidence) -> Optional[Diagnosis]:
    """No rank recorded a word and the step failed (the step's teardown recorded it): a rank died in a
    way Python never saw (SIGKILL, the OOM killer, a segfault, NCCL's C++ teardown)."""
    m = SILENT_DEATH.search(str(ev.status.error or ""))
    if not m:
        return None
    return Diagnosis("killed_rank", f"a rank died without a word ({clip(m['how'], 160)})",
                     detail=[f"status: {ev.status.error}"])


FULL = 1 << 20  # bytes free below which a file system counts as full (a record or a log needs more)


def _full_disk(ev: Evidence) -> Optional[Diagnosis]:
    """No rank's word, no recognisable log, and the run dir's file system full now: a job that could
    not write its first record (the batch script's log, the rank's start) left nothing else to say so."""
    if ev.free_bytes is None or ev.free_bytes >= FULL or ev.errors:
        return None
    said = [f"the run dir's file system has {ev.free_bytes:,} bytes free"]
    if ev.scheduler:
        said.append(f"scheduler: {ev.scheduler}")
    return Diagnosis("disk_full", "the job ended without a record and the run dir's file system is full: "
                     "it could not write", detail=said)


def _with(attempt: Evidence, run: Evidence) -> Evidence:
    """An earlier attempt's files with the run's context (config, steps)."""
    return Evidence(run_id=run.run_id, status=RunStatus(state=Status.failed), world_size=run.world_size,
                    started=run.started,
                    master=run.master, errors=attempt.errors, error_order=attempt.error_order, hang=attempt.hang,
                    stacks=attempt.stacks, last_step=run.last_step, steps=run.steps, config=run.config)


def _live(ev: Evidence, status: str) -> Diagnosis:
    st = ev.status
    if status == "requeued":
        stop = st.stop or {}
        why = stop.get("reason") or "a restart"
        return Diagnosis("pending", f"requeued after {why}: waiting to restart"
                         + (f" ({stop.get('detail')})" if stop.get("detail") else ""),
                         detail=[f"status: requeued, stop {stop}"] if stop else [])
    kind = "running" if status == "running" else "pending"
    line = f"{kind}" + (f", step {ev.last_step}" + (f"/{ev.steps}" if ev.steps else "") if ev.last_step else "")
    if st.attempt and int(st.attempt) > 1:
        line += f", attempt {st.attempt}"
    return Diagnosis(kind, line, detail=[f"scheduler: {ev.scheduler}"] if ev.scheduler else [])


def _last_restart(ev: Evidence) -> Optional[str]:
    rows = [r for r in ev.restarts if r.get("reason") not in RESTARTED_BY_USER]
    return str(rows[-1].get("reason")) if rows else None


def _time_limit(ev: Evidence) -> str:
    t = ev.config.get("cluster.time_min")
    return f"cluster.time_min={t}" if t is not None else "the job's time limit"


# ---- 1: the hang watchdog ---------------------------------------------------------------------------
def _hang(ev: Evidence) -> Optional[Diagnosis]:
    messages = {r: t for r, t in ev.errors.items() if HANG_MESSAGE.search(t)}
    status_msg = str(ev.status.error or "")
    if not ev.hang and not messages and not HANG_MESSAGE.search(status_msg):
        return None
    h = ev.hang or {}
    frames_by_rank = {int(k): v for k, v in (h.get("frames") or {}).items()}
    waiting = {int(k): v for k, v in (h.get("waiting") or {}).items()}
    stuck = [int(r) for r in (h.get("stuck_ranks") or [])]
    # each rank's main thread as its stack dump shows it: a rank whose innermost frame is inside a library
    # (torch: DDP's bucket rebuild in forward, the gradient all-reduce in backward, a collective) waits for
    # the others; the cause is a rank stuck in the program's own code, or one that left no stack
    inner = {r: _main_thread(dump) for r, dump in ev.stacks.items()}
    for r, fs in inner.items():
        own = next((f for f in fs if not _in_library_short(f)), None)
        if own:
            frames_by_rank[r] = own if not _in_library_short(fs[0]) else f"{fs[0]}, called from {own}"
    library_waiters = [r for r in stuck if (inner.get(r) and _in_library_short(inner[r][0]))
                       or (not inner.get(r) and frames_by_rank.get(r) and _in_library_short(frames_by_rank[r]))]
    culprits = [r for r in stuck if r not in library_waiters]
    if not culprits:
        culprits, library_waiters = stuck, []
    step = h.get("step")
    timeout = h.get("timeout_s") or ev.config.get("train.hang_timeout_s")
    where = "; ".join(f"rank {r} stuck in {frames_by_rank[r]}" if frames_by_rank.get(r) else
                      f"rank {r} left no stack (dead, or stuck outside Python)" for r in culprits)
    head = (f"hang in start-up: no progress for {_num(timeout)} s before the first step: "
            if h.get("phase") == "startup" else f"hang: no step finished for {_num(timeout)} s after step {step}: ")
    summary = (head if h else "hang: ") + \
        (where if culprits else clip(status_msg or next(iter(messages.values()), ""), 300))
    missed = missed_line(h)  # the collective they never joined, by its sequence number
    if missed:
        summary += "; " + missed
    detail = []
    if h:
        detail.append(f"hang.json: step {step}, timeout {_num(timeout)} s, stuck {stuck}, waiting {waiting or '{}'}")
    for r in sorted(set(waiting) | set(library_waiters)):
        what = waiting.get(r) or "torch (" + str(frames_by_rank.get(r)) + ")"
        detail.append(f"rank {r} waits in {what}")
    for r in culprits:
        own = [f for f in inner.get(r, []) if not _in_library_short(f) and "watchdog.py" not in f]
        if own:
            detail.append(f"stacks: rank {r}: " + " <- ".join(own[:4]))
    if not h and (messages or status_msg):
        detail.append("status: " + clip(status_msg or next(iter(messages.values())), 300))
    return Diagnosis("hang", summary, rank=culprits[0] if culprits else None, detail=detail)


def _num(x: Any) -> str:
    try:
        f = float(x)
        return str(int(f)) if f == int(f) else str(f)
    except (TypeError, ValueError):
        return "?"


def _in_library_short(frame: str) -> bool:
    return frame.startswith(("torch/", "deepspeed/", "submitit/")) or is_library(frame)


def _main_thread(dump: str) -> List[str]:
    """The frames (``file:line in func``, innermost first) of the thread that runs the job in a
    faulthandler dump: the one whose stack holds the task's entry, else the last one."""
    blocks: List[List[str]] = []
    for line in dump.splitlines():
        if line.startswith(("Thread ", "Current thread ")):
            blocks.append([])
            continue
        m = re.match(r'^\s+File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)', line)
        if m and blocks:
            blocks[-1].append(f"{short_path(m['file'])}:{m['line']} in {m['func']}")
    return next((b for b in blocks if any("runtime/task.py" in f or "submitit/core" in f for f in b)),
                blocks[-1] if blocks else [])


# ---- 2: the scheduler ended it ----------------------------------------------------------------------
def _scheduler_word(ev: Evidence) -> str:
    """The scheduler's state: asked now, or recorded when the launcher found the job ended."""
    if ev.scheduler:
        return (ev.scheduler.upper().split() or [""])[0].rstrip("+")
    m = SCHEDULER_STATE.search(str(ev.status.error or ""))
    return m["state"] if m else ""


def _scheduler(ev: Evidence) -> Optional[Diagnosis]:
    word = _scheduler_word(ev)
    said = [f"scheduler: {ev.scheduler or word}"] if word else []
    logs = "\n".join(ev.logs.values())
    m = next((m for m in (p.search(logs) for p in SCHEDULER_ENDED) if m), None)
    if m:
        said.append("log: " + clip(line_at(logs, m.start(), m.end()), 200))
    why = m["why"] if m else ""
    if word == "NODE_FAIL" or why == "NODE FAILURE":
        nodes = ", ".join(map(str, ev.status.hosts or []))
        return Diagnosis("node_failure", "a node of the job failed" + (f" (job on {nodes})" if nodes else ""),
                         detail=said)
    if word == "PREEMPTED" or why == "PREEMPTION" or (ev.status.stop or {}).get("reason") == "preempted":
        return Diagnosis("preempted", "the scheduler preempted the job",
                         detail=said or [f"status: stopped, {ev.status.stop}"])
    if word in ("TIMEOUT", "DEADLINE") or why == "TIME LIMIT":
        return Diagnosis("time_limit", f"the job reached its time limit ({_time_limit(ev)}) at step {ev.last_step}",
                         detail=said)
    if word == "OUT_OF_MEMORY" and not any(text_kind(t) == "oom" for t in ev.errors.values()):
        phase, how = oom_phase("", ev.last_step)
        return Diagnosis("oom_" + phase, f"the scheduler killed the job for exceeding its memory {how}", detail=said)
    return None


def classify(rd: Any, scheduler: bool = False, config: Optional[Dict[str, Any]] = None) -> Diagnosis:
    """gather + diagnose (``config``: the run's config.yaml, where the caller read it already)."""
    return diagnose(gather(rd, scheduler=scheduler, config=config))
