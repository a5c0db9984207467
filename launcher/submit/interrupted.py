"""Launches that did not finish: the journal a launch keeps in its sweep dir, and the repair that
``launcher runs`` makes of what a killed launch left.

A launch writes ``<sweep>/.launch.json`` (its pid and host) before it stages anything, adds each
array's job id the moment ``sbatch`` returns it, and removes the file once every run is published.
SIGTERM/SIGHUP/SIGINT never leave it behind (launcher.submit.signals); SIGKILL, a crash or a lost node
can. A journal whose launch is gone, next to hidden ``.N.partial`` run dirs, is repaired:

- a run whose job was recorded (its job.json) is published: the job runs it as if nothing happened;
- an array queued but not recorded for every one of its runs is cancelled, its runs published cancelled;
- a job of the sweep that the journal never heard of (killed between sbatch and the journal) is
  found by its batch script, which lives in the sweep's submitit folder, and cancelled;
- runs staged but never queued are published cancelled ("not submitted") when something of the
  sweep was queued, and removed when nothing was (the launch never happened, as after a dry run).

``decide`` is the pure part; ``repair`` reads the dirs, asks the backend and acts.
"""
from __future__ import annotations

import os
import re
import shutil
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Set

from launcher.archive import atomic
from launcher.backends.local import pid_alive
from launcher.run.rundir import RunDir, SweepDir, now_iso
from launcher.submit import waves

JOURNAL = SweepDir.LAUNCH_JOURNAL
STALE_S = 600.0  # a sweep with staged runs and no journal (an older launcher's), left alone this long
_PARTIAL = re.compile(r"^\.(\d+)\.partial$")


# ---- the journal (written by the launch) ---------------------------------------------------------


def begin(sweep_dir: Path, backend: str, indices: List[int]) -> None:
    """Before anything is staged: which process launches which runs of the sweep."""
    Path(sweep_dir).mkdir(parents=True, exist_ok=True)
    atomic.write_json(Path(sweep_dir) / JOURNAL, {"pid": os.getpid(), "host": socket.gethostname(),
                                                 "started": now_iso(), "backend": backend,
                                                 "indices": sorted(indices), "arrays": []})


def queued(sweep_dir: Path, job_id: str, indices: List[int]) -> None:
    """Right after sbatch returned: the array ``job_id`` holds these runs."""
    path = Path(sweep_dir) / JOURNAL
    journal = atomic.read_json(path) or {}
    journal.setdefault("arrays", []).append({"job_id": str(job_id), "runs": sorted(indices)})
    atomic.write_json(path, journal)


def end(sweep_dir: Path) -> None:
    """Every run of the launch is published (or the launch is undone): nothing left to repair."""
    (Path(sweep_dir) / JOURNAL).unlink(missing_ok=True)


# ---- the decision (pure) -------------------------------------------------------------------------


@dataclass
class Repair:
    """What to do with one interrupted launch's staged runs."""

    publish: List[int] = field(default_factory=list)  # recorded runs: published as they are
    cancel_jobs: List[str] = field(default_factory=list)  # arrays to scancel
    cancelled: Dict[int, str] = field(default_factory=dict)  # run -> why it is published cancelled
    remove: bool = False  # nothing was queued: the staged runs are removed


def decide(staged: Dict[int, Optional[str]], arrays: Dict[str, List[int]], found: Set[str]) -> Repair:
    """``staged``: each hidden run's recorded job (its job.json's array or job id; None: none);
    ``arrays``: the journal's job id -> runs; ``found``: the scheduler's jobs whose batch script lives
    in the sweep's submitit folder. An array is kept only when every staged run of it is recorded."""
    out = Repair()
    recorded = {j for j in staged.values() if j}
    for job_id, runs in arrays.items():
        if any(staged.get(i, job_id) is None for i in runs):
            out.cancel_jobs.append(job_id)
            for i in runs:
                if i in staged:
                    out.cancelled[i] = (f"cancelled: the launch was interrupted before it recorded this run's job; "
                                        f"its array {job_id} was cancelled")
    out.cancel_jobs += sorted(j for j in found if j not in arrays and j not in recorded)
    known = set(arrays) | recorded | set(found)
    for i, job in sorted(staged.items()):
        if i in out.cancelled:
            continue
        if job is not None and job not in out.cancel_jobs:
            out.publish.append(i)
        elif known:
            out.cancelled[i] = "not submitted: the launch was interrupted before this run's array was queued"
    out.remove = not known
    return out


def launch_alive(journal: Dict, host: str, alive: Callable[[int], bool]) -> bool:
    """Whether the journal's launch may still be running: its process lives (this host), or it runs
    on another host (whose processes this one cannot see)."""
    if journal.get("host") != host:
        return True
    try:
        return alive(int(journal["pid"]))
    except (KeyError, TypeError, ValueError):
        return False


