"""``recipe=script`` on the node: each rank runs the script as its child, with the environment
torchrun gives its workers, and makes no process group for it (the script makes its own).
docs/scripts.md is the user's view; launcher.script_recipe the login side. No torch here.

- The attempt: rank 0 began it (restarts.begin_attempt) before the script starts; the other ranks,
  which share no process group with it, learn its number from ``ranks/attempts.json``, where rank 0
  names the start (host, pid) of each rank it has seen (``announce`` / ``learn_attempt``).
- The working dir (``work_dir``): the script starts where it was launched, in the run's own mirror of
  the code snapshot (``<run>/work/`` mirrors the snapshot's root; the script starts in its launch dir
  there): its directories and data files are the run's, its code links to the snapshot's. A relative
  read finds the user's file; a relative write lands in the run dir (the snapshot is read-only and
  shared by a sweep).
- Signals: TERM and USR2 are recorded (restarts.StopFlag) and forwarded to the script.
- The outcome (``outcome``): exit 0 completes the run; after a forwarded stop signal, whatever the
  exit, the run is interrupted (time limit: requeued; TERM: left to the scheduler), at the step the
  metrics say; a non-zero exit fails it with that exit code (not requeued: the script said so);
  killed by a signal, it fails as a killed rank does (requeued while the restart budget lasts).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

from launcher import script_recipe
from launcher.archive import snapshot
from launcher.config.faults import requeue_step
from launcher.run.rundir import RunDir
from launcher.run.status import Status
from launcher.runtime import restarts

if TYPE_CHECKING:
    from launcher.config.schema import RunConfig

# a non-zero exit of one rank's script is often a peer's failure seen through the process group: the
# other rank's record (a requeue asked, a failure) gets this long to appear before this rank's counts
PEER_GRACE_S = 5.0

# the child runs this first: it dies with its rank (SIGKILL when the parent goes, even by SIGKILL),
# then becomes the script (same pid, so signals and the exit status are the script's own)
_ORPHAN_GUARD = (
    "import ctypes, os, signal, sys\n"
    "try:\n"
    "    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG\n"
    "except (OSError, AttributeError):\n"
    "    pass\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit(1)\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n"
)


def main(cfg: RunConfig, ctx: Any) -> Dict[str, Any]:
    """recipe=script's ``_target_``: the job runs the script itself (``run``), with no process group."""
    raise RuntimeError("recipe=script is run by launcher.runtime.task without a process group; "
                       "it is not a recipe function to call")


def torchrun_env(denv: Any, attempt: int, max_restarts: int, rd: RunDir) -> Dict[str, str]:
    """The variables torchrun sets for a worker, and the launcher's own (docs/scripts.md)."""
    return {
        "RANK": str(denv.rank), "LOCAL_RANK": str(denv.local_rank), "WORLD_SIZE": str(denv.world_size),
        "LOCAL_WORLD_SIZE": str(denv.local_world_size), "LOCAL_SIZE": str(denv.local_world_size),
        "GROUP_RANK": str(denv.node_rank),
        "GROUP_WORLD_SIZE": str(denv.num_nodes), "ROLE_NAME": "default", "ROLE_RANK": str(denv.rank),
        "ROLE_WORLD_SIZE": str(denv.world_size), "MASTER_ADDR": str(denv.master_addr),
        "MASTER_PORT": str(denv.master_port), "TORCHELASTIC_RESTART_COUNT": str(attempt - 1),
        "TORCHELASTIC_MAX_RESTARTS": str(max_restarts), "TORCHELASTIC_RUN_ID": rd.run_id,
        "LAUNCHER_RUN_DIR": str(rd.path), "LAUNCHER_ATTEMPT": str(attempt),
        "LAUNCHER_CHECKPOINT_DIR": str(rd.script_checkpoint_dir), "LAUNCHER_METRICS_FILE": str(rd.metrics_path),
    }


@dataclass(frozen=True)
class Outcome:
    kind: str  # completed, interrupted, failed (its exit code), killed (by a signal)
    exit_code: int
    reason: Optional[str] = None  # interrupted: the stop's reason (restarts.SIGNAL_REASONS)
    error: str = ""


def outcome(returncode: int, stopped: Optional[str]) -> Outcome:
    """What the script's exit means for the run (``stopped``: the stop signal forwarded to it)."""
    if stopped:
        return Outcome("interrupted", returncode, stopped, f"script {describe(returncode)} after the {stopped} signal")
    if returncode == 0:
        return Outcome("completed", 0)
    if returncode < 0:
        return Outcome("killed", returncode, error=f"script {describe(returncode)}")
    return Outcome("failed", returncode, error=f"script exited {returncode}")


