"""cluster=local's job controller: submitit's, with the step's teardown of the Slurm batch script.

submitit's local controller starts the job's processes, signals the time limit and starts them all
again when one exits with the requeue status (144). A rank that dies with no word (SIGKILL, a
segfault, NCCL's C++ teardown) makes no such request, and the run would stay ``running``. So this
controller runs submitit's loop, and when the processes ended without a request it decides as the
Slurm teardown does (launcher.runtime.after_step, from the job's note and the exit statuses): start
them again within train.max_restarts, or record the honest failure. Once every process has ended it
seals the run (its ranks leave the seal due: docs/archive.md). It is a process of its own, not a
rank: ``python -m launcher.runtime.local_controller FOLDER`` (LocalBackend's executor starts it).
"""
from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import List, Optional, Sequence

from launcher.archive import atomic
from launcher.backends.base import STEP_START_ENV
from launcher.features.asha import rungs
from launcher.run.rundir import RunDir
from launcher.run.status import Status
from launcher.runtime import after_step, time_guard
from launcher.runtime.seal import seal_if_due

REQUEUE_EXIT_CODE = 144  # submitit.local.local.LOCAL_REQUEUE_RETURN_CODE
MAX_STARTS = 6  # submitit's local controller starts a job at most this often


def step_rc(exit_codes: Sequence[Optional[int]]) -> int:
    """The processes' exit statuses as one, the way srun reports a step's (a signal N as 128+N): a
    signal tells more than a peer's exit 1, and one other than SIGABRT more than a peer's abort."""
    codes = [c for c in exit_codes if c]
    if not codes:
        return 0
    signals = [c for c in codes if c < 0]
    worst = next((c for c in signals if c != -signal.SIGABRT), signals[0] if signals else codes[0])
    return 128 - worst if worst < 0 else worst


def decide_after(note_path: Path, exit_codes: Sequence[Optional[int]]) -> Optional[str]:
    """After the processes ended without a requeue request: the teardown's decision for the job's note
    (None: no note, nothing due; "requeued": start them again)."""
    note = atomic.read_json(note_path, default=None)
    if not note or not note.get("run"):
        return None
    rd = RunDir(note["run"])
    if rd.is_final():
        return None
    # the local backend's requeue is a start of the processes here: settle only records it
    from launcher import backends

    backend = backends.get(str(note.get("backend") or "local"))
    outcome = after_step.judge(rd, note, after_step.StepEnd(step_rc(exit_codes), "", source="the processes'"))
    done = after_step.settle(rd, outcome, backend, note.get("job_id"))
    if done:
        print(f"launcher: after the processes ended ({exit_codes}): {done}: {outcome.why}", file=sys.stderr,
              flush=True)
    return done


def seal_after(note_path: Path) -> bool:
    """Every process has ended: the run's seal, left due by its ranks, made here (this controller holds
    no rank; on Slurm a one-node job after the job does it). True if this sealed it. A run whose rank 0
    never left its note is sealed by the login side (the launch's wait, launcher.run.outcome)."""
    note = atomic.read_json(note_path, default=None)
    return bool(note and note.get("run")) and seal_if_due(RunDir(note["run"]))


def wait_if_paused(note_path: Path, seen: Optional[set] = None, poll_s: float = 0.5) -> bool:
    """sweep=asha: a run paused at a rung (its processes ended) waits here for the rung's decision
    (launcher.features.asha.rungs); True: promoted (maybe already, before its processes were seen to end),
    start the processes again; False: not paused, or pruned. ``seen``: the attempts already started
    again on a promotion (a promotion is acted on once)."""
    note = atomic.read_json(note_path, default=None)
    if not note or not note.get("run"):
        return False
    rd = RunDir(note["run"])
    while rd.status().state is Status.paused:
        time.sleep(poll_s)
    st = rd.status()
    promoted = st.state is Status.requeued and (st.stop or {}).get("reason") == "promoted"
    if not promoted or (seen is not None and st.attempt in seen):
        return False
    if seen is not None:
        seen.add(st.attempt)
    return True


