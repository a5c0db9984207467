"""Whether a failed attempt is worth a restart (no torch; ``decide`` is pure).

A restart of a real job waits in the queue for its whole allocation again, so a failure that the
next attempt would repeat ends the run at once, with the reason and the fix:

- one no restart can fix: the recipe cannot be called as ``fn(cfg, ctx)`` (signature), its code
  cannot be imported (import), a config value cannot work (config), the job has no usable device
  (``DeviceError``), a file the code opens is missing before the attempt finished a step, no
  checkpoint to resume from passes verification (``CheckpointCorrupt``: the next attempt would read
  the same bytes);
- one that repeats the previous attempt's failure (same exception, message and raising frame)
  before this attempt finished a new step (a step past the checkpoint it resumed from), or in the
  same step as the previous attempt: a run resumes exactly, so the steps it trains again lead to the
  same state and the same failure, restart after restart.

Every other failure restarts while ``train.max_restarts`` lasts: a peer that went away (a killed rank,
a lost node), a collective timeout, a failure after progress. Signals, hangs and a job the scheduler
restarts never come here (launcher.runtime.task / restarts requeue them).

Each failure that is restarted is recorded (``Failure.to_json``) in status.json's ``stop`` and then in
the next attempt's ``restarts.jsonl`` row (``failure``), where that attempt reads it (``previous``).
"""
from __future__ import annotations

import json
import re
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Tuple

from launcher.config.errors import ConfigError, ConfigErrors
from launcher.doctor import PEER_GONE
from launcher.doctor.failure_text import NODE_FAULT, node_oom
from launcher.run.checkpoint_manifest import CheckpointCorrupt
from launcher.run.io import Unreadable, read_tail
from launcher.run.rundir import RESTARTED_BY_USER, RunDir
from launcher.runtime.env import DeviceError

# why each kind of failure is not restarted, and its fix
NOT_FIXED_BY_A_RESTART: Dict[str, Tuple[str, str]] = {
    "signature": ("the recipe function cannot be called as fn(cfg, ctx)",
                  "define recipe._target_ as def main(cfg, ctx) (cfg: the run's config, ctx: "
                  "launcher.runtime.context.RunContext), then launch again"),
    "import": ("the code cannot be imported",
               "make the module the error names importable from the code snapshot (launch from the "
               "directory holding your package) or install it in the job's environment, then launch again"),
    "config": ("a config value cannot work",
               "fix the key the error names (`launch ... submit.dry_run=true` checks a config without "
               "running it), then launch again or `launcher retry SWEEP --failed key=value`"),
    "device": ("the job has no usable device", "the error names the setting to change; then launch again"),
    "missing_file": ("a file the code opens is missing before any step of the attempt",
                     "pass a path that exists on the nodes (an absolute one: the job runs in the run's "
                     "work/ dir), then `launcher resume RUN key=value` or launch again"),
    "corrupt_checkpoint": ("no checkpoint to resume from is intact (checked against its checkpoint.json)",
                           "restore the file the error names from a copy (or delete checkpoints/latest to train "
                           "from step 0), then `launcher resume RUN`"),
    "dataset": ("a dataset the run reads is not what its manifest holds (a shard changed or missing)",
                "restore the file the error names, or prepare the dataset again (launcher data prepare); "
                "`launcher data verify DIR` names every change; then launch again"),
    "repeated": ("the failure repeats the previous attempt's before any new step",
                 "fix it at the frame shown (`launcher logs RUN --err`), then `launcher resume RUN`"),
}
# Python's own words when a call's arguments do not fit the function's signature
_BINDING = re.compile(r"\(\) (?:takes \d+|takes from \d+|missing \d+ required|got an unexpected keyword"
                      r"|got multiple values)")
_ADDRESS = re.compile(r"0x[0-9a-fA-F]+")
_LAUNCHER = str(Path(__file__).resolve().parents[1]) + "/"  # this launcher package's own files


@dataclass(frozen=True)
class Failure:
    """One rank's failure of one attempt: what it was, where, and how far the attempt got."""

    type: str  # the exception's class name
    message: str  # its message (scrubbed of secrets by the caller)
    place: str  # file:line in function of the frame that raised
    kind: str  # signature | import | config | device | missing_file | corrupt_checkpoint | dataset | peer_lost |
    #            node_fault | other
    attempt: int = 1
    step: Optional[int] = None  # the last step this attempt finished (None: none)
    from_step: int = 0  # the checkpoint step the attempt started from
    node: Optional[str] = None  # the node the failing rank ran on (the scheduler's name for it)

    @property
    def progressed(self) -> bool:
        return self.step is not None and int(self.step) > int(self.from_step)

    @property
    def signature(self) -> Tuple[str, str, str]:
        """What a repeat shares: the class, the message (object addresses aside) and the place."""
        return self.type, _ADDRESS.sub("0x?", " ".join(self.message.split())), self.place

    def to_json(self) -> Dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: Optional[Mapping[str, Any]]) -> Optional[Failure]:
        if not d or not d.get("type"):
            return None
        names = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in d.items() if k in names})


@dataclass(frozen=True)
class Decision:
    restart: bool
    why: str
    fix: str = ""
    kind: str = ""  # a key of NOT_FIXED_BY_A_RESTART when not restarted

    def to_json(self) -> Dict[str, Any]:
        return asdict(self)


