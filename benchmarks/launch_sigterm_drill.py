"""SIGTERM at random moments of `launch -m` on the local Slurm cluster (scripts/slurm-local.sh up):
after each try, every array the launch queued is either listed whole by `launcher runs` (which
repairs what an interrupted launch left) or cancelled. 0 orphans is the pass mark.

    .venv/bin/python benchmarks/launch_sigterm_drill.py [--tries 20] [--points 40] [--seed 0] [--app hydra]

``--app hydra``: the same drill for a Hydra app of the user's own on this project's launcher plugin
(recipes/hydra_example on ``hydra/launcher=launcher_slurm``, ``wait=false``) instead of `launch -m`.

Each try: a fresh runs root and $TMPDIR; `launch -m` of a ``--points``-point sweep (one array); SIGTERM
at one of three kinds of moment, in turn: the moment squeue first lists the array (the probe's window:
sbatch returned, nothing published yet); a random 0-0.1 s after that (recording, publishing); a random
delay over the launch's measured duration (composing, snapshot, staging, sbatch ...). Then
`launcher runs --json`. An orphan is a queued or running job of the try whose runs `launcher runs`
does not list, or lists without that job. Also counted: staged `.N.partial` dirs, launch journals and
temporary multirun.yaml dirs left behind. Every job is held (`--begin=now+10hours`: nothing runs) and
cancelled by id at the end of its try. Exit 0 when no try left an orphan or a leftover.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
HOLD = "now+10hours"
TINY = ["cluster=local_slurm", "cluster.nodes=1", "cluster.gpus_per_node=1", "model=gpt_tiny", "train.steps=2",
        "wandb.enabled=false", "train.log_interval=0", "cluster.array_parallelism=1",
        f"+cluster.sbatch_extra.begin={HOLD}"]


def _env(root: Path, tmp: Path) -> Dict[str, str]:
    return dict(os.environ, LAUNCHER_RUNS=str(root), TMPDIR=str(tmp), PYTHONUNBUFFERED="1",
                PYTHONPATH=str(REPO) + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else ""))


def jobs_named(name: str) -> Dict[str, str]:
    """This user's jobs of that name still in the queue: array job id -> state."""
    out = subprocess.run(["squeue", "-h", "-u", str(os.getuid()), "-n", name, "-o", "%F|%T"],
                         capture_output=True, text=True, timeout=60).stdout
    if not out.strip():  # squeue -u takes a name or a uid, depending on the version
        import getpass

        out = subprocess.run(["squeue", "-h", "-u", getpass.getuser(), "-n", name, "-o", "%F|%T"],
                             capture_output=True, text=True, timeout=60).stdout
    jobs: Dict[str, str] = {}
    for line in out.splitlines():
        jid, _, state = line.partition("|")
        if state.strip() not in ("CANCELLED", "COMPLETED", "FAILED"):
            jobs[jid.strip()] = state.strip()
    return jobs


def command(app: str, points: int, root: Path, name: str, tmp: Path) -> List[str]:
    if app == "hydra":  # a user's Hydra app on the plugin: its own process, its own signal handlers
        return [sys.executable, "-m", "recipes.hydra_example.app", "-m", f"x=range({points})",
                "hydra/launcher=launcher_slurm", "hydra.launcher.partition=debug", f"hydra.launcher.name={name}",
                f"hydra.launcher.runs_root={root}", "hydra.launcher.wait=false", "hydra.launcher.array_parallelism=1",
                f"++hydra.launcher.additional_parameters.begin='{HOLD}'", f"hydra.sweep.dir={tmp / 'sweep'}"]
    return [str(BIN / "launch"), "-m", *TINY, f"submit.runs_root={root}", f"submit.job_name={name}",
            f"seed=range({points})"]


