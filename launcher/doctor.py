"""`launcher doctor`: why a run failed, and the fix (docs/doctor.md).

Two steps, both without torch (this runs on the login node):

- ``gather(rd)`` reads the evidence a run left: status.json (error, failed rank, exit code), each
  rank's recorded traceback, the tail of each rank's stderr/stdout log (the backend names the
  files), the hang watchdog's finding and stack dumps, the restart records, what earlier attempts
  left, the last step in the metrics, a few config values the fixes name, and (optionally) the
  scheduler's state of the job.
- ``diagnose(evidence)`` is a pure function of that evidence: one ``Diagnosis`` (kind, summary, the
  rank at fault, the evidence lines, the fix).

Kinds: oom_startup, oom_step, hang, collective_timeout, rendezvous, killed_rank, node_failure,
preempted, time_limit, exception, cancelled, completed, running, pending, unknown. A peer that
only saw a rank go away (gloo's "Connection closed/reset by peer", NCCL's remote error, the run's
own watchdog ending a rank) is never taken for the cause.
"""
from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Tuple

from launcher import backends
from launcher.run.status import RunStatus, Status
from launcher.rundir import RESTARTED_BY_USER, RunDir

KINDS = ("oom_startup", "oom_step", "hang", "collective_timeout", "rendezvous", "killed_rank", "node_failure",
         "preempted", "time_limit", "exception", "cancelled", "completed", "running", "pending", "unknown")
# kinds that are not a failure: nothing to diagnose
NOT_FAILED = ("completed", "running", "pending")

FIXES: Dict[str, str] = {
    "oom_startup": (
        "Model states (parameters, gradients, optimizer state: ~16 bytes per parameter with mixed-precision "
        "Adam) do not fit; a smaller batch will not help. Change the layout: shard them (zero=1|2|3, a higher "
        "ZeRO stage), offload to CPU (zero.offload_optimizer=true, zero.offload_params=true with zero=3), "
        "split the model (parallelism.tp / parallelism.pp) or add GPUs; `launcher plan --search <overrides>` "
        "ranks the layouts that fit."),
    "oom_step": (
        "Activations of the step do not fit (they grow with micro batch x sequence length x layers): lower "
        "train.micro_batch_size (train.global_batch_size is kept: gradient accumulation grows), recompute "
        "activations (train.recompute=selective, or full: ~30-40% more forward compute), use sequence "
        "parallelism with tensor parallelism (parallelism.tp>1 parallelism.sequence_parallel=true), or a "
        "shorter model.seq_len; `launcher plan <overrides>` shows the activation memory per layout."),
    "hang": (
        "Read the stacks (stacks/ in the run dir): the stuck rank's frame is the cause, the other ranks wait "
        "for it in a collective. Re-run with cluster.env.NCCL_DEBUG=INFO to see the collective and the "
        "peers; if a step (first step, checkpoint save, evaluation) is legitimately slower than "
        "train.hang_timeout_s, raise train.hang_timeout_s."),
    "collective_timeout": (
        "A collective waited longer than train.dist_timeout_s for a peer: read the named rank's log "
        "(`launcher logs RUN --rank R --err`) for what it was doing; re-run with cluster.env.NCCL_DEBUG=INFO "
        "and check the interconnect (NCCL_SOCKET_IFNAME, NCCL_IB_*); set train.hang_timeout_s to get every "
        "rank's stack next time; raise train.dist_timeout_s only if the collective is legitimately slow."),
    "rendezvous": (
        "The ranks could not meet at MASTER_ADDR:MASTER_PORT. Port in use: choose a free one "
        "(cluster.master_port=<port>, or null to derive it from the job id). Connection refused or timed "
        "out: check that MASTER_ADDR resolves and is reachable from every node and the port is open "
        "(`nc -vz ADDR PORT`; firewall, security group)."),
    "killed_rank": (
        "A rank was killed by a signal (SIGKILL: the kernel's out-of-memory killer, the scheduler, a user or a "
        "node problem); its peers only saw the connection drop. Check the node's kernel log "
        "(`dmesg | grep -i -e oom -e killed`) and the rank's log; with checkpoints "
        "(train.checkpoint.every) and train.max_restarts > 0 the run restarts by itself."),
    "node_failure": (
        "A node failed (scheduler NODE_FAIL): nothing in the run caused it. Resume from the last checkpoint "
        "(`launcher resume RUN`, or train.max_restarts > 0 with train.checkpoint.every), keep the node out "
        "(cluster.sbatch_extra.exclude=<node>) and report it to the cluster admins."),
    "preempted": (
        "The scheduler preempted the job for a higher-priority one. The run saves a checkpoint on SIGTERM and "
        "restarts when requeued (train.max_restarts > 0); for a run that must not be interrupted use a "
        "non-preemptible cluster.qos / cluster.partition, or `launcher resume RUN`."),
    "time_limit": (
        "The job reached its time limit (cluster.time_min). Raise cluster.time_min, or keep checkpoints "
        "(train.checkpoint.every) and train.max_restarts > 0 so the run saves at the USR2 signal "
        "(cluster.signal_delay_s before the limit) and requeues; `launcher resume RUN` continues it."),
    "exception": (
        "A Python exception in the code: fix it at the frame shown (`launcher logs RUN --rank R --err` has the "
        "whole log); `launcher reproduce RUN` re-runs the same config, code and seeds."),
    "cancelled": "Cancelled by a user or the scheduler (launcher cancel, scancel): nothing to fix.",
    "completed": "Nothing to fix.",
    "running": "Nothing to fix yet: the run is running.",
    "pending": "Nothing to fix yet: the run is waiting to (re)start.",
    "unknown": (
        "No recognisable cause was recorded: read every rank's log (`launcher logs RUN --rank N --err`), the "
        "scheduler's record of the job (sacct -j JOB) and the node's kernel log (dmesg)."),
}

