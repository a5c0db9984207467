"""Planner vs measured, before and after calibration: real gpt_tiny runs on this machine (cluster=local,
CPU, gloo), one per layout, then the calibration `launcher plan --calibrate` fits
(recipes/gpt/plan/calibrate.py) applied to them, in-sample and held out.

  .venv/bin/python benchmarks/calibration.py [--steps 16] [--rounds 2] [--out table.md] [--reuse RUNS_ROOT] [--keep DIR]

Runs the layouts one after another (never two at once: they share the machine's cores): single,
dp2, zero1, zero2, zero3 (deepspeed), tp2, pp2 (megatron), dp2xtp2 (4 processes), --rounds times
(each layout's run with the lowest measured step time is kept: the one other jobs on the machine
disturbed least). Measured step time is the median over the steps after the first two; measured
activations the largest activation_bytes any rank recorded in its first step
(recipes/common/activations.py). Held out: two-fold — the layouts are split in two halves, each
half's calibration is fitted on the other half only, so each layout's held-out error comes from
constants fitted without it. Prints a markdown table (and writes it to --out).
--reuse RUNS_ROOT tabulates runs made before (found by their tag, calibration_<layout>).
"""
from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

BASE = ["model=gpt_tiny", "precision=fp32", "train.global_batch_size=16", "train.micro_batch_size=2",
        "optim.lr=3e-3", "optim.warmup_steps=2", "seed=11", "train.log_interval=0", "cluster=local",
        "wandb.enabled=false"]
# (name, overrides, processes); the two halves of the held-out check alternate down this list
LAYOUTS = [
    ("single", ["parallelism.engine=ddp"], 1),
    ("dp2", ["parallelism.engine=ddp"], 2),
    ("zero1", ["zero=1"], 2),
    ("zero2", ["zero=2"], 2),
    ("zero3", ["zero=3"], 2),
    ("tp2", ["parallelism=tp"], 2),
    ("pp2", ["parallelism=pp"], 2),
    ("dp2xtp2", ["parallelism=tp"], 4),
]