# ---- the repair (I/O) ----------------------------------------------------------------------------


def staged_runs(sd: SweepDir) -> Dict[int, Optional[str]]:
    """The sweep's hidden staged runs: index -> the submission id its job.json records (None: none)."""
    out: Dict[int, Optional[str]] = {}
    for p in sd.path.iterdir() if sd.path.is_dir() else ():
        m = _PARTIAL.match(p.name)
        if m and p.is_dir():
            job = RunDir(p).job()
            out[int(m.group(1))] = job.submission_id if job is not None else None
    return out


def repair(root: Path) -> List[str]:
    """Repair every interrupted launch under ``root``; one line per sweep repaired, saying what was done."""
    from launcher.run.rundir import sweeps

    lines: List[str] = []
    for sd in sweeps(root):
        try:
            line = repair_sweep(sd) or waves.repaired(sd)
        except OSError as e:  # a sweep this user cannot write: said, the others still repaired
            line = f"sweep {sd.sweep_id}: an interrupted launch could not be repaired ({e})"
        if line:
            lines.append(line)
    return lines


def repair_sweep(sd: SweepDir, alive: Callable[[int], bool] = pid_alive, now: Optional[float] = None) -> Optional[str]:
    from launcher import backends
    from launcher.archive import registry
    from launcher.run.job_record import JobRecord
    from launcher.run.status import Status

    staged = staged_runs(sd)
    journal = atomic.read_json(sd.path / JOURNAL)
    if journal is None:
        if not staged:
            return None
        newest = max((sd.path / f".{i}.partial").stat().st_mtime for i in staged)
        if (now or time.time()) - newest < STALE_S:  # a launch of an older launcher may be staging it
            return None
        journal = {}
    elif launch_alive(journal, socket.gethostname(), alive):
        return None
    if not staged:  # published, but the journal outlived it (killed while removing it)
        end(sd.path)
        return None
    name = journal.get("backend") or next(
        ((RunDir(sd.path / f".{i}.partial").run() or {}).get("backend") for i in staged), None) or "slurm"
    backend = backends.get(name)
    found = set(backend.jobs_in_folder(sd.submitit_folder))
    arrays = {str(a["job_id"]): [int(i) for i in a.get("runs", [])] for a in journal.get("arrays", [])}
    plan = decide(staged, arrays, found)
    back = sorted(plan.cancelled) if sd.waves() is not None and not plan.remove else []
    plan.cancelled = {} if back else plan.cancelled  # a sweep in waves: its wave job queues them instead
    if plan.remove:
        for i in staged:
            shutil.rmtree(sd.path / f".{i}.partial", ignore_errors=True)
        if sd.read() is None and not sd.runs():  # the launch made this sweep: nothing of it is left
            shutil.rmtree(sd.path, ignore_errors=True)
        else:
            end(sd.path)
        return f"sweep {sd.sweep_id}: removed {len(staged)} staged run(s) of an interrupted launch (nothing was queued)"
    for job_id in plan.cancel_jobs:
        backend.cancel(JobRecord(backend=name, job_id=job_id, submitit_folder=str(sd.submitit_folder)))
    for i, why in plan.cancelled.items():
        RunDir(sd.path / f".{i}.partial").finish(Status.cancelled, seal=False, exit_code=None, error=why)
    published = [sd.publish(i) for i in sorted(staged)]
    for rd in published:
        if rd.exists() and rd.is_final():
            rd.seal()
    job_ids = sorted({j for j in staged.values() if j} | set(arrays))
    meta = {"job_ids": [j for j in job_ids if j not in plan.cancel_jobs], "runs": [rd.run_id for rd in published]}
    if sd.read() is None:  # the launch made the sweep (a later batch of a multirun joins one that has it)
        meta.update({"sweep_id": sd.sweep_id, "argv": (published[0].run() or {}).get("argv", []), "backend": name,
                     "code_snapshot": str(sd.code_dir)})
    sd.extend(meta)
    registry.record(sd.path.parent, [rd for rd in published if rd.exists()])
    end(sd.path)
    said = [f"published {len(plan.publish)} run(s) whose job is recorded"] if plan.publish else []
    if back:
        said.append(waves.repaired(sd, back) or f"{len(back)} run(s) put back to wait for the sweep's wave job")
    if plan.cancel_jobs:
        said.append(f"cancelled job(s) {', '.join(plan.cancel_jobs)} it had not recorded")
    if plan.cancelled:
        said.append(f"published {len(plan.cancelled)} run(s) cancelled")
    return f"sweep {sd.sweep_id}: repaired an interrupted launch: " + "; ".join(said)
