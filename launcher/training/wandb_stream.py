"""The run's one wandb run, across its attempts (``wandb.enabled``; rank 0 only).

wandb is an observer: nothing it does may end, fail or change the stop of a training run. Two facts
of the job shape this:

- Slurm ends a job's step (preemption, ``scontrol requeue``, an ASHA pause's ``requeuehold``, a
  cancel) by signalling every process of it, wandb's service (``wandb-core``) included. wandb-core
  takes TERM as an order to shut down and cannot be shielded from it (a Go program: it unblocks the
  signal it listens for), so the rank's next ``log`` or ``finish`` meets a closed socket.
- wandb-core writes an offline run's ``.wandb`` file when the run finishes: an attempt whose service
  was killed leaves a file that holds none of its rows.

So every call to wandb is guarded (an error turns the stream off for this attempt, with one line in
the rank's log), and the record ``<run>/wandb/stream.json`` keeps the run's wandb id and the last
step a finished wandb run holds. Each attempt resumes the same wandb run (same id,
``resume="allow"``) and first logs again, from the run's own metrics (the resumed history), every
step after that one: the rows a killed service lost. An attempt whose service was killed leaves no
offline dir behind (its file held nothing whole). The offline dirs left are whole, one per attempt
that finished, with one id; ``wandb sync <run>/wandb/wandb/offline-run-*`` uploads them as one run.
"""
from __future__ import annotations

import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

from launcher.archive import atomic

RECORD = "stream.json"
# what a wandb call raises when its service is gone: its socket's errors, and SystemExit (wandb.teardown
# exits with the killed service's status)
WANDB_ERRORS = (Exception, SystemExit)


def wandb_id(run_id: str) -> str:
    """The wandb run id of a run dir's run: its run id, in the characters wandb allows in an id."""
    return re.sub(r"[^A-Za-z0-9_-]", "-", str(run_id))[:64] or "run"


# W&B Launch's staged inputs: only a program that imported this module can have staged any
LAUNCH_INPUTS = "wandb.sdk.launch.inputs.internal"


def skip_unstaged_launch_inputs(wandb: Any) -> None:
    """wandb.init looks for W&B Launch's staged inputs at every start by importing the Launch agent's
    modules (its public API and their pydantic models: ~0.5 s of CPU on a rank that has torch loaded,
    at every attempt of every run). Inputs are staged only through that module: where it was never
    imported there are none to apply, and the look is skipped; where it was, wandb's own runs."""
    run_cls = getattr(getattr(getattr(wandb, "sdk", None), "wandb_run", None), "Run", None)
    own = getattr(run_cls, "_detect_and_apply_job_inputs", None)
    if own is None or getattr(own, "_launcher_guarded", False):
        return

    def detect(self: Any) -> None:
        if LAUNCH_INPUTS in sys.modules:
            own(self)

    detect._launcher_guarded = True  # type: ignore[attr-defined]
    run_cls._detect_and_apply_job_inputs = detect


def backfill(history: List[Dict[str, Any]], durable_through: int) -> List[Dict[str, Any]]:
    """The resumed history's rows after ``durable_through`` (the last step a finished wandb run holds),
    in step order: what a killed service lost and the new attempt logs again."""
    return sorted((r for r in history if int(r.get("step", 0)) > durable_through), key=lambda r: int(r["step"]))


class WandbStream:
    """This attempt's part of the run's wandb run: opened (resumed), logged to, finished; raises nothing
    but wandb's import."""

    def __init__(self, wb: Any, rundir: Any, config: Dict[str, Any], history: List[Dict[str, Any]]) -> None:
        self.dir = Path(rundir.wandb_dir)  # wandb.init(dir=...): wandb writes into its wandb/ there
        self.path = self.dir / "wandb" / RECORD
        rec = atomic.read_json(self.path, default=None) or {}
        self.id = str(rec.get("id") or wandb_id(rundir.run_id))
        self.durable_through = int(rec.get("durable_through") or 0)
        self.last_step: Optional[int] = None
        self.lost: Optional[str] = None
        self.run = None
        os.environ.setdefault("WANDB_MODE", str(wb.mode))
        os.environ.setdefault("WANDB_SILENT", "true")
        import wandb

        skip_unstaged_launch_inputs(wandb)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.run = wandb.init(project=str(wb.project), dir=str(self.dir), mode=str(wb.mode), id=self.id,
                                  resume="allow", name=rundir.run_id, config=config)
        except WANDB_ERRORS as e:
            self._lose(f"wandb.init failed ({type(e).__name__}: {e})")
            return
        for row in backfill(history, self.durable_through):
            self.log(int(row["step"]), {k: v for k, v in row.items() if k != "step"})

    def _lose(self, why: str) -> None:
        if self.lost is None:
            self.lost = why
            print(f"launcher: wandb is off for the rest of this attempt: {why}; the run's metrics.jsonl has "
                  "every row, and the next attempt logs to wandb again what it missed", file=sys.stderr, flush=True)

    def log(self, step: int, row: Dict[str, Any]) -> None:
        if self.run is None or self.lost:
            return
        try:
            self.run.log(row, step=step)
            self.last_step = step
        except WANDB_ERRORS as e:  # its service was ended with the job's step (a preemption, a pause, a cancel)
            self._lose(f"{type(e).__name__}: {e}")

    def close(self) -> None:
        """Finish the wandb run; a whole finish records the step it holds, a lost one removes the offline
        dir that holds nothing whole (the next attempt logs those rows again)."""
        run, self.run = self.run, None
        if run is None:
            return
        sync_dir = _sync_dir(run)
        if not self.lost:
            try:
                run.finish()
            except WANDB_ERRORS as e:
                self._lose(f"finish: {type(e).__name__}: {e}")
        try:
            import wandb

            wandb.teardown()  # stop wandb's service now, so it writes nothing after the run is sealed
        except WANDB_ERRORS:
            pass  # a service already gone (wandb then calls sys.exit with the service's exit status)
        if self.lost:
            if sync_dir is not None and sync_dir.parent == self.path.parent:
                shutil.rmtree(sync_dir, ignore_errors=True)
            return
        if self.last_step is not None:
            self.durable_through = max(self.durable_through, self.last_step)
        atomic.write_json(self.path, {"id": self.id, "durable_through": self.durable_through})


def _sync_dir(run: Any) -> Optional[Path]:
    """The attempt's own offline dir (``.../wandb/offline-run-<time>-<id>``), or None."""
    try:
        return Path(run.settings.sync_dir)
    except Exception:
        return None
