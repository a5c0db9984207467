"""Waiting on submitted runs: a live progress view, then a one-line outcome per run."""
from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Dict, List

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.text import Text

from launcher import backends
from launcher.archive import atomic
from launcher.backends.local import wait_for_local_ranks
from launcher.config import recipe_contract
from launcher.printable import printable
from launcher.run.outcome import settle
from launcher.run.status import Status

if TYPE_CHECKING:
    from launcher.config.schema import RunConfig

# How often the scheduler is asked whether a job ended: submitit's watcher asks 2, 4, 8 ... 128 s after a
# submission, so a job that leaves no result file (a killed or failed rank, a hang) would be seen
# ended up to minutes late; one query refreshes every job of the watcher.
ASK_S = 10.0
ASK_FINAL_S = 1.0  # a run whose outcome is already recorded: its job is about to end


def _ask_scheduler(final: Callable[[], bool], last: float, now: float) -> bool:
    """Whether to ask now, ``last`` the time of the last question; ``final()`` (whether a run waited on has
    recorded its outcome: status files read) only where the answer turns on it."""
    waited = now - last
    return waited >= ASK_S or (waited >= ASK_FINAL_S and final())


def wait_done(job: Any, final: Callable[[], bool], poll_s: float = 0.5) -> None:
    """Until submitit's ``job`` has ended, the scheduler asked as ``wait_and_report`` asks it (``final``:
    whether the job's run has recorded its outcome); submitit's own ``wait`` backs off to minutes."""
    asked = time.time()
    while True:
        force = _ask_scheduler(final, asked, time.time())
        if force:
            asked = time.time()
        if job.done(force_check=force):
            return
        time.sleep(poll_s)


def wait_and_report(result, points: List[Any], out, timeout_s: int = 0, poll_s: float = 0.5,
                    compact: bool = False, quiet: bool = False) -> bool:
    """Block until every run's job ends, showing steps done; True if all completed. ``compact``: one
    bar for all the runs (steps of all of them, counts per state) and one outcome line per run, for
    a sweeper's batches and large sweeps. ``quiet``: no outcome lines (the caller reports them)."""
    console = Console(file=out, force_terminal=None)
    runs = result.runs
    # the checkpoint fallbacks recorded before this wait (an earlier attempt's): not reported again
    fell_back = {r.run_id: len(_fallbacks(r.rundir)) for r in runs}
    # the steps a run counts to, where its recipe counts steps (its contract's steps_key); else None
    totals = [recipe_contract.steps(p.cfg.recipe._target_, lambda key, p=p: _value(p.cfg, key)) for p in points]
    t0 = time.time()
    with Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(), console=console, transient=compact, disable=compact and not console.is_terminal,
    ) as progress:
        if compact:
            whole = progress.add_task(f"{len(runs)} run(s), steps", total=None if None in totals else sum(totals),
                                      info="pending")
            tasks = []
        else:
            tasks = [progress.add_task(r.run_id, total=t, info="pending") for r, t in zip(runs, totals)]
        pending = set(range(len(runs)))
        done_steps = [0] * len(runs)
        asked = time.time()
        while pending:
            force = _ask_scheduler(lambda: any(runs[i].rundir.is_final() for i in pending), asked, time.time())
            if force:
                asked = time.time()
            for i in list(pending):
                r = runs[i]
                rows = r.rundir.metrics()
                done_steps[i] = len(rows)
                if not compact:
                    info = r.rundir.status().state.value
                    if rows:
                        info = (f"loss {rows[-1].get('loss', float('nan')):.4f}  "
                                f"{rows[-1].get('tokens_per_s', 0):,.0f} tok/s")
                    progress.update(tasks[i], completed=len(rows), info=info)
                if r.job.done(force_check=force):
                    pending.discard(i)
                    if compact:
                        done_steps[i] = totals[i] if totals[i] is not None else len(rows)
                    else:
                        progress.update(tasks[i], info=settle(r.rundir, ended=True).value)
            if compact:
                ended = len(runs) - len(pending)
                progress.update(whole, completed=sum(done_steps), info=f"{ended}/{len(runs)} ended")
            if timeout_s and time.time() - t0 > timeout_s:
                _cancel_after_timeout([runs[i] for i in pending], timeout_s)
                break
            if pending:
                time.sleep(poll_s)
    ok = True
    for r in runs:
        st = settle(r.rundir, ended=True).value
        ok &= st in (Status.completed, Status.pruned)  # pruned: sweep=asha's decision, not a failure
        status = r.rundir.status()
        summary = status.summary or {}
        loss, first = summary.get("final_loss"), summary.get("first_loss")
        tps = summary.get("mean_tokens_per_s")
        extra = ""
        if loss is not None and first is not None and tps:
            extra = f"loss {first:.4f} -> {loss:.4f} over {summary.get('steps')} steps, {tps:,.0f} tokens/s"
        if st == "pruned":
            extra = f"at {(status.stop or {}).get('step')} steps (sweep=asha)"
        elif st != "completed":
            # a rank's ESC/OSC sequences shown, not obeyed
            extra = f"{printable(status.error or '')}  (logs: {log_of_failure(r)})"
        if quiet:
            continue
        rejected = "".join(f"\n  {line}" for line in fallback_lines(_fallbacks(r.rundir)[fell_back[r.run_id]:]))
        # soft_wrap: a long line is the terminal's to fold (piped, it stays whole: a path can be copied)
        if compact:
            console.print(Text(f"{r.run_id}: {st}  {extra}  [{r.run_dir}]{rejected}"), soft_wrap=True)
        else:
            console.print(Text(f"{r.run_id}: {st}  {extra}{rejected}\n  archived in {r.run_dir}"), soft_wrap=True)
    return ok