# ---- what the text says ------------------------------------------------------------------------------
OOM = re.compile(r"CUDA out of memory|HIP out of memory|OutOfMemoryError|DefaultCPUAllocator: can't allocate memory"
                 r"|\bMemoryError\b|std::bad_alloc|Cannot allocate memory|OUT_OF_MEMORY|oom[-_ ]kill"
                 r"|Out of memory|out of memory", re.I)
# TCPStore's own words: a rendezvous failure wherever they appear
RENDEZVOUS_STORE = re.compile(r"EADDRINUSE|failed to listen on any local network address"
                              r"|client socket has timed out after \d+ms while trying to connect"
                              r"|TCP client failed to connect"
                              r"|Timed out initializing process group in store based barrier",
                              re.I)
# a failed connection or name lookup: a rendezvous failure when it happens inside init_process_group
RENDEZVOUS = re.compile(r"Address already in use|Connection refused|ECONNREFUSED|failed to connect to|timed out"
                        r"|Name or service not known|Temporary failure in name resolution|No route to host"
                        r"|Socket Timeout|DistNetworkError", re.I)
RENDEZVOUS_FRAMES = ("init_process_group", "rendezvous", "_env_rendezvous_handler", "_create_c10d_store",
                     "TCPStore", "_store_based_barrier", "new_group")
COLLECTIVE_TIMEOUT = re.compile(r"Timed out waiting \d+\s*ms for (?:recv|send)|Watchdog caught collective operation "
                                r"timeout|ran for \d+ milliseconds before timing out|collective operation timeout"
                                r"|failed to pass monitoredBarrier|Some NCCL operations have failed or timed out"
                                r"|(?:DistBackendError|ProcessGroup\w*).{0,200}time(?:d )?out", re.I | re.S)
# a peer went away: the symptom every surviving rank shows, never the cause
PEER_GONE = re.compile(r"Connection closed by peer|Connection reset by peer|remote worker crashing|Broken pipe"
                       r"|ncclRemoteError|remote process exiting prematurely|NCCL communicator was aborted"
                       r"|\[watchdog\] rank \d+: rank_?\d+ failed", re.I)
# a rank's own last words when a signal ended it; each backend adds its scheduler's (Backend.killed_words)
KILLED = re.compile(r"rank (?P<rank>\d+)[^\n]{0,80}(?:SIGKILL|signal 9|exit(?: code)? "
                    r"-9|exitcode\s*:\s*-9)|injected SIGKILL", re.I)
KILLED_BY_SCHEDULER = [re.compile(b.killed_words, re.I) for b in backends.every() if b.killed_words]
SCHEDULER_STATE = re.compile(r"scheduler state (?P<state>[A-Z_]+)")
# a job the scheduler ended, in its own words (Backend.ended_words: ``why`` is TIME LIMIT, NODE FAILURE
# or PREEMPTION)
SCHEDULER_ENDED = [re.compile(b.ended_words) for b in backends.every() if b.ended_words]
# the step's teardown (launcher.runtime.after_step) found the step failed with no rank's word
SILENT_DEATH = re.compile(r"^a rank died without a word: (?P<how>.*)")
HANG_MESSAGE = re.compile(r"^hang: ", re.M)

