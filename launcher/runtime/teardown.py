"""Teardown that keeps the outcome: what ends a rank's work (a stop signal's ``Interrupted``, an ASHA
``AtRung``, a failure) is decided before its ``finally`` runs, and nothing that tears down after it
(metrics sinks, wandb, the process group, helper threads and processes the step's signal may have
ended first) may replace it. No torch here."""
from __future__ import annotations

import sys
from typing import Callable


def step(fn: Callable[[], object], what: str) -> None:
    """Run one teardown step. While an exception is unwinding (called from a ``finally``), an error of
    the step is printed and dropped, so the exception in flight stays the rank's outcome; with none in
    flight it is raised (a failed teardown of a run that ended well is a failure)."""
    unwinding = sys.exc_info()[1]
    try:
        fn()
    except (Exception, SystemExit) as e:  # SystemExit: a library's sys.exit inside its own teardown
        if unwinding is None:
            raise
        print(f"launcher: {what} failed while the rank ended ({type(unwinding).__name__}: {unwinding}): "
              f"{type(e).__name__}: {e}; kept the first", file=sys.stderr, flush=True)