def ended(note_path: Path) -> None:
    """The run's job is over: a sweep's rungs it leaves are decided again (launcher.features.asha.rungs.on_end)."""
    note = atomic.read_json(note_path, default=None)
    if note and note.get("run"):
        try:
            rungs.on_end(RunDir(note["run"]))
        except Exception as e:  # the next point's end decides again
            print(f"launcher: the rungs were not decided after this run ended ({type(e).__name__}: {e})",
                  file=sys.stderr, flush=True)


def controller_of(folder: Path):
    """submitit's local controller, whose processes are forked from this one once it has imported
    what they all import (launcher.runtime.warm_start), where the backend named those modules."""
    from submitit.core import utils
    from submitit.local.local import Controller  # submitit: only in the controller process

    from launcher.runtime import warm_start

    modules = warm_start.preload_modules()

    class WarmController(Controller):
        def start_tasks(self) -> None:
            # the time limit submitit's loop counts from now (at the earliest: its loop only runs later)
            os.environ[time_guard.JOB_END_ENV] = str(time.time() + self.timeout_s)
            os.environ[STEP_START_ENV] = repr(time.time())  # (after the last attempt's errors)
            # one process is forked too where its modules are loaded already (forked from the warm server)
            warm = self.ntasks > 1 or all(m in sys.modules for m in modules)
            argv = warm_start.child_argv(self.command) if modules and warm else None
            if argv is not None:
                try:
                    warm_start.preload(modules)  # once: a restart finds them imported
                except Exception as e:  # an environment that cannot import them here: new interpreters
                    print(f"launcher: {warm_start.PRELOAD_ENV}: {e!r}: each process starts its own interpreter",
                          file=sys.stderr, flush=True)
                    argv = None
            if argv is None:
                return super().start_tasks()
            # submitit's start_tasks, each process forked instead of a new interpreter
            self.folder.mkdir(exist_ok=True)
            paths = [utils.JobPaths(self.folder, self.pid, k) for k in range(self.ntasks)]
            self.stdouts = [p.stdout.open("a") for p in paths]
            self.stderrs = self.stdouts if self.stderr_to_stdout else [p.stderr.open("a") for p in paths]
            for k in range(self.ntasks):
                env = dict(os.environ)
                env.update(SUBMITIT_LOCAL_LOCALID=str(k), SUBMITIT_LOCAL_GLOBALID=str(k),
                           SUBMITIT_LOCAL_JOB_ID=self.pid)
                self.tasks.append(warm_start.fork_process(argv, env, self.stdouts[k], self.stderrs[k]))

    return WarmController(folder)


def run(folder: Path) -> None:
    controller = controller_of(folder)
    note = folder / f"requeue.{controller.pid}.json"
    os.environ[after_step.ENV] = str(note)  # the ranks' note (the tasks inherit this environment)
    try:
        starts, promoted = 0, set()
        while starts < MAX_STARTS:
            try:
                controller.start_tasks()
                codes: List[Optional[int]] = list(controller.wait())
            finally:
                controller.kill_tasks()
            if wait_if_paused(note, promoted):  # sweep=asha: promoted at its rung, so started again (not a restart)
                continue
            starts += 1
            if any(c == REQUEUE_EXIT_CODE for c in codes):
                continue  # a rank asked: submitit's own restart
            if decide_after(note, codes) != "requeued":
                break
        ended(note)
        seal_after(note)
    finally:
        try:
            note.unlink()
        except OSError:
            pass


if __name__ == "__main__":
    assert len(sys.argv) == 2, "Usage: python -m launcher.runtime.local_controller <submitit folder>"
    signal.signal(signal.SIGINT, signal.default_int_handler)
    run(Path(sys.argv[1]))