_FRAME = re.compile(r'^\s*(?:\[rank\d+\]:\s*)?File "(?P<file>[^"]+)", line (?P<line>\d+),? in (?P<func>\S+)')
_EXC_LINE = re.compile(r"^(?:\[rank\d+\]:\s*)?(?P<name>[A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt|Failure|"
                       r"Warning|Timeout|error))(?::\s?(?P<msg>.*))?$")

# where a frame is: the step (activations) or the construction of model, engine and optimizer state
STEP_FUNCS = ("train_step", "forward", "backward", "_engine_run_backward", "run_backward", "forward_backward",
              "_forward_step", "_backward_step")
STARTUP_FUNCS = ("build_engine", "initialize", "_configure_distributed_model", "_configure_optimizer",
                 "_configure_zero_optimizer", "initialize_optimizer_states", "_init_group", "_init_state",
                 "_sync_module_states", "_sync_params_and_buffers", "load_checkpoint", "resume")
LIBRARY = ("site-packages/", "dist-packages/", "/lib/python3", "<frozen")


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

    def __post_init__(self) -> None:
        self.status = RunStatus.of(self.status)

    def errors_of_hang(self) -> bool:
        return bool(self.hang) or any(HANG_MESSAGE.search(t) for t in self.errors.values())

    def to_json(self) -> Dict[str, Any]:
        d = asdict(self)
        d["attempts"] = {a: e.to_json() for a, e in self.attempts.items()}
        d["status"] = self.status.to_json()
        return d


@dataclass
class Diagnosis:
    kind: str
    summary: str
    rank: Optional[int] = None
    detail: List[str] = field(default_factory=list)  # the evidence, one line each
    fix: str = ""

    def to_json(self) -> Dict[str, Any]:
        return asdict(self)


# ---- reading tracebacks ----------------------------------------------------------------------------
def frames(text: str) -> List[Tuple[str, int, str]]:
    """Every traceback frame in ``text`` (outermost first, as Python prints them): (file, line, function)."""
    out = []
    for line in text.splitlines():
        m = _FRAME.match(line)
        if m:
            out.append((m["file"], int(m["line"]), m["func"]))
    return out


def exception_line(text: str) -> Optional[str]:
    """The exception that ended a traceback: its last ``Name: message`` line (else the last line at the
    left margin after the last frame)."""
    found = None
    lines = text.splitlines()
    for line in lines:
        if line[:1].isspace():
            continue
        m = _EXC_LINE.match(line.strip())
        if m:
            found = m["name"] + (f": {m['msg'].strip()}" if m["msg"] else "")
    if found is None and frames(text):
        last = max(i for i, ln in enumerate(lines) if _FRAME.match(ln))
        rest = [ln.strip() for ln in lines[last + 1:] if ln.strip() and not ln[:1].isspace()]
        found = rest[-1] if rest else None
    return found


def short_path(path: str) -> str:
    """A frame's file as a reader knows it: from the package root (recipes/, launcher/, torch/ ...)."""
    for root in ("recipes/", "launcher/", "torch/", "deepspeed/", "submitit/", "megatron/"):
        i = path.rfind("/" + root)
        if i >= 0:
            return path[i + 1:]
    for lib in ("site-packages/", "dist-packages/"):
        i = path.rfind(lib)
        if i >= 0:
            return path[i + len(lib):]
    return path


def _is_library(path: str) -> bool:
    return any(m in path for m in LIBRARY)


def fmt_frame(f: Tuple[str, int, str]) -> str:
    return f"{short_path(f[0])}:{f[1]} in {f[2]}"


def raising_frame(text: str) -> Optional[str]:
    """``file:line in func`` of the frame that raised, and of the innermost frame of the program's own
    code when the raise happened inside a library."""
    fs = frames(text)
    if not fs:
        return None
    inner = fs[-1]
    own = next((f for f in reversed(fs) if not _is_library(f[0])), None)
    if own is None or own == inner:
        return fmt_frame(inner)
    return f"{fmt_frame(inner)}, called from {fmt_frame(own)}"


