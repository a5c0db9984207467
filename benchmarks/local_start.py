"""cluster=local's start-up three ways (launcher.runtime.warm_start, launcher.runtime.warm_server): every
process a new interpreter (LAUNCHER_LOCAL_FORK=0), the processes forked from their job's controller
which imports torch first (LAUNCHER_WARM_SERVER=0), and the controller itself forked from the warm
server that has torch loaded (the default). The same local launches, alternated, timed end to end
(the `launch` command returns once the run ended), and the CPU the whole machine spent meanwhile
(/proc/stat: the processes forked by the server are not this benchmark's children).

  .venv/bin/python benchmarks/local_start.py [--procs 1 2 4] [--steps 5] [--rounds 3]

Prints, per process count, each mode's median wall time and CPU over the rounds, the ratios to new
interpreters, and each mode's final loss (equal in all: the same training, started another way). Run it
on a quiet machine: the machine's CPU counts every process on it.
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Tuple

REPO = Path(__file__).resolve().parent.parent
LAUNCH = REPO / ".venv" / "bin" / "launch"
MODES = {"new": {"LAUNCHER_LOCAL_FORK": "0"}, "controller": {"LAUNCHER_WARM_SERVER": "0"}, "server": {}}


def machine_cpu_s() -> float:
    """User + system CPU seconds of every process since boot."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    return (int(fields[0]) + int(fields[1]) + int(fields[2])) / os.sysconf("SC_CLK_TCK")


def one(procs: int, steps: int, mode: str, root: Path) -> Tuple[float, float, str]:
    env = dict(os.environ, **MODES[mode])
    t0, c0 = time.monotonic(), machine_cpu_s()
    res = subprocess.run([str(LAUNCH), f"train.steps={steps}", f"cluster.gpus_per_node={procs}",
                          f"submit.runs_root={root}"], env=env, capture_output=True, text=True, timeout=900)
    wall, cpu = time.monotonic() - t0, machine_cpu_s() - c0
    if res.returncode != 0:
        sys.exit(f"launch failed ({mode}, {procs} procs):\n{res.stdout[-2000:]}{res.stderr[-2000:]}")
    loss = re.search(r"loss \S+ -> (\S+)", res.stdout)
    return wall, cpu, loss.group(1) if loss else "?"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--procs", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    rows: List[str] = []
    with tempfile.TemporaryDirectory(prefix="local-start-") as tmp:
        os.chdir(tmp)  # a launch dir outside the repo: its code snapshot is the launcher's own
        one(1, 1, "server", Path(tmp) / "runs")  # the server started (and its imports paid) before timing
        for procs in args.procs:
            walls: Dict[str, List[float]] = {m: [] for m in MODES}
            cpus: Dict[str, List[float]] = {m: [] for m in MODES}
            losses: Dict[str, set] = {m: set() for m in MODES}
            for r in range(args.rounds):
                order = list(MODES) if r % 2 == 0 else list(reversed(MODES))  # alternated: drift hits all
                for mode in order:
                    wall, cpu, loss = one(procs, args.steps, mode, Path(tmp) / "runs")
                    walls[mode].append(wall)
                    cpus[mode].append(cpu)
                    losses[mode].add(loss)
            w = {m: statistics.median(v) for m, v in walls.items()}
            c = {m: statistics.median(v) for m, v in cpus.items()}
            rows.append(f"| {procs} | {args.steps} | " + " | ".join(f"{w[m]:.1f} / {c[m]:.1f}" for m in MODES)
                        + f" | {w['server'] / w['new']:.2f} / {c['server'] / c['new']:.2f} | "
                        + " | ".join(", ".join(sorted(losses[m])) for m in MODES) + " |")
    print(f"local launches, gpt_tiny, {args.rounds} round(s) each, median wall / machine CPU seconds\n")
    print("| processes | steps | new interpreters | forked from the controller | controller forked from the server "
          "| server / new | loss (new) | loss (controller) | loss (server) |")
    print("|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