def _fallbacks(rd: Any) -> List[dict]:
    try:
        return rd.fallbacks()
    except (OSError, ValueError):  # a row being written: none reported rather than the wait failing
        return []


def fallback_lines(rows: List[dict]) -> List[str]:
    """One line per checkpoint a node rejected when it resumed (checkpoint_fallbacks.jsonl rows): which,
    why (the files that failed verification), and the step the attempt loaded instead."""
    out = []
    for row in rows:
        for name, problems in (row.get("rejected") or {}).items():
            # "checkpoints/step_00000012/model.pt changed (...)" -> "model.pt changed (...)"
            why = "; ".join(printable(str(p)).replace(f"checkpoints/{name}/", "") for p in problems or ["?"])
            out.append(f"checkpoint {name} rejected ({why}): attempt {row.get('attempt')} resumed from step "
                       f"{row.get('from_step')} ({row.get('resumed_from')})")
    return out


def log_of_failure(run) -> Path:
    """The stderr log of the rank that failed first (rank 0 when no rank recorded a failure)."""
    job = run.rundir.job()
    rank = int(run.rundir.status().failed_rank or 0)
    return backends.get(job.backend).log_path(job, rank, err=True)


def _cancel_after_timeout(runs, timeout_s: int, grace_s: float = 60.0) -> None:
    """submit.wait_timeout_s reached: record the outcome (once: a rank that notices cannot record
    another), cancel the jobs, wait until they have ended (no rank writes any more), then seal."""
    for r in runs:
        r.rundir.finish(Status.cancelled, seal=False, exit_code=None,
                        error=f"cancelled: submit.wait_timeout_s={timeout_s} reached before the run ended")
        r.job.cancel(check=False)
    deadline = time.time() + grace_s
    while time.time() < deadline and not all(r.job.done() for r in runs):
        time.sleep(0.5)

    for r in runs:
        wait_for_local_ranks(r.rundir, timeout_s=max(1.0, deadline - time.time()))
        r.rundir.seal()


def cancel_run(rd: Any, error: str) -> bool:
    """``cancel_runs`` of one run: True when this call recorded its outcome."""
    return cancel_runs([rd], error) == 1


def cancel_runs(rds: List[Any], error: str) -> int:
    """Cancel runs (a sweep's, or one): every outcome recorded first (a rank that notices the cancel then
    records nothing else), then each backend cancels all its jobs together (Slurm: one scancel, one state
    query a second), then every run's ranks on this host waited for and the runs sealed side by side.
    A record that cannot be written (a full disk) never stops the cancel: the jobs are cancelled all the
    same, and what could not be recorded is said on stderr (the next command settles it from the
    scheduler's word, launcher.run.outcome). The number of outcomes this call recorded."""
    from launcher.submit.spread import in_threads  # lazy: progress is imported by every launch

    unrecorded: List[str] = []

    def record(rd: Any) -> bool:
        try:
            return bool(rd.finish(Status.cancelled, seal=False, exit_code=None, error=error))
        except OSError as e:
            unrecorded.append(f"{rd.path}: its outcome could not be recorded ({e.strerror or e})")
            return False

    with atomic.deferred_sync():  # one flush for every record (before any job is cancelled), not one a file
        recorded = sum(record(rd) for rd in rds)
    by_backend: Dict[str, List[Any]] = {}
    for rd in rds:
        job = rd.job()
        if job is not None and job.job_id:
            by_backend.setdefault(job.backend, []).append(job)
    for name, jobs in by_backend.items():
        backends.get(name).cancel_all(jobs)

    def settle(rd: Any) -> None:
        wait_for_local_ranks(rd)
        try:
            rd.seal()
        except OSError as e:
            unrecorded.append(f"{rd.path}: not sealed ({e.strerror or e})")

    # the seals flushed once when all are written; side by side where the file system makes them wait
    with atomic.deferred_sync():
        in_threads(settle, rds)
    for line in unrecorded:
        print(f"launcher: warning: {line}; its job was cancelled, the next `launcher status` settles it",
              file=sys.stderr)
    return recorded


def _value(cfg: RunConfig, key: str) -> Any:
    """A dotted key's value of a config read by attribute (a DictConfig or a ConfigView), or None."""
    for part in key.split("."):
        cfg = getattr(cfg, part, None)
    return cfg