def oom_phase(text: str, last_step: int) -> Tuple[str, str]:
    """("startup" | "step", why) for an out-of-memory error: model states (building the model, the engine,
    the optimizer state; also the optimizer's first step, which allocates its state) or activations (the
    forward / backward of a step). Without frames: whether any step finished."""
    fs = frames(text)
    funcs = [f for _, _, f in fs]
    files = [p for p, _, _ in fs]
    if any(f in STARTUP_FUNCS for f in funcs) and "train_step" not in funcs:
        where = next(fmt_frame(f) for f in fs if f[2] in STARTUP_FUNCS)
        return "startup", f"while building the model / engine ({where})"
    if any("torch/optim/" in p or "zero/stage" in p for p in files) and not any(
            f in ("forward", "backward", "_engine_run_backward") for f in funcs):
        return "startup", "while allocating optimizer state in the optimizer step"
    if any(f in STEP_FUNCS for f in funcs):
        part = "backward" if any("backward" in f for f in funcs) else "forward"
        own = next((f for f in reversed(fs) if not _is_library(f[0])), None)
        step = next((f for f in reversed(fs) if f[2] == "train_step"), None)
        where = [fmt_frame(f) for f in (own, step) if f is not None]
        where = list(dict.fromkeys(where))  # once each, innermost first
        return "step", f"in the {part} of a training step" + (f" ({', from '.join(where)})" if where else "")
    if any(f == "__init__" for f in funcs):
        return "startup", "while constructing an object (" + fmt_frame(next(f for f in fs if f[2] == "__init__")) + ")"
    if last_step > 0:
        return "step", f"after step {last_step} had finished"
    return "startup", "before any step finished"


# ---- classifying one error text --------------------------------------------------------------------
def _text_kind(text: str) -> Optional[str]:
    """The kind one error text shows on its own (None: a plain exception, or nothing)."""
    if HANG_MESSAGE.search(text):
        return "hang"
    if OOM.search(text):
        return "oom"
    if PEER_GONE.search(text):
        return "peer_gone"
    funcs = {f for _, _, f in frames(text)}
    at_init = bool(funcs & set(RENDEZVOUS_FRAMES))
    if RENDEZVOUS_STORE.search(text) or (RENDEZVOUS.search(text) and at_init):
        return "rendezvous"
    if COLLECTIVE_TIMEOUT.search(text):
        return "collective_timeout"
    if RENDEZVOUS.search(text) and not funcs and re.search(r"init_process_group|MASTER_(?:ADDR|PORT)|rendezvous",
                                                          text, re.I):
        return "rendezvous"
    return None


def _is_primary(text: str) -> bool:
    return _text_kind(text) != "peer_gone"


def _ranks_str(ranks: Iterable[Any]) -> str:
    rs = sorted({int(r) for r in ranks})
    return ("rank " if len(rs) == 1 else "ranks ") + ", ".join(map(str, rs))


def _first_line(text: str, limit: int = 300) -> str:
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    return line if len(line) <= limit else line[:limit] + "..."


def _clip(text: str, limit: int = 300) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + "..."


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
                        f"past a checkpoint that failed verification: {_clip(why, 300)}")
    history = restarts_line(ev)
    if history:
        d.detail.append(history)
        if d.kind == "completed":
            d.summary += f" after {history}"
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
            what += f" ({_clip(str(r['detail']), 120)})"
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
    for fn in (_rank_errors, _logs, _silent, _status_text):
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
            lines.append(f"rank {r} log ends: " + _clip(" | ".join(tail), 200))
    return Diagnosis("unknown", f"{status}: no recognisable cause recorded", detail=lines)


def _silent(ev: Evidence) -> Optional[Diagnosis]:
    """No rank recorded a word and the step failed (the step's teardown recorded it): a rank died in a
    way Python never saw (SIGKILL, the OOM killer, a segfault, NCCL's C++ teardown)."""
    m = SILENT_DEATH.search(str(ev.status.error or ""))
    if not m:
        return None
    return Diagnosis("killed_rank", f"a rank died without a word ({_clip(m['how'], 160)})",
                     detail=[f"status: {ev.status.error}"])


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
    summary = (f"hang: no step finished for {_num(timeout)} s after step {step}: " if h else "hang: ") + \
        (where if culprits else _clip(status_msg or next(iter(messages.values()), ""), 300))
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
        detail.append("status: " + _clip(status_msg or next(iter(messages.values())), 300))
    return Diagnosis("hang", summary, rank=culprits[0] if culprits else None, detail=detail)


def _num(x: Any) -> str:
    try:
        f = float(x)
        return str(int(f)) if f == int(f) else str(f)
    except (TypeError, ValueError):
        return "?"