def describe(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exited {returncode}"


def summary(rows: List[Dict[str, Any]]) -> Dict[str, Any]:
    """The run's summary from the metrics the script wrote: its last step and loss."""
    last = rows[-1] if rows else {}
    out: Dict[str, Any] = {"exit_code": 0}
    if "step" in last:
        out["steps"] = last["step"]
    if "loss" in last:
        out["final_loss"] = last["loss"]
    return out


def snapshot_dir(rd: RunDir) -> Path:
    """The code snapshot this job runs: the entry of its import path (the backends put it first) that
    holds a snapshot; else the one its run dir records. (The recorded path may read ``<redacted>``
    where it holds a secret-named value, so the import path comes first.)"""
    candidates = [*os.environ.get("PYTHONPATH", "").split(os.pathsep), *sys.path, rd.snapshot().get("path")]
    for entry in filter(None, candidates):
        if snapshot.info(Path(entry)) is not None:
            return Path(entry)
    raise RuntimeError(f"{rd.path}: no code snapshot on the job's import path: nowhere to find the script")


# The run's mirror of the snapshot (``work_dir``): its directories are made in the run, its files copied
# (a script may rewrite them: the copy is the run's) or linked (code, and what the budgets leave out);
# past MIRROR_ENTRIES a directory is linked whole. Bounded: a run costs a few thousand entries and a
# few MB, whatever the tree.
MIRROR_ENTRIES = 2000
COPY_FILE_BYTES = 1 << 20  # a larger file is linked (read through the link)
COPY_BYTES = 16 << 20  # copied in all, per run
_SNAPSHOT_OWN = frozenset({".snapshot.json", snapshot.PATCH_FILE})  # the launcher's records, not the user's


def launch_dir(code_dir: Path) -> Optional[str]:
    """Where in the snapshot its launch ran (``.``: its root; None: outside it, or a snapshot taken
    before launchers recorded it)."""
    found = (snapshot.info(code_dir) or {}).get("launch_dir")
    return str(found) if found else None


def _linked(name: str) -> bool:
    """Code, linked to the snapshot's (its bytecode beside it, and the provenance: the run ran the
    snapshot's file), never copied."""
    return name.endswith(".py") or name == "__pycache__"


def work_dir(rd: RunDir, code_dir: Path, launch: Optional[str], entries: int = MIRROR_ENTRIES,
             copy_bytes: int = COPY_BYTES) -> Path:
    """The script's working dir, made (idempotently: a later attempt finds it made and keeps what the
    script wrote): ``<run>/work/`` mirrors the code snapshot's root, and the script starts in its launch
    dir there, as under torchrun.

    Breadth first, the launch dir's tree, then the rest of the snapshot (``../data`` reads): each
    directory is made in the run while ``entries`` last (then linked whole), each ``.py`` file linked
    to the snapshot's, each other file copied (up to COPY_FILE_BYTES each, ``copy_bytes`` in all; then
    linked). So a relative read finds the user's file, and a relative write (a new file or directory,
    a rewrite of a copied file) lands in the run dir; a write through a link into the snapshot fails
    (it is read-only), so the code every point of a sweep runs stays as it was archived. ``launch``
    None: the empty ``<run>/work/``, as before snapshots recorded their launch dir."""
    root = rd.work_dir
    parts: Tuple[str, ...] = () if launch in (None, ".") else PurePosixPath(str(launch)).parts
    cwd = root.joinpath(*parts)
    cwd.mkdir(parents=True, exist_ok=True)
    if launch is None:
        return cwd
    code_real, root_real = Path(os.path.realpath(code_dir)), Path(os.path.realpath(root))
    left = {"entries": entries, "bytes": copy_bytes}
    queue: List[PurePosixPath] = []

    def listing(rel: PurePosixPath) -> List[str]:
        try:
            names = sorted(os.listdir(code_real.joinpath(*rel.parts)))
        except (FileNotFoundError, NotADirectoryError):
            return []
        return [n for n in names if rel.parts or n not in _SNAPSHOT_OWN]

    def place(rel: PurePosixPath) -> None:
        src, at = code_real.joinpath(*rel.parts), root_real.joinpath(*rel.parts)
        if src.is_dir() and not _linked(rel.name):
            inside = len(listing(rel))
            if (at.is_dir() and not at.is_symlink()) or inside <= left["entries"]:  # (or made by an earlier attempt)
                left["entries"] -= inside
                at.mkdir(exist_ok=True)
                queue.append(rel)
                return
        if os.path.lexists(at):  # made by an earlier attempt, or the script's own since
            return
        size = src.stat().st_size if src.is_file() else 0
        if src.is_file() and not _linked(rel.name) and size <= COPY_FILE_BYTES and size <= left["bytes"]:
            left["bytes"] -= size
            part = root_real.parent / f".work-copy.{os.getpid()}.part"
            shutil.copyfile(src, part)
            os.chmod(part, 0o644)  # the run's own copy: writable, whatever the snapshot's mode
            os.replace(part, at)
            return
        try:
            os.symlink(os.path.relpath(src, at.parent), at)
        except FileExistsError:
            pass

    def drain() -> None:
        while queue:
            rel = queue.pop(0)
            for name in listing(rel):
                place(rel / name)

    queue.append(PurePosixPath(*parts))
    drain()
    for i, part in enumerate(parts):  # the dirs above the launch dir: their other entries
        above = PurePosixPath(*parts[:i])
        for name in listing(above):
            if name != part:
                place(above / name)
        drain()
    return cwd


def stop_detail(reason: str, step: Optional[int]) -> str:
    """restarts.jsonl's detail of a stop signal forwarded to the script (it saves its own checkpoint,
    which the launcher never reads: the step is the last one its metrics named, if any)."""
    return (f"{reason.replace('_', ' ')} signal, forwarded to the script (its own checkpoint, if it saved one"
            + (f"; its metrics' last step {step})" if step is not None else ")"))


def _identity(rank_record: Dict[str, Any]) -> List[Any]:
    """One start of one rank: its host, pid and start time (ranks/rank_<r>.json)."""
    return [rank_record.get("hostname"), rank_record.get("pid"), rank_record.get("started")]


def announce(rd: RunDir, attempt: int, stop: threading.Event, interval_s: float = 0.5) -> None:
    """Rank 0, while its script runs: name each rank's latest start in ranks/attempts.json with the
    attempt (a stale start of an earlier attempt is named too, harmlessly: it is not waiting)."""
    seen: Dict[str, List[Any]] = {}
    mtimes: Dict[int, float] = {}
    first = True
    while True:
        changed = [(r, t) for r, t in rd.rank_file_mtimes().items() if r != 0 and mtimes.get(r) != t]
        for r, t in changed:
            mtimes[r] = t
            seen[str(r)] = _identity(rd.rank(r))
        if changed or first:
            rd.write_rank_attempts({"attempt": attempt, "starts": seen})
            first = False
        if stop.wait(interval_s):
            return


def learn_attempt(rd: RunDir, rank: int, timeout_s: float, interval_s: float = 0.2) -> int:
    """A rank other than 0: the attempt rank 0 began, once it names this start of this rank."""
    me = _identity(rd.rank(rank))
    deadline = time.time() + timeout_s
    while True:
        record = rd.rank_attempts()
        if (record.get("starts") or {}).get(str(rank)) == me:
            return int(record["attempt"])
        if rd.is_final():  # rank 0 ended the run (e.g. the restart budget was spent)
            raise SystemExit(1)
        if time.time() > deadline:
            raise RuntimeError(f"rank 0 did not start this attempt within {timeout_s:.0f} s (train.dist_timeout_s)")
        time.sleep(interval_s)


class MetricsTail:
    """The step of the last row in the metrics file, read as the file grows (rows of earlier attempts
    count for the step, not as progress)."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.rest, self.step = Path(path), 0, b"", None
        self.poll()

    def poll(self) -> bool:
        """Read what was appended; whether a new row came."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return False
        self.offset += len(data)
        *lines, self.rest = (self.rest + data).split(b"\n")
        new = False
        for line in lines:
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict) and isinstance(row.get("step"), int):
                self.step, new = row["step"], True
        return new


