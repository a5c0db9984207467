"""Where one `launch` spends its time, per point: the pipeline's phases timed in-process (wall clock,
wrappers only, no profiler overhead), printed as JSON ({phase: seconds}) on stdout's last line.

    .venv/bin/python benchmarks/launch_profile.py LAUNCH_ARGS...

benchmarks/sweep_submit.py --profile runs it on this checkout and, with --before REV, on a clean
checkout of an earlier revision (PYTHONPATH first), side by side. A phase a revision does not have
is left out of its column."""
from __future__ import annotations

import atexit
import functools
import importlib
import json
import sys
import time
from typing import Dict

# (module, attribute): the launch pipeline's phases, outermost first
PHASES = [
    ("launcher.submit.pipeline", "launch"),
    ("launcher.config.compose", "SweepComposer.point"),
    ("launcher.submit.pipeline", "validate"),
    ("launcher.submit.pipeline", "resolve"),
    ("launcher.archive.secrets", "known_secrets"),
    ("launcher.submit.pipeline", "create"),
    ("launcher.archive.snapshot", "take"),
    ("launcher.submit.pipeline", "stage"),
    ("launcher.archive.secrets", "redact_config"),
    ("launcher.submit.staging", "stage"),
    ("launcher.submit.submission", "submit"),
    ("launcher.submit.submission", "_submit_array"),
    ("launcher.submit.pipeline", "publish"),
    ("launcher.archive.registry", "record"),
]
took: Dict[str, float] = {}


def _wrap(modname: str, attr: str) -> None:
    try:
        owner = importlib.import_module(modname)
        name = attr
        if "." in attr:
            cls, name = attr.split(".")
            owner = getattr(owner, cls)
        fn = getattr(owner, name)
    except (ImportError, AttributeError):
        return
    key = f"{modname.rsplit('.', 1)[-1]}.{attr}"
    took[key] = 0.0

    @functools.wraps(fn)
    def timed(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            took[key] += time.perf_counter() - t0

    setattr(owner, name, timed)


def main() -> None:
    t0 = time.perf_counter()
    import launcher.app

    took["import launcher.app"] = time.perf_counter() - t0
    for modname, attr in PHASES:
        _wrap(modname, attr)

    @atexit.register
    def report() -> None:
        took["total"] = time.perf_counter() - t0
        print(json.dumps(took), flush=True)

    sys.argv = ["launch", *sys.argv[1:]]
    launcher.app.main()


if __name__ == "__main__":
    main()