def kind_of(exc: BaseException, message: str, place_file: str) -> str:
    """The kind of an exception (``place_file``: the file of the frame that raised it)."""
    names = {c.__name__ for c in type(exc).__mro__}
    if isinstance(exc, TypeError) and _BINDING.search(message) and place_file.startswith(_LAUNCHER):
        return "signature"  # the launcher's call of the recipe itself failed, not a call inside it
    if isinstance(exc, (ImportError, SyntaxError)):
        return "import"
    if isinstance(exc, (ConfigError, ConfigErrors)) or "OmegaConfBaseException" in names:
        return "config"
    if isinstance(exc, DeviceError):
        return "device"
    if isinstance(exc, CheckpointCorrupt):
        return "corrupt_checkpoint"
    if "DatasetError" in names:  # the next attempt would read the same bytes
        return "dataset"
    if isinstance(exc, (FileNotFoundError, NotADirectoryError, IsADirectoryError)):
        return "missing_file"
    if PEER_GONE.search(message):
        return "peer_lost"
    if NODE_FAULT.search(message) or node_oom(message):  # (GPU memory other processes held: the node's)
        return "node_fault"
    return "other"


def failure_of(exc: BaseException, message: str, *, attempt: int, step: Optional[int], from_step: int,
               node: Optional[str] = None) -> Failure:
    """The Failure of an exception that ended this rank's attempt (``message``: its scrubbed text;
    ``node``: where the rank ran)."""
    tb = traceback.extract_tb(exc.__traceback__) if exc.__traceback__ is not None else []
    last = tb[-1] if tb else None
    place = f"{last.filename}:{last.lineno} in {last.name}" if last else ""
    return Failure(type=type(exc).__name__, message=message[:500], place=place,
                   kind=kind_of(exc, message, last.filename if last else ""), attempt=int(attempt),
                   step=step, from_step=int(from_step), node=node)


def decide(failure: Failure, previous: Optional[Failure]) -> Decision:
    """Restart or not, and why (pure). ``previous``: the failure that ended the previous attempt
    (None: the first attempt, or the first since launcher resume/retry)."""
    if failure.kind == "peer_lost":
        return Decision(True, "a peer went away (a killed rank or a lost node): the next attempt may not")
    if failure.kind == "node_fault":
        same = previous is not None and previous.signature == failure.signature
        if same and previous.node and failure.node and previous.node != failure.node:
            return Decision(False, f"the same device error on two nodes ({previous.node}, then {failure.node}): the "
                            "program's, not a node's", NOT_FIXED_BY_A_RESTART["repeated"][1], "repeated")
        if not same:  # the next attempt leaves this node out (launcher.features.nodes)
            return Decision(True, f"the device or its link failed on node {failure.node or '?'}: the next attempt "
                            "runs without that node")
    if failure.kind in NOT_FIXED_BY_A_RESTART and not (failure.kind == "missing_file" and failure.progressed):
        why, fix = NOT_FIXED_BY_A_RESTART[failure.kind]
        return Decision(False, why, fix, failure.kind)
    if previous is not None and previous.signature == failure.signature:
        why, fix = NOT_FIXED_BY_A_RESTART["repeated"]
        at = f" at {failure.place}" if failure.place else ""
        if not failure.progressed:
            return Decision(False, f"{why} (attempt {previous.attempt} failed the same way{at})", fix, "repeated")
        # an exception, not a silent death (a node lost twice at one step is chance, not the program)
        if failure.kind != "rank_lost" and failure.step is not None and previous.step == failure.step:
            return Decision(False, f"the failure repeats the previous attempt's in the same step ({failure.step + 1}): "
                            f"the run resumes exactly, so each restart would train into it again (attempt "
                            f"{previous.attempt} failed the same way{at})", fix, "repeated")
    if failure.progressed:
        return Decision(True, f"the attempt made progress (step {failure.step}, from {failure.from_step})")
    return Decision(True, "the first failure of its kind: the next attempt may not repeat it")


# ---- what the run dir says about this attempt ---------------------------------------------------------
def start_of(rd: RunDir, attempt: int) -> Tuple[int, Optional[Failure]]:
    """The checkpoint step ``attempt`` started from and the failure that ended the attempt before it
    (None: none recorded, or the restart was launcher resume/retry, a fresh start the user asked for)."""
    try:
        rows = rd.restarts()
    except (OSError, ValueError):  # a record being written: decide as on a first failure
        rows = []
    row = next((r for r in reversed(rows) if r.get("attempt") == attempt), None)
    if row is None:
        return 0, None
    previous = None if row.get("reason") in RESTARTED_BY_USER else Failure.from_json(row.get("failure"))
    try:  # the row names `latest` as it was; a resume that fell back past it started earlier
        fell_back = next((f for f in reversed(rd.fallbacks()) if f.get("attempt") == attempt), None)
    except (OSError, ValueError):
        fell_back = None
    return int((fell_back or row).get("from_step") or 0), previous


def last_logged_step(rd: RunDir, since: float) -> Optional[int]:
    """The last step in the metrics that a row written since ``since`` (epoch seconds) names: progress
    of a recipe that logs metrics but does not call ctx.heartbeat(step)."""
    try:
        lines = read_tail(rd.metrics_path, 8192).decode("utf-8", errors="replace").splitlines()
    except (OSError, Unreadable):
        return None
    for line in reversed(lines):
        try:
            row = json.loads(line)
            if float(row.get("time") or 0) >= since:
                return int(row["step"])
            return None
        except (ValueError, KeyError, TypeError, AttributeError):
            continue
    return None


def judge(rd: RunDir, exc: BaseException, message: str, *, attempt: int, watch_step: Optional[int],
          since: float, node: Optional[str] = None) -> Tuple[Failure, Decision]:
    """This rank's failure and the decision on it, from the exception and the run dir's records."""
    from_step, previous = start_of(rd, attempt)
    steps = [s for s in (watch_step, last_logged_step(rd, since)) if s is not None]
    failure = failure_of(exc, message, attempt=attempt, step=max(steps) if steps else None, from_step=from_step,
                         node=node)
    return failure, decide(failure, previous)
