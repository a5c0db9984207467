"""A Hydra app's point stopped by the scheduler, on the node: the requeue contract of ``launch`` runs
(launcher.runtime.restarts) for a task function that knows nothing of it.

submitit installs its own USR2 / TERM handlers before it calls the job; ``StopSignals`` replaces
them for the job's lifetime. A signal while the task runs raises ``Stopped`` in the task's frame (a
BaseException: the task's ``except Exception`` and Hydra's ``run_job`` let it through, so it never
becomes the task's JobReturn); one before the task starts is held until it would start; one after
the task returned changes nothing (the point has its result). What a signal means: USR2 when the
time-limit signal is due is the time limit, earlier (``scancel --signal=USR2``, a preemption
notice) a preemption (``timed_out``); TERM is the scheduler ending the job (preemption, ``scontrol
requeue``, ``scancel``).

An app's own checkpoint hook is honoured as submitit honours it: a task function with a
``checkpoint`` method (a ``submitit.helpers.Checkpointable``) is asked for the callable the next
attempt runs (``save_checkpoint``). An app that writes its own checkpoint files into its output dir
finds them there again: the next attempt runs the same pristine config, so the same output dir.

Nothing here imports submitit at module level: Hydra's plugin scan imports this module for every app.
"""
import contextlib
import signal
import sys
import time
from typing import Any, Callable, Iterator, Optional

STOP_SIGNALS = (signal.SIGUSR2, signal.SIGTERM)


class Stopped(BaseException):
    """The point was stopped by a signal while its task ran (not the task's own exception)."""

    def __init__(self, signum: int, reason: str, after_s: float) -> None:
        name = signal.Signals(signum).name
        super().__init__(f"{name} after {after_s:.0f} s: {reason.replace('_', ' ')}")
        self.signum, self.reason, self.after_s = signum, reason, after_s

    def __reduce__(self):  # pickled back as it was: a job's result carries it to the process that waits
        return (Stopped, (self.signum, self.reason, self.after_s))

    @property
    def requeues(self) -> bool:
        """USR2 asks for the requeue (the job goes on otherwise); TERM: the scheduler ends the job and
        decides what follows."""
        return self.signum == signal.SIGUSR2


def timed_out(elapsed_s: float, timeout_min: float, signal_delay_s: float) -> bool:
    """Whether a USR2 this long after the start is the time-limit signal: it is due ``signal_delay_s``
    before the limit (a minute of slack for the job's start). An earlier one (``scancel
    --signal=USR2``, a preemption notice) is a preemption. (submitit's own rule, 80 % of the limit or
    10 minutes before it, calls every signal of a job of 10 minutes or less a time-out.)"""
    return elapsed_s >= float(timeout_min) * 60 - float(signal_delay_s) - 60


class StopSignals:
    """This process's USR2 / TERM handlers while it runs one point. ``stops``: whether this rank stops
    on a signal (rank 0; on submitit's local controller every rank, which restarts the job only once
    all its processes exited; on Slurm the requeue ends the other ranks, as with submitit)."""

    def __init__(self, timeout_min: float, signal_delay_s: float, stops: bool = True) -> None:
        self.timeout_min, self.signal_delay_s = timeout_min, signal_delay_s
        self.stops = stops
        self.t0 = time.time()
        self.armed = False  # the task is running: a signal raises Stopped in it
        self.done = False  # the task returned: a signal changes nothing
        self.pending: Optional[Stopped] = None  # arrived before the task started

    def install(self) -> "StopSignals":
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handler)
        from launcher.runtime import job_start

        job_start.replay()  # what arrived while the job started: held, as any before the task starts
        return self

    def _handler(self, signum: int, frame: Any) -> None:
        after = time.time() - self.t0
        late = timed_out(after, self.timeout_min, self.signal_delay_s)
        reason = "time_limit" if signum == signal.SIGUSR2 and late else "preempted"
        if self.done or not self.stops:
            why = "the point has its result" if self.done else "rank 0 stops the point"
            print(f"launcher: {signal.Signals(signum).name} after {after:.0f} s ignored: {why}", file=sys.stderr,
                  flush=True)
            return
        stop = Stopped(signum, reason, after)
        if self.armed:
            self.armed = False  # once: the task's cleanup runs undisturbed
            raise stop
        if self.pending is None or signum == signal.SIGTERM:
            self.pending = stop

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """Around the task: a held signal stops it before it starts."""
        if self.pending is not None:
            raise self.pending
        self.armed = True
        try:
            yield
        finally:
            self.armed = False
            self.done = True


def save_checkpoint(task_function: Any, app_cfg: Any, next_job: Callable[[Any], Any]) -> Optional[str]:
    """The app's own checkpoint hook, called as submitit calls it (``checkpoint(cfg)``, returning a
    DelayedSubmission or None); the callable it returns becomes the task function of the next attempt:
    ``next_job(callable)`` is the job that replaces the submitted pickle the scheduler starts again.
    Returns why the point cannot be requeued (None: it can; without a hook, the pickled job as
    submitted starts the task again)."""
    hook = getattr(task_function, "checkpoint", None)
    if not callable(hook):
        return None
    import submitit
    from submitit.core import utils

    delayed = hook(app_cfg)
    if delayed is None:
        return "the task function's checkpoint() returned None"
    path = submitit.JobEnvironment().paths.submitted_pickle
    current = utils.DelayedSubmission.load(path)
    current.function = next_job(getattr(delayed, "function", delayed))
    with utils.temporary_save_path(path) as tmp:
        current.dump(tmp)
    return None