def _in_library_short(frame: str) -> bool:
    return frame.startswith(("torch/", "deepspeed/", "submitit/")) or _is_library(frame)


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
        said.append("log: " + _clip(_line_at(logs, m.start(), m.end()), 200))
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
    if word == "OUT_OF_MEMORY" and not any(_text_kind(t) == "oom" for t in ev.errors.values()):
        phase, how = oom_phase("", ev.last_step)
        return Diagnosis("oom_" + phase, f"the scheduler killed the job for exceeding its memory {how}", detail=said)
    return None


# ---- 3: what the ranks recorded ---------------------------------------------------------------------
def _rank_errors(ev: Evidence) -> Optional[Diagnosis]:
    if not ev.errors:
        return None
    order = [r for r in ev.error_order if r in ev.errors] + [r for r in sorted(ev.errors) if r not in ev.error_order]
    primary = [r for r in order if _is_primary(ev.errors[r])]
    if not primary:
        return _killed(ev, peers=order)
    failed = ev.status.failed_rank
    rank = int(failed) if failed is not None and int(failed) in primary else primary[0]
    return _from_text(ev, rank, ev.errors[rank], source=f"ranks: rank {rank}'s recorded error")


def _from_text(ev: Evidence, rank: Optional[int], text: str, source: str) -> Diagnosis:
    kind = _text_kind(text)
    exc = exception_line(text) or _first_line(text)
    frame = raising_frame(text)
    detail = [f"{source}: {_clip(exc, 300)}"]
    if frame:
        detail.append(f"raised at {frame}")
    who = f"rank {rank}" if rank is not None else "a rank"
    if kind == "oom":
        phase, how = oom_phase(text, ev.last_step)
        others = [r for r, t in ev.errors.items() if r != rank and _text_kind(t) == "oom"]
        if others:
            detail.append(f"also out of memory: {_ranks_str(others)}")
        mbs = ev.config.get("train.micro_batch_size")
        if phase == "step" and mbs is not None:
            detail.append(f"train.micro_batch_size={mbs}, model.seq_len={ev.config.get('model.seq_len')}, "
                          f"train.recompute={ev.config.get('train.recompute')}")
        if phase == "startup":
            detail.append(f"layout: zero.stage={ev.config.get('zero.stage')}, parallelism.tp="
                          f"{ev.config.get('parallelism.tp')}, parallelism.pp={ev.config.get('parallelism.pp')}")
        return Diagnosis("oom_" + phase, f"{who} ran out of memory {how}", rank=rank, detail=detail)
    if kind == "collective_timeout":
        timed_out = [r for r, t in ev.errors.items() if _text_kind(t) == "collective_timeout"]
        suspects = [r for r in _all_ranks(ev) if r not in timed_out and r not in _primary_others(ev, timed_out)]
        where = f" at {frame}" if frame else ""
        summary = f"{_ranks_str(timed_out or [rank])} timed out in a collective{where}"
        if suspects:
            summary += f", waiting for {_ranks_str(suspects)}"
            detail.append(f"{_ranks_str(suspects)} recorded no timeout: the rank(s) the collective waited for")
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
        return Diagnosis("hang", f"{who}: {_clip(text, 300)}", rank=rank, detail=detail)
    summary = f"{who} raised {_clip(exc, 200)}" + (f" at {frame}" if frame else "")
    return Diagnosis("exception", summary, rank=rank, detail=detail)


def _all_ranks(ev: Evidence) -> List[int]:
    if ev.world_size:
        return list(range(int(ev.world_size)))
    return sorted(set(ev.started) | set(ev.errors))


def _primary_others(ev: Evidence, exclude: List[int]) -> List[int]:
    return [r for r, t in ev.errors.items() if r not in exclude and _is_primary(t)]


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
            out.setdefault(int(n) if n is not None else r, _line_at(text, m.start(), m.end()))
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
    detail = [f"ranks: {_ranks_str(peers)} recorded only that a peer went away: "
              f"{_clip(exception_line(ev.errors[first]) or _first_line(ev.errors[first]), 200)}"]
    for r in dead:
        if r in signalled:
            detail.append(f"log: {signalled[r]}")
        elif r in ev.started or not ev.started:
            detail.append(f"rank {r} recorded no error and its log has no traceback")
    if ended:
        detail.append(f"{_ranks_str(ended)} ended by the run's watchdog after the failure")
    if not dead:
        return Diagnosis("killed_rank", "a rank died without a trace: its peers saw the connection drop",
                         detail=detail)
    how = " (SIGKILL)" if any(r in signalled for r in dead) else " (no error recorded: killed by a signal?)"
    return Diagnosis("killed_rank", f"{_ranks_str(dead)} died{how}; its peers only saw the connection drop",
                     rank=dead[0], detail=detail)


