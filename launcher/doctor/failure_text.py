"""What a failure's text says, without torch: the patterns of each class of failure (out of memory,
rendezvous, collective timeout, a peer gone, a killed rank, the scheduler's words), tracebacks read
(frames, the exception, the raising frame, an out-of-memory error's phase), the kind one error text
shows on its own, and the small text helpers the diagnosis lines use."""
from __future__ import annotations

import re
from typing import Any, Iterable, List, Optional, Tuple

from launcher import backends

# ---- what the text says ------------------------------------------------------------------------------
OOM = re.compile(r"CUDA out of memory|HIP out of memory|OutOfMemoryError|DefaultCPUAllocator: can't allocate memory"
                 r"|\bMemoryError\b|std::bad_alloc|Cannot allocate memory|OUT_OF_MEMORY|oom[-_ ]kill"
                 r"|Out of memory|out of memory", re.I)
# a file system full, or a quota used up: what a checkpoint's, a log's or a record's write raised
DISK_FULL = re.compile(r"No space left on device|ENOSPC|Disk quota exceeded|EDQUOT|\[Errno 28\]|\[Errno 122\]"
                       r"|PytorchStreamWriter failed writing file|file write failed", re.I)
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
# the device or its link failed on the rank's node (an ECC error, a GPU fallen off the bus, a CUDA or
# NCCL system error): the node's fault, not the program's (an out-of-memory error or an index the program
# got wrong, CUDA's "device-side assert", is the program's). launcher.features.nodes records the node.
NODE_FAULT = re.compile(r"uncorrectable ECC error|ECC error encountered|cudaErrorECCUncorrectable|\bXid\b"
                        r"|GPU (?:has )?fallen off the bus|CUDA error: (?:unknown error|an illegal memory access"
                        r"|unspecified launch failure|uncorrectable|the launch timed out|initialization error"
                        r"|CUDA-capable device\(s\) is/are busy or unavailable|device not ready|misaligned address)"
                        r"|CUBLAS_STATUS_EXECUTION_FAILED|ncclSystemError|ncclInternalError"
                        r"|NCCL error.{0,80}(?:unhandled system error|internal error|unhandled cuda error)", re.I)
# torch's words for a GPU out of memory: the device's size, what is free, what this process holds
_GPU_OOM = re.compile(r"GPU (?P<gpu>\d+) has a total capacity of (?P<total>[\d.]+) (?P<tu>[KMGT]i?B) of which "
                      r"(?P<free>[\d.]+) (?P<fu>[KMGT]i?B) is free\..{0,2000}?this process has (?P<own>[\d.]+) "
                      r"(?P<ou>[KMGT]i?B) memory in use", re.S)
_UNITS = {"KiB": 2 ** 10, "MiB": 2 ** 20, "GiB": 2 ** 30, "TiB": 2 ** 40, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12}
OTHERS_SHARE = 0.10  # a GPU whose memory other processes held this much of ran out of memory by the node's fault


def node_oom(text: str) -> Optional[str]:
    """Where an out-of-memory error is the node's, not the model's: the GPU ran out while other
    processes (another job's, a zombie of an earlier one) held at least OTHERS_SHARE of it (torch's
    message: total capacity - free - what this process holds); what held it, in words. None: the
    program's own (or no such message)."""
    m = _GPU_OOM.search(text)
    if m is None:
        return None
    total, free, own = (float(m[k]) * _UNITS[m[u]] for k, u in (("total", "tu"), ("free", "fu"), ("own", "ou")))
    others = total - free - own
    if total <= 0 or others < OTHERS_SHARE * total:
        return None
    gib = 2 ** 30
    return (f"GPU {m['gpu']} ran out of memory with {others / gib:.1f} GiB of its {total / gib:.1f} GiB held by "
            f"other processes (this one held {own / gib:.1f} GiB)")


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


def is_library(path: str) -> bool:
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
    own = next((f for f in reversed(fs) if not is_library(f[0])), None)
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
        own = next((f for f in reversed(fs) if not is_library(f[0])), None)
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
def text_kind(text: str) -> Optional[str]:
    """The kind one error text shows on its own (None: a plain exception, or nothing)."""
    if HANG_MESSAGE.search(text):
        return "hang"
    if DISK_FULL.search(text):
        return "disk_full"
    if OOM.search(text):
        return "node_fault" if node_oom(text) else "oom"
    if PEER_GONE.search(text):
        return "peer_gone"
    if NODE_FAULT.search(text):
        return "node_fault"
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


def is_primary(text: str) -> bool:
    return text_kind(text) != "peer_gone"


def ranks_str(ranks: Iterable[Any]) -> str:
    rs = sorted({int(r) for r in ranks})
    return ("rank " if len(rs) == 1 else "ranks ") + ", ".join(map(str, rs))


def first_line(text: str, limit: int = 300) -> str:
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    return line if len(line) <= limit else line[:limit] + "..."


def clip(text: str, limit: int = 300) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + "..."


def last_traceback(text: str) -> Optional[str]:
    i = text.rfind("Traceback (most recent call last)")
    return text[i:] if i >= 0 else None


def line_with(text: str, pattern: re.Pattern[str]) -> str:
    m = pattern.search(text)
    return line_at(text, m.start(), m.end()) if m else ""


def line_at(text: str, start: int, end: int) -> str:
    """The whole line of ``text`` holding ``text[start:end]``."""
    a = text.rfind("\n", 0, start) + 1
    b = text.find("\n", end)
    return text[a:b if b >= 0 else len(text)].strip()