def launch(name: str, overrides: Sequence[str], procs: int, steps: int, root: Path) -> Path:
    args = [str(Path(sys.executable).parent / "launch"), *BASE, *overrides, f"cluster.gpus_per_node={procs}",
            f"train.steps={steps}", f"tags=[calibration_{name}]"]
    # the launcher and the job both run this checkout's code (its snapshot), whatever else is installed
    env = dict(os.environ, LAUNCHER_RUNS=str(root),
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    t0 = time.time()
    res = subprocess.run(args, capture_output=True, text=True, env=env, timeout=900, cwd=REPO)
    if res.returncode != 0:
        raise SystemExit(f"{name}: launch failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
    run = runs_of(root, name)[-1]
    print(f"  {name}: {time.time() - t0:.0f} s ({run})", file=sys.stderr, flush=True)
    return run


def runs_of(root: Path, name: str) -> List[Path]:
    """The runs of layout ``name`` under ``root``, oldest first."""
    from launcher.run.rundir import RunDir

    found = []
    for p in root.glob("*/*/run.json"):
        meta = RunDir(p.parent).run() or {}
        if f"calibration_{name}" in (meta.get("tags") or []):
            found.append((meta.get("created_ts") or 0, str(p.parent)))
    return [Path(d) for _, d in sorted(found)]


def pct(x: Optional[float], sign: bool = True) -> str:
    return "-" if x is None else f"{x * 100:+.1f}%" if sign else f"{x * 100:.1f}%"


def mib(n: Optional[float]) -> str:
    return "-" if n is None else f"{n / 2**20:.2f}"


def table(names: List[str], samples, fit_all, held: Dict[str, object]) -> str:
    from recipes.gpt.plan.calibrate import mean_abs, rel_error, rows

    cal = fit_all.calibration
    r_all = {n: r for n, r in zip(names, rows(samples, cal))}
    lines = [
        "| layout | planner step (ms) | measured (ms) | error before | calibrated (ms) | error after | "
        "held-out error | planner activations (MiB) | measured (MiB) | error before | calibrated (MiB) | "
        "error after | held-out error |",
        "|" + " --- |" * 13,
    ]
    held_step, held_act = [], []
    for n, s in zip(names, samples):
        r = r_all[n]
        st, act = r["step_time_s"], r["activation_bytes"]
        hc = held[n]
        h_step = rel_error(s.parts.step_time(hc), s.measured_step_s)
        h_act = rel_error(s.planned_activation_bytes * hc.activation_scale, s.measured_activation_bytes)
        held_step.append(h_step)
        held_act.append(h_act)
        lines.append(
            f"| {n} ({s.layout}) | {st['planned'] * 1e3:.3g} | {st['measured'] * 1e3:.1f} | "
            f"{pct(st['error_before'])} | "
            f"{st['calibrated'] * 1e3:.1f} | {pct(st['error_after'])} | {pct(h_step)} | {mib(act['planned'])} | "
            f"{mib(act['measured'])} | {pct(act['error_before'])} | {mib(act['calibrated'])} | "
            f"{pct(act['error_after'])} | {pct(h_act)} |")
    every = list(r_all.values())
    def mean(key: str, when: str) -> str:
        return pct(mean_abs([r[key][when] for r in every]), sign=False)

    lines.append(
        f"| **mean \\|error\\|** | | | {mean('step_time_s', 'error_before')} | | "
        f"{mean('step_time_s', 'error_after')} | "
        f"{pct(mean_abs(held_step), sign=False)} | | | {mean('activation_bytes', 'error_before')} | | "
        f"{mean('activation_bytes', 'error_after')} | {pct(mean_abs(held_act), sign=False)} |")
    consts = ", ".join(f"{k} = {v:.4g}" for k, v in cal.as_dict().items())
    return "\n".join(lines) + f"\n\nCalibration fitted on all {len(names)} runs: {consts}.\n"


def machine() -> str:
    cpu = ""
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    import torch

    return (f"{os.cpu_count()} cores ({cpu or platform.processor()}), CPU only, gloo, torch {torch.__version__}, "
            f"load average {os.getloadavg()[0]:.1f} at the end")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2, help="runs per layout; the least disturbed one is kept")
    ap.add_argument("--out", type=Path, default=None, help="also write the markdown table here")
    ap.add_argument("--reuse", type=Path, default=None, help="runs root of an earlier run of this benchmark")
    ap.add_argument("--keep", type=Path, default=None, help="make the runs under this dir (kept) instead of a temp dir")
    ap.add_argument("--only", default=None, help="comma-separated layout names (default: all)")
    args = ap.parse_args()

    from launcher.run.rundir import RunDir
    from recipes.gpt.plan import calibrate

    chosen = [x for x in LAYOUTS if not args.only or x[0] in args.only.split(",")]
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        if args.reuse:
            root = args.reuse.resolve()
        else:
            root = (args.keep.resolve() if args.keep else Path(tmp)) / "runs"
            root.mkdir(parents=True, exist_ok=True)
            print(f"{args.rounds} x {len(chosen)} runs of {args.steps} steps under {root}:", file=sys.stderr)
            for _ in range(args.rounds):
                for n, o, p in chosen:
                    launch(n, o, p, args.steps, root)
        dirs = {n: runs_of(root, n) for n, _, _ in chosen}
        missing = [n for n, d in dirs.items() if not d]
        if missing:
            raise SystemExit(f"no run of {', '.join(missing)} under {root}")
        names = list(dirs)
        samples = [min((calibrate.read_sample(d) for d in dirs[n]), key=lambda s: s.measured_step_s) for n in names]
        runs_per = {len(d) for d in dirs.values()}
    calibrate.check_one_cluster(samples)
    fit_all = calibrate.fit(samples)
    halves = [names[0::2], names[1::2]]
    held = {}
    for i, half in enumerate(halves):
        train = [s for n, s in zip(names, samples) if n in halves[1 - i]]
        cal = calibrate.fit(train).calibration
        for n in half:
            held[n] = cal
    md = table(names, samples, fit_all, held)
    md += (f"Held out: layouts {', '.join(halves[0])} predicted with the calibration fitted on "
           f"{', '.join(halves[1])} only, and the other way round.\n")
    for note in fit_all.notes:
        md += f"Note: {note}\n"
    steps = sorted({s.steps_measured + calibrate.WARMUP_STEPS for s in samples})
    commits = sorted({str((RunDir(s.run_dir).git() or {}).get("commit") or "?")[:7]
                      + ("+dirty" if (RunDir(s.run_dir).git() or {}).get("dirty") else "") for s in samples})
    md += (f"\nCode: {', '.join(commits)}. Machine: {machine()}; {'/'.join(map(str, steps))} steps per run, "
           f"the least disturbed of "
           f"{'/'.join(map(str, sorted(runs_per)))} run(s) per layout; whole benchmark {time.time() - t0:.0f} s. "
           f"Reproduce: `.venv/bin/python benchmarks/calibration.py`.\n")
    print(md)
    if args.out:
        args.out.write_text(md)


if __name__ == "__main__":
    main()