# ---- 4: the logs, when no rank recorded an error ------------------------------------------------------
def _logs(ev: Evidence) -> Optional[Diagnosis]:
    for r, text in sorted(ev.logs.items()):
        if OOM.search(text):
            tb = _last_traceback(text)
            return _from_text(ev, r, tb if tb and OOM.search(tb) else _line_with(text, OOM), source=f"log of rank {r}")
    signalled = _signal_lines(ev)
    if signalled:
        r = min(signalled)
        return Diagnosis("killed_rank", f"{_ranks_str(signalled)} killed by a signal", rank=r,
                         detail=[f"log: {line}" for line in signalled.values()])
    # NCCL's watchdog aborts the process: a log line, no Python traceback
    timed = [r for r, text in sorted(ev.logs.items()) if COLLECTIVE_TIMEOUT.search(text)]
    if timed:
        suspects = [r for r in _all_ranks(ev) if r not in timed]
        summary = f"{_ranks_str(timed)} timed out in a collective"
        detail = [f"log of rank {timed[0]}: " + _clip(_line_with(ev.logs[timed[0]], COLLECTIVE_TIMEOUT), 300)]
        if suspects:
            summary += f", waiting for {_ranks_str(suspects)}"
            detail.append(f"{_ranks_str(suspects)} logged no timeout: the rank(s) the collective waited for")
        return Diagnosis("collective_timeout", summary, rank=suspects[0] if suspects else timed[0], detail=detail)
    for r, text in sorted(ev.logs.items()):
        tb = _last_traceback(text)
        if tb and _is_primary(tb):
            return _from_text(ev, r, tb, source=f"log of rank {r}")
    return None


def _last_traceback(text: str) -> Optional[str]:
    i = text.rfind("Traceback (most recent call last)")
    return text[i:] if i >= 0 else None


def _line_with(text: str, pattern: re.Pattern[str]) -> str:
    m = pattern.search(text)
    return _line_at(text, m.start(), m.end()) if m else ""


def _line_at(text: str, start: int, end: int) -> str:
    """The whole line of ``text`` holding ``text[start:end]``."""
    a = text.rfind("\n", 0, start) + 1
    b = text.find("\n", end)
    return text[a:b if b >= 0 else len(text)].strip()


# ---- 5: only status.json's error ---------------------------------------------------------------------
def _status_text(ev: Evidence) -> Optional[Diagnosis]:
    err = str(ev.status.error or "")
    if not err or ev.status.state is Status.cancelled or SCHEDULER_STATE.search(err):
        return None
    if _text_kind(err) == "peer_gone":
        return _killed(ev, peers=[int(ev.status.failed_rank or 0)]) if ev.errors else None
    rank = ev.status.failed_rank
    return _from_text(ev, int(rank) if rank is not None else None, err, source="status")


# ---- gathering the evidence from a run dir -----------------------------------------------------------
LOG_TAIL = 64 * 1024  # bytes of each log read from its end


def _tail(path: Path, limit: int = LOG_TAIL) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - limit))
            return f.read().decode("utf-8", errors="replace")
    except OSError:
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
        try:
            texts[r] = p.read_text(errors="replace")
            mtimes[r] = p.stat().st_mtime
        except OSError:
            continue
    return texts, sorted(texts, key=lambda r: (mtimes.get(r, 0.0), r))


def _files(rd: Any) -> Evidence:
    """What the run dir (or an attempt's dir) holds about a failure: errors, hang finding, stacks."""
    errors, order = _errors(rd)
    return Evidence(errors=errors, error_order=order, hang=rd.hang(), stacks=rd.stacks())


def gather(rd: Any, scheduler: bool = False, logs: bool = True) -> Evidence:
    """The evidence of one run (a RunDir). ``scheduler``: ask the backend for the job's state (one query;
    skipped for a completed run); ``logs``: read the tail of every rank's stderr and stdout."""
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
        cfg = rd.config()
    except (OSError, ValueError):
        cfg = {}
    ev.config = _flat(cfg or {}, CONFIG_KEYS)
    ev.steps = ev.config.get("train.steps")
    ev.last_step = _last_metrics_step(rd.metrics_path)
    job = rd.job()
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


def classify(rd: Any, scheduler: bool = False) -> Diagnosis:
    """gather + diagnose."""
    return diagnose(gather(rd, scheduler=scheduler))