def one_try(points: int, delay: Optional[float], work: Path, sig: int = signal.SIGTERM,
            after_queued: float = 0.0, app: str = "launch") -> Dict:
    """One launch, one SIGTERM (``delay`` s after the start; None: ``after_queued`` s after squeue
    first lists the array)."""
    name = "drill-" + secrets.token_hex(3)
    root, tmp = work / "runs", work / "tmp"
    root.mkdir(parents=True)
    tmp.mkdir()
    cmd = command(app, points, root, name, tmp)
    t0 = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(root, tmp),
                            cwd=str(REPO))
    if delay is None:
        while proc.poll() is None and not jobs_named(name) and time.time() - t0 < 120:
            time.sleep(0.02)
        seen = time.time()
        while proc.poll() is None and time.time() - seen < after_queued:
            time.sleep(0.005)
    else:
        while proc.poll() is None and time.time() - t0 < delay:
            time.sleep(0.005)
    at = time.time() - t0
    signalled = proc.poll() is None
    if signalled:
        proc.send_signal(sig)
    try:
        out, _ = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    listed = subprocess.run([str(BIN / "launcher"), "runs", "--json", "--root", str(root)], capture_output=True,
                            text=True, timeout=180, env=_env(root, tmp), cwd=str(REPO))
    runs = json.loads(listed.stdout or "[]")
    repaired = [ln for ln in listed.stderr.splitlines() if ln.startswith("launcher runs:")]
    time.sleep(0.5)  # scancel of a repair: let squeue see it
    queued = jobs_named(name)
    orphans = []
    for jid in queued:
        mine = [r for r in runs if str(r.get("job_id") or "").split("_")[0] == jid]
        if len(mine) != points:
            orphans.append(f"{jid} ({queued[jid]}, {len(mine)} of {points} runs listed)")
    leftovers = ([str(p.relative_to(root)) for p in root.glob("*/.*.partial")]
                 + [str(p.relative_to(root)) for p in root.glob("*/.launch.json")]
                 + ([p.name for p in tmp.glob("launcher-hydra-*")] if sig != signal.SIGKILL else []))
    for jid in queued:
        subprocess.run(["scancel", jid], timeout=60, check=False)
    states: Dict[str, int] = {}
    for r in runs:
        states[r["status"]] = states.get(r["status"], 0) + 1
    return {"at_s": round(at, 2), "signalled": signalled, "rc": proc.returncode, "queued": sorted(queued),
            "listed": states, "repaired": repaired, "orphans": orphans, "leftovers": leftovers,
            "tail": out.strip().splitlines()[-1:] if out.strip() else []}


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tries", type=int, default=20)
    ap.add_argument("--points", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--app", choices=("launch", "hydra"), default="launch",
                    help="launch: `launch -m` (default); hydra: the example Hydra app on hydra/launcher=launcher_slurm")
    ap.add_argument("--signal", default="TERM", help="TERM (default), HUP, INT or KILL (KILL: the repair by "
                    "`launcher runs` does all the work; a KILLed launch's temporary dir is removed by the next launch)")
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    base = Path(tempfile.mkdtemp(prefix="sigterm-drill-"))
    bad = 0
    try:
        # how long an undisturbed launch takes: the random moments are drawn over it
        ref = one_try(args.points, 1e9, base / "reference", app=args.app)
        span = max(ref["at_s"], 1.0)
        print(f"reference launch (no signal): {span:.1f} s, rc {ref['rc']}, listed {ref['listed']}", flush=True)
        for i in range(args.tries):
            delay = None if i % 3 < 2 else rng.uniform(0.0, span * 1.1)
            extra = rng.uniform(0.0, 0.1) if i % 3 == 1 else 0.0
            res = one_try(args.points, delay, base / f"try-{i}", getattr(signal, f"SIG{args.signal.upper()}"), extra,
                          app=args.app)
            ok = not res["orphans"] and not res["leftovers"]
            bad += not ok
            when = (f"array in squeue +{extra:.2f} s" if extra else "array in squeue") if delay is None \
                else f"random {delay:.2f} s"
            late = "" if res["signalled"] else " (after exit)"
            fixed = "; ".join(r[len("launcher runs: "):] for r in res["repaired"])
            print(f"try {i + 1:2d}: SIG{args.signal.upper()} at {res['at_s']:6.2f} s ({when}){late}"
                  f"  rc {res['rc']}  queued {len(res['queued'])}  listed {res['listed'] or '{}'}"
                  f"  orphans {len(res['orphans'])}  leftovers {len(res['leftovers'])}"
                  + (f"  repaired: {fixed}" if fixed else "")
                  + ("" if ok else f"\n    ORPHANS {res['orphans']} LEFTOVERS {res['leftovers']} {res['tail']}"),
                  flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(f"{args.tries} tries, {bad} with an orphan or a leftover")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
