"""`launcher resume RUN`: continue a failed, cancelled, timed-out or finished run from its latest
checkpoint, as a new attempt of the same run (same run dir, archived config, code snapshot, seeds).

The sealed archive is verified first (a changed archive is refused); its manifest is kept under
``attempts/<a>/`` and the run reopens; ``restarts.jsonl`` records the resume (with a changed
``train.steps``, if asked). The new job resumes from ``checkpoints/latest`` like any requeued
attempt does (launcher.runtime.restarts).
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

from launcher import backends
from launcher.layout import ConfigError, ConfigErrors
from launcher.rundir import FINAL, RunDir, SweepDir, now_iso


def resume(run_dir: Path, steps: Optional[int] = None, out=None):
    """Submit the run's next attempt; returns the pipeline's SweepResult for the wait view."""
    from launcher.archive import registry
    from launcher.runtime.task import RunTask
    from launcher.schema import typed
    from launcher.submit.pipeline import SubmittedRun, SweepResult

    out = out or sys.stdout
    rd = RunDir(run_dir)
    if not rd.exists():
        raise FileNotFoundError(f"{run_dir} is not an archived run (no {RunDir.RUN})")
    st = rd.status()
    if st.get("status") not in FINAL:
        raise ConfigErrors([ConfigError("RUN", f"the run is {st.get('status')}: its job may still be running or "
                                        "queued", "wait for it, or `launcher cancel` it first")])
    problems = rd.verify()
    if problems:
        raise ConfigErrors([ConfigError("RUN", "the archive changed after it was sealed: " + "; ".join(problems),
                                        "resume an intact run (launcher show RUN lists what changed)")])
    plain = rd.config()
    latest = rd.latest_checkpoint()
    done = RunDir.checkpoint_step(latest) if latest else 0
    old_steps = int(plain["train"]["steps"])
    if steps is not None:
        if int(steps) < max(1, done):
            raise ConfigErrors([ConfigError("--steps", f"{steps} is before the latest checkpoint (step {done})",
                                            f"choose --steps {max(done, old_steps)} or more")])
        plain["train"]["steps"] = int(steps)
    if latest is None:
        print("warning: the run has no checkpoint; it starts again from step 0", file=sys.stderr)
    elif done >= int(plain["train"]["steps"]) and st.get("status") == "completed":
        raise ConfigErrors([ConfigError("--steps", f"the run completed all {old_steps} steps",
                                        f"pass --steps N with N > {old_steps} to train further")])
    cfg = typed(plain)
    backend = backends.of(cfg)
    attempt = int(st.get("attempt") or 1)
    rd.reopen(attempt)
    if steps is not None:
        rd.write_config(plain)
    detail = f"launcher resume after {st.get('status')}" + (
        f"; train.steps {old_steps} -> {steps}" if steps is not None and int(steps) != old_steps else "")
    rd.record_restart({"attempt": attempt + 1, "reason": "resume", "detail": detail, "from_step": done,
                       "nodes": st.get("hosts"), "job_id": st.get("job_id")})
    code_dir = Path(rd.snapshot().get("path", ""))
    if not code_dir.is_dir():
        raise FileNotFoundError(f"the run's code snapshot {code_dir} is gone: nothing to resume with")
    sweep = SweepDir(rd.path.parent)
    with backend.environment(cfg, code_dir):
        ex = backend.executor(cfg, sweep.submitit_folder, code_dir)
        job = ex.submit(RunTask(str(rd.path)))
    old_job = rd.job()
    job_id = str(job.job_id)
    rd.write_job({**old_job, "job_id": job_id, "array_job_id": None, "array_task_id": None,
                  "stdout": str(job.paths.stdout), "stderr": str(job.paths.stderr), "submitted": now_iso(),
                  "earlier_job_ids": list(old_job.get("earlier_job_ids", [])) + [old_job.get("job_id")]})
    rd.set_status("pending", job_id=job_id, attempt=attempt, resumed=True)
    registry.record(sweep.path.parent, [rd.path])
    run_id = (rd.run() or {}).get("run_id", rd.path.name)
    print(f"resuming {run_id} from step {done} (attempt {attempt + 1}), job {job_id}", file=out)
    return SweepResult(sweep_id=sweep.sweep_id, sweep_dir=sweep.path,
                       runs=[SubmittedRun(run_id=run_id, rundir=rd, job_id=job_id, job=job)],
                       job_ids=[job_id], backend=backend)