class Forwarder:
    """TERM and USR2 go on to the script (after restarts.StopFlag's handler has recorded them);
    ``reason`` is the stop forwarded (the highest, as StopFlag ranks them)."""

    def __init__(self, child: subprocess.Popen) -> None:
        self.child, self.reason = child, None
        self.prev: Dict[int, Any] = {}

    def install(self, already: Optional[str]) -> Forwarder:
        for sig, reason in restarts.SIGNAL_REASONS.items():
            self.prev[sig] = prev = signal.getsignal(sig)

            def handler(signum: int, frame: Any, prev: Any = prev, reason: str = reason) -> None:
                if callable(prev):
                    prev(signum, frame)
                self.forward(signum, reason)

            signal.signal(sig, handler)
        if already:  # signalled while the script was starting
            sig = next(s for s, r in restarts.SIGNAL_REASONS.items() if r == already)
            self.forward(sig, already)
        return self

    def forward(self, signum: int, reason: str) -> None:
        if self.child.returncode is not None:
            return
        if self.reason is None or restarts.STOP_CODES[reason] > restarts.STOP_CODES[self.reason]:
            self.reason = reason
        try:
            os.kill(self.child.pid, signum)
        except ProcessLookupError:
            pass

    def restore(self) -> None:
        for sig, prev in self.prev.items():
            signal.signal(sig, prev)


