"""`launcher verify-resume`: the two runs launched, waited for, compared and the verdict recorded.

One launch of several points, side by side where the backend runs them so (cluster=local: at once):
point 0 the reference, straight through ``steps`` steps; one more per ``--at K``, stopped after step K
by the product's stop path (train.faults mode=requeue: the checkpoint, the stop and the requeue a
time-limit signal causes) and resumed as a requeue resumes it. Every run saves a checkpoint at each
step (train.checkpoint.every=1, all kept), so the first differing step is found in the tensors too.
From an archived run (RUN): its archived config, code snapshot and seeds (as `launcher reproduce`);
else the overrides are composed as `launch` composes them. The verdict goes into the launch's sweep
dir (``verify_resume.json``) and, for an archived run, beside it (``verify_resume-<index>.json`` in
its sweep dir), where `launcher show` reads it."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from launcher.archive import atomic
from launcher.config import faults
from launcher.config.errors import ConfigError, ConfigErrors
from launcher.features.verify_resume.verdict import METRICS_ONLY, Diff, Verdict, decide, row_diffs
from launcher.run.rundir import RunDir

RECORD = "verify_resume.json"
DEFAULT_STEPS = 20


def record_of(run_dir: Path) -> Optional[Dict[str, Any]]:
    """The verification that names this run (made of it, or of it as an archived run), if any."""
    rd = RunDir(run_dir)
    for path in (rd.path.parent / f"verify_resume-{rd.path.name}.json", rd.path.parent / RECORD):
        got = atomic.read_json(path, default=None)
        if isinstance(got, dict) and (path.name != RECORD or str(rd.path) in got.get("runs", [])):
            return got
    return None


def overrides_for(steps: int, stop_after: Optional[int]) -> List[str]:
    """What a point of the verification sets: its length, a checkpoint at every step (all kept), and the
    one stop (none for the reference), no other injected fault."""
    return [f"train.steps={steps}", "train.checkpoint.every=1", f"train.checkpoint.keep={steps + 1}",
            "train.fail_at_step=null", faults.requeue_faults(stop_after)]


def _points(target: List[str], run_dir: Optional[Path], steps: int, at: List[int], runs_root: Path):
    from launcher.submit.reproduce import archived_point

    if run_dir is not None:
        if (RunDir(run_dir).run() or {}).get("kind") == "hydra_app":  # its config is the app's, not a run's
            raise ConfigErrors([ConfigError(
                "RUN", f"{run_dir} is a Hydra app's run: verify-resume runs launch's recipes and scripts",
                "make the app's task a recipe (recipe._target_=pkg.module.fn, on launcher.training) or a script "
                "(recipe=script) and verify that")])
        snapshot = Path(RunDir(run_dir).snapshot().get("path", ""))
        if not snapshot.is_dir():
            raise ConfigErrors([ConfigError("RUN", f"{run_dir} has no code snapshot to run from",
                                            "verify a run whose archive is intact")])
        return [archived_point(run_dir, target + overrides_for(steps, k), runs_root) for k in [None, *at]], snapshot
    from launcher.app import compose_point

    return [compose_point(target + overrides_for(steps, k)) for k in [None, *at]], None


def _stopped_at(rd: RunDir) -> Optional[int]:
    """The step the run stopped after (a script's: its metrics' last step when the signal came)."""
    rows = [r for r in rd.restarts() if r.get("reason") == "time_limit"]
    for key in ("failed_step", "from_step"):
        if rows and isinstance(rows[0].get(key), int):
            return int(rows[0][key])
    return None


def _tensor_diffs(reference: Path, resumed: Path) -> Tuple[List[Diff], int, List[str]]:
    """(the checkpoints' differences, how many checkpoint files were compared, the components they hold),
    from a process of its own."""
    res = subprocess.run([sys.executable, "-m", "launcher.features.verify_resume.tensors", str(reference),
                          str(resumed)], capture_output=True, text=True, timeout=3600)
    if res.returncode != 0:
        raise RuntimeError(f"comparing the checkpoints failed: {res.stderr.strip()[-2000:]}")
    got = json.loads(res.stdout)
    return [Diff(**d) for d in got["diffs"]], int(got["files"]), list(got["held"])


def compare(reference: RunDir, resumed: RunDir, steps: int, tolerance: float) -> Verdict:
    stop = _stopped_at(resumed)
    rows = row_diffs(reference.metrics(), resumed.metrics())
    tensors, files, held = _tensor_diffs(reference.path, resumed.path)
    compared = (f"metrics rows and {files} checkpoint files" if files else
                f"{METRICS_ONLY}: the program keeps its own checkpoints, whose tensors the launcher cannot read")
    return decide(rows, tensors, [stop] if stop is not None else [], steps, compared, tolerance,
                  held=held if files else None)


def verify(target: List[str], run_dir: Optional[Path], at: List[int], steps: int, tolerance: float,
           runs_root: Path, out=None) -> int:
    """Exit 0: bitwise or within the tolerance; 1: diverges, or a run did not end as it must; 2: refused."""
    from launcher.submit import pipeline
    from launcher.submit.progress import wait_and_report

    out = out or sys.stdout
    points, snapshot = _points(target, run_dir, steps, at, runs_root)
    meta = {"verify_resume": {"steps": steps, "at": at, **({"verifies": str(run_dir)} if run_dir else {})}}
    result = pipeline.launch(points, argv=list(sys.argv), out=out, code_snapshot=snapshot, extra_meta=meta)
    if result.dry_run:
        return 0
    print(f"verify-resume: the reference and {len(at)} run(s) stopped after step {', '.join(map(str, at))} "
          f"and resumed, side by side ({steps} steps, a checkpoint at each)", file=out, flush=True)
    wait_and_report(result, points, out, timeout_s=int(points[0].cfg.submit.wait_timeout_s), quiet=True)
    runs = [r.rundir for r in result.runs]
    states = {rd.run_id: rd.status().state.value for rd in runs}
    not_done = [(i, state) for i, state in states.items() if state != "completed"]
    verdicts: List[Verdict] = []
    if not not_done:
        for rd in runs[1:]:
            if _stopped_at(rd) is None:
                not_done.append((rd.run_id, "never stopped: the program does not stop at ctx.should_stop "
                                            "(launcher.training's StepLoop asks it at every step)"))
                continue
            verdicts.append(compare(runs[0], rd, steps, tolerance))
    record: Dict[str, Any] = {"runs": [str(rd.path) for rd in runs], "reference": runs[0].run_id,
                              "steps": steps, "at": at, "tolerance": tolerance,
                              "verifies": str(run_dir) if run_dir else None,
                              "verdicts": [v.to_json() for v in verdicts],
                              "not_done": [f"{i}: {why}" for i, why in not_done]}
    worst = next((v for v in verdicts if v.kind == "diverges"), None) or \
        next((v for v in verdicts if v.kind == "tolerance"), None) or (verdicts[0] if verdicts else None)
    record["line"] = worst.line() if worst and not not_done else \
        "not verified: " + "; ".join(f"{i} {why}" for i, why in not_done)
    atomic.write_json(Path(result.sweep_dir) / RECORD, record)
    if run_dir is not None:
        atomic.write_json(Path(run_dir).parent / f"verify_resume-{Path(run_dir).name}.json", record)
    print(f"verify-resume: {record['line']}", file=out)
    if worst is not None and worst.kind == "diverges" and not not_done:
        print(f"  likely: {worst.cause}", file=out)
    print(f"  runs: {', '.join(rd.run_id for rd in runs)}  (record: {Path(result.sweep_dir) / RECORD})", file=out)
    return 1 if not_done or (worst is not None and worst.kind == "diverges") else 0
