"""The requeue contract for any Hydra app (hydra_plugins.launcher_plugin.requeue): a point signalled
while its task runs (USR2 mid-run, scontrol requeue twice) starts again in the same run dir and
output dir, from its pristine config, its restarts recorded, and comes back with its return value;
an app's own checkpoint (a file in its output dir, or submitit's checkpoint hook) resumes it."""
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import List

import pytest
from test_fault_tolerance import wait_for

from helpers import runs_json, wait_final
from launcher.run.rundir import RunDir

pytestmark = [pytest.mark.timeout(420)]


def quadratic(x: float, y: float) -> float:
    return (x - 1.0) ** 2 + (y + 2.0) ** 2


# counts to cfg.steps, one step per cfg.step_s. mode=file: the count so far in count.json of its
# output dir, read back when it starts again; mode=hook: a submitit Checkpointable (its own state
# travels through submitit's checkpoint hook; the class lives in a package module, as Hydra needs
# for a callable object as the task function: it finds the app's name and configs from its module).
# A count in cfg.hold_at, once reached, holds the task there until a signal stops it (the plugin
# raises in the task): the drill's signal finds it running however fast the machine counts; a start
# that resumes at that count goes past it.
COUNTER = '''
import json, os, time
from pathlib import Path

import submitit
from hydra.core.hydra_config import HydraConfig


def write(path, obj):  # whole or not at all: a signal may stop the task anywhere
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


def progress(cfg, done, start):
    write(Path(HydraConfig.get().runtime.output_dir) / "progress.json", {"done": done})
    if done in cfg.get("hold_at", ()):
        while True:
            time.sleep(0.1)


def count_in_file(cfg):
    f = Path(HydraConfig.get().runtime.output_dir) / "count.json"
    done = json.loads(f.read_text())["done"] if f.exists() else 0
    start = done
    while done < cfg.steps:
        time.sleep(cfg.step_s)
        done += 1
        write(f, {"done": done})
        progress(cfg, done, start)
    return {"done": done, "resumed_from": start, "x": cfg.x}


class Counter(submitit.helpers.Checkpointable):
    def __init__(self):
        self.done, self.starts = 0, 0

    def __call__(self, cfg):
        self.starts += 1
        start = self.done
        while self.done < cfg.steps:
            time.sleep(cfg.step_s)
            self.done += 1
            progress(cfg, self.done, start)
        return {"done": self.done, "resumed_from": start, "starts": self.starts, "x": cfg.x}
'''

APP = '''
import hydra
from ckapp.counter import Counter, count_in_file

task = {"hook": Counter(), "file": count_in_file}["MODE"]
main = hydra.main(version_base="1.3", config_path=None, config_name=None)(task)

if __name__ == "__main__":
    main()
'''


def write_app(tmp_path: Path, mode: str) -> Path:
    """The app, package ckapp, in a directory of its own (the code snapshot is that directory)."""
    d = tmp_path / "app"
    (d / "ckapp").mkdir(parents=True)
    (d / "ckapp" / "__init__.py").write_text("")
    (d / "ckapp" / "counter.py").write_text(textwrap.dedent(COUNTER))
    (d / "ckapp" / "main.py").write_text(textwrap.dedent(APP).replace("MODE", mode))
    return d