def run(rd: RunDir, cfg: Dict[str, Any], denv: Any, watch: Any, stop_flag: Any,
        attempt: Dict[str, int]) -> Dict[str, Any]:
    """Run the script for this rank and turn its exit into the rank's outcome (see the module doc):
    returns the summary, or raises what launcher.runtime.task.run records."""
    recipe, train = cfg["recipe"], cfg.get("train") or {}
    code_dir = snapshot_dir(rd)
    launch = launch_dir(code_dir)
    stop_announcing = threading.Event()
    if denv.rank == 0:
        n = int(attempt.get("n") or 1)
        cwd = work_dir(rd, code_dir, launch)  # before the other ranks learn the attempt: then they find it
        if denv.world_size > 1:
            threading.Thread(target=announce, args=(rd, n, stop_announcing), name="attempt-announce",
                             daemon=True).start()
    else:
        n = learn_attempt(rd, denv.rank, float(train.get("dist_timeout_s") or 600))
        cwd = rd.work_dir.joinpath(*(() if launch in (None, ".") else PurePosixPath(launch).parts))
    attempt["n"] = n
    rd.script_checkpoint_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **torchrun_env(denv, n, int(train.get("max_restarts") or 0), rd)}
    # the script through the run's mirror (a write beside __file__ lands in the run too; its imports
    # come from the snapshot: Python puts the script's real dir first on sys.path)
    argv = script_recipe.command(recipe, code_dir if launch is None else rd.work_dir, sys.executable, n, launch)
    tail = MetricsTail(rd.metrics_path)
    print(f"[launcher] rank {denv.rank}: {' '.join(argv)} (attempt {n}, in {cwd})", flush=True)
    child = subprocess.Popen([sys.executable, "-c", _ORPHAN_GUARD, str(os.getpid()), *argv], env=env, cwd=cwd)
    forwarder = Forwarder(child).install(stop_flag.reason if stop_flag is not None else None)
    stop_after = requeue_step(train, n)  # train.faults mode=requeue: the time-limit signal once past that step
    try:
        while True:
            try:
                returncode = child.wait(timeout=1.0)
                break
            except subprocess.TimeoutExpired:
                if tail.poll() and watch is not None:
                    watch.beat(tail.step)  # progress: the hang watch (train.hang_timeout_s) counts from here
                if stop_after is not None and tail.step is not None and tail.step >= stop_after:
                    stop_after = None
                    print(f"[launcher] rank {denv.rank}: step {tail.step} reached: the time-limit signal "
                          "(train.faults mode=requeue)", flush=True)
                    forwarder.forward(signal.SIGUSR2, "time_limit")
    finally:
        forwarder.restore()
        stop_announcing.set()
        _end(child)
    tail.poll()
    result = outcome(returncode, forwarder.reason)
    if result.kind == "completed":
        return summary(rd.metrics())
    if result.kind == "interrupted":
        print(f"[launcher] rank {denv.rank}: {result.error}", flush=True)
        raise restarts.Interrupted(str(result.reason), tail.step)
    if result.kind == "killed":
        raise RuntimeError(f"rank {denv.rank}: {result.error}")
    _fail(rd, denv, result, argv)
    return {}  # not reached


def _fail(rd: RunDir, denv: Any, result: Outcome, argv: List[str]) -> None:
    """The script exited non-zero: the run failed with its exit code, unless another rank's record
    says this exit followed its failure (then this rank follows that one)."""
    deadline = time.time() + (PEER_GRACE_S if denv.world_size > 1 else 0.0)
    while time.time() < deadline:
        st = rd.status()
        if st.state is Status.requeued:  # a peer asked for a requeue (it was killed): so does this rank
            raise RuntimeError(f"rank {denv.rank}: {result.error} after another rank's failure")
        if st.is_final:
            raise SystemExit(result.exit_code)
        time.sleep(0.2)
    if not rd.is_final():
        rd.write_rank_error(denv.rank, f"{result.error}; why is in the script's output, this rank's log "
                            f"(`launcher logs RUN --rank {denv.rank} --err`); it ran: {' '.join(argv)}\n")
        rd.finish_in_job(Status.failed, exit_code=result.exit_code, error=result.error, failed_rank=denv.rank,
                  job_id=denv.job_id)
    raise SystemExit(result.exit_code)


def _end(child: subprocess.Popen, wait_s: float = 5.0) -> None:
    """The rank is leaving with its script still running (an exception, an interrupt): stop it."""
    if child.poll() is not None:
        return
    child.terminate()
    try:
        child.wait(timeout=wait_s)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()
