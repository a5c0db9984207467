"""A stop signal that reaches a job process before its handlers exist (launcher.runtime.job_start).

submitit's real job entry waits for its pickle, then unpickles the job, and only then installs any
signal handler: a USR2 in that window (the time-limit warning of a short or loaded job) ended the
process at Python's default action. Here the window is made wide the way it is in a job array (the
pickle written after the process started): the bare entry dies of the signal; started the way the
backends start it, the process lives, and the job's own StopFlag receives the held signal.
"""
from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Tuple

import pytest
import submitit

from launcher.runtime import job_start

JOB_ID = "4242"


def _stop_reason() -> str:
    """The job: installs the run's stop flag (which replays what was held) and returns what it saw."""
    from launcher.runtime import restarts

    flag = restarts.StopFlag().install()
    return str(flag.reason)


def _start(python: str, folder: Path, log: Path) -> subprocess.Popen:
    env = dict(os.environ, SUBMITIT_EXECUTOR="local", SUBMITIT_LOCAL_JOB_ID=JOB_ID, SUBMITIT_LOCAL_NTASKS="1",
               SUBMITIT_LOCAL_JOB_NUM_NODES="1", SUBMITIT_LOCAL_NODEID="0", SUBMITIT_LOCAL_GLOBALID="0",
               SUBMITIT_LOCAL_LOCALID="0", PYTHONPATH=os.pathsep.join(sys.path))
    words = shlex.split(python) + ["-u", "-m", "submitit.core._submit", str(folder)]
    with open(log, "w") as out:  # a file, read while it runs (a pipe would need a reader of its own)
        return subprocess.Popen(words, env=env, cwd=str(Path(__file__).parent), stdout=out,
                                stderr=subprocess.STDOUT, text=True)


def _signal_while_it_waits_for_its_pickle(python: str, folder: Path) -> Tuple[subprocess.Popen, str]:
    """The process's exit and its output, USR2 sent once it says it waits for its pickle."""
    folder.mkdir()
    log = folder.parent / f"{folder.name}.log"
    proc = _start(python, folder, log)
    # submitit logs this line, then polls for the pickle once a second (the bootstrap, if any, ran before it)
    deadline = time.time() + 120
    while "Loading pickle:" not in log.read_text():
        assert proc.poll() is None, log.read_text()
        assert time.time() < deadline, f"submitit's entry never said it waits for its pickle: {log.read_text()}"
        time.sleep(0.05)
    proc.send_signal(signal.SIGUSR2)
    submitit.helpers.DelayedSubmission(_stop_reason).dump(folder / f"{JOB_ID}_submitted.pkl")
    proc.wait(timeout=60)
    return proc, log.read_text()


@pytest.mark.timeout(120)
def test_a_usr2_before_any_handler_is_held_for_the_job(tmp_path):
    bare, out = _signal_while_it_waits_for_its_pickle(shlex.quote(sys.executable), tmp_path / "bare")
    assert bare.returncode == -signal.SIGUSR2, out  # what happened before

    held, out = _signal_while_it_waits_for_its_pickle(job_start.python_command(), tmp_path / "held")
    assert held.returncode == 0, out
    result = submitit.core.utils.pickle_load(tmp_path / "held" / f"{JOB_ID}_0_result.pkl")
    assert result == ("success", "time_limit"), (result, out)


@pytest.mark.timeout(60)
def test_the_stop_signals_cannot_kill_the_interpreter_before_its_first_instruction():
    """Slurm may send --signal up to 60 s early, so at a short job's step start: started the way the
    backends start it, the interpreter is already deaf to USR2 and TERM when it runs its first line
    (the bootstrap then holds them instead)."""
    words = shlex.split(job_start.python_command())
    at = words.index("-c", words.index("-u"))  # the interpreter's own -c: the bootstrap replaced by a probe
    probe = [*words[:at], "-c", "print(open('/proc/self/status').read())"]
    out = subprocess.run(probe, capture_output=True, text=True, timeout=30, check=True).stdout
    ignored = int(next(line.split()[1] for line in out.splitlines() if line.startswith("SigIgn:")), 16)
    assert ignored >> (signal.SIGUSR2 - 1) & 1 and ignored >> (signal.SIGTERM - 1) & 1, out