def start(args: List[str], runs_root: Path, cwd: Path, env=None) -> subprocess.Popen:
    full = dict(os.environ, LAUNCHER_RUNS=str(runs_root), PYTHONUNBUFFERED="1", **(env or {}))
    return subprocess.Popen([sys.executable, *args], cwd=str(cwd), env=full, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def progressed(sweep: Path, points: int, at_least: int) -> bool:
    files = [sweep / str(i) / "progress.json" for i in range(points)]
    return all(f.exists() and json.loads(f.read_text() or "{}").get("done", 0) >= at_least for f in files)


def running_jobs(name: str) -> List[str]:
    out = subprocess.run(["squeue", "-h", "-n", name, "-t", "R", "-o", "%i"], capture_output=True, text=True,
                         timeout=30).stdout
    return out.split()


def finish(proc: subprocess.Popen, timeout: float = 300):
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    return out, err


def check_restarted(run: dict, sweep: Path, index: int, restarts: int, reason: str) -> RunDir:
    """Completed in its one run dir after ``restarts`` restarts, each recorded; Hydra's output dir the
    same for every attempt."""
    rd = RunDir(run["dir"])
    st = rd.status()
    assert st.state.value == "completed" and st.attempt == restarts + 1, st
    rows = rd.restarts()
    assert [r["attempt"] for r in rows] == list(range(2, restarts + 2)) and {r["reason"] for r in rows} == {reason}
    assert Path(st.output_dir) == (sweep / str(index)).resolve()
    assert rd.is_sealed() and rd.verify() == []
    return rd


# ---- the example app on Slurm ---------------------------------------------------------------------


@pytest.mark.slurm
def test_usr2_mid_run_requeues_both_points(slurm, runs_root, tmp_path):
    """`scancel --signal=USR2` to a 2-point sweep of the example app mid-run (a preemption notice:
    the time limit is far): both points requeued, both complete with their values, one restart each."""
    sweep = tmp_path / "sweep"
    proc = start(["-m", "recipes.hydra_example.app", "-m", "x=1,2", "sleep_s=12", "hydra/launcher=launcher_slurm",
                  "hydra.launcher.partition=debug", "hydra.launcher.timeout_min=10", "hydra.job.name=hyreq",
                  f"hydra.sweep.dir={sweep}"], runs_root, tmp_path, slurm)
    jobs = wait_for("both points running", lambda: len(running_jobs("hyreq")) == 2 and running_jobs("hyreq"), 180)
    wait_for("both points started", lambda: all((sweep / str(i) / ".hydra" / "config.yaml").exists()
                                                for i in range(2)), 180)
    for j in jobs:
        subprocess.run(["scancel", "--signal=USR2", j], check=True, timeout=30)
    out, _ = finish(proc)
    runs = wait_final(runs_root, 2, timeout=180)  # the app returns at its jobs' results; their seals come after
    assert [r["return_value"] for r in runs] == [quadratic(1, 0), quadratic(2, 0)], runs
    for i, r in enumerate(runs):
        rd = check_restarted(r, sweep, i, 1, "preempted")
        assert "SIGUSR2" in rd.restarts()[0]["detail"]
        assert float((sweep / str(i) / "value.txt").read_text()) == quadratic(i + 1, 0)
    log = "".join(p.read_text() for p in (sweep / ".submitit").glob("*_log.err"))
    assert "ReadonlyConfigError" not in log and "Traceback" not in log, log[-3000:]


@pytest.mark.slurm
def test_preempted_twice_with_its_checkpoint_file(slurm, runs_root, tmp_path):
    """`scontrol requeue` twice while an app that keeps its count in a file of its output dir runs: it
    resumes from that file each time, in the same output dir, and returns the full count."""
    app = write_app(tmp_path, "file")
    sweep = tmp_path / "sweep"
    proc = start(["-m", "ckapp.main", "-m", "+x=7", "+steps=12", "+step_s=0.1", "+hold_at=[4,7]",
                  "hydra/launcher=launcher_slurm",
                  "hydra.launcher.partition=debug", "hydra.launcher.timeout_min=10", "hydra.job.name=hyreq2",
                  f"hydra.sweep.dir={sweep}"], runs_root, app, slurm)
    for k in (1, 2):
        wait_for(f"the count held at {3 * k + 1}", lambda k=k: progressed(sweep, 1, 3 * k + 1)
                 and running_jobs("hyreq2"), 180)
        subprocess.run(["scontrol", "requeue", running_jobs("hyreq2")[0]], check=True, timeout=30)
        wait_for("the job's end", lambda: not running_jobs("hyreq2"), 60, poll=0.2)  # the requeue ended the job
    finish(proc)
    (run,) = wait_final(runs_root, 1, timeout=180)  # sealed: the job's end seals it after the app returns
    rd = check_restarted(run, sweep, 0, 2, "preempted")
    value = rd.status().summary["return_value"]
    assert value["done"] == 12 and value["x"] == 7 and value["resumed_from"] >= 7, value
    assert json.loads((sweep / "0" / "count.json").read_text())["done"] == 12


# ---- submitit's checkpoint hook, on local processes -----------------------------------------------


def test_checkpoint_hook_carries_the_tasks_state(runs_root, tmp_path):
    """A task function that is a submitit Checkpointable: on USR2 its checkpoint() is called, and the
    next attempt runs the callable it returned, with its state (the count so far and its starts)."""
    app = write_app(tmp_path, "hook")
    sweep = tmp_path / "sweep"
    proc = start(["-m", "ckapp.main", "-m", "+x=5", "+steps=10", "+step_s=0.1", "+hold_at=[3]",
                  "hydra/launcher=launcher_local",
                  "hydra.launcher.timeout_min=10", f"hydra.sweep.dir={sweep}"], runs_root, app)
    wait_for("the count held at 3", lambda: progressed(sweep, 1, 3), 180)
    pids = subprocess.run(["pgrep", "-f", f"submitit.core._submit {sweep}"], capture_output=True, text=True).stdout
    assert pids.split(), "no task process"
    for pid in pids.split():
        os.kill(int(pid), signal.SIGUSR2)
    finish(proc)
    (run,) = wait_final(runs_root, 1, timeout=180)  # sealed: the job's end seals it after the app returns
    rd = check_restarted(run, sweep, 0, 1, "preempted")
    value = rd.status().summary["return_value"]
    assert value["done"] == 10 and value["starts"] == 2 and value["resumed_from"] >= 3, value


def test_time_limit_requeued_max_num_timeout_times_then_timeout(runs_root, tmp_path):
    """A point that outlives its time limit (1 min; the signal 50 s before it, so each attempt is
    signalled 10 s in, whether or not its task has started yet: held until it has): requeued once
    (max_num_timeout=1), then the run ends `timeout` and its JobReturn says why, naming the point and
    the key. (A signal_delay_s that does not fit the limit is cut: tests/unit/test_hydra_launcher.py.)"""
    sweep = tmp_path / "sweep"
    proc = start(["-m", "recipes.hydra_example.app", "-m", "x=4", "sleep_s=100", "hydra/launcher=launcher_local",
                  "hydra.launcher.timeout_min=1", "hydra.launcher.signal_delay_s=50",
                  "hydra.launcher.max_num_timeout=1", f"hydra.sweep.dir={sweep}"], runs_root, tmp_path)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 1, out[-3000:] + err[-3000:]
    assert "Error executing job with overrides: ['x=4', 'sleep_s=100']" in err, err[-3000:]
    assert "not requeued, 1 time-out(s) requeued already (hydra.launcher.max_num_timeout=1)" in err, err[-3000:]
    (run,) = runs_json(runs_root)
    rd = RunDir(run["dir"])
    st = rd.status()
    assert st.state.value == "timeout" and st.attempt == 2 and "max_num_timeout=1" in st.error, st
    assert [r["reason"] for r in rd.restarts()] == ["time_limit"]
