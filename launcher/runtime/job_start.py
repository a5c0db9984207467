"""The first instructions of every job process: the stop signals held from the interpreter's start.

submitit's job entry (``python -u -m submitit.core._submit FOLDER``) installs its signal handlers only
once it has found and unpickled the job, which imports the app, Hydra and the product; the handlers
that act on a stop (``restarts.StopFlag``, the Hydra plugin's ``StopSignals``, the pack runner) come
later still. A USR2 (the time-limit warning, ``cluster.signal_delay_s`` before the limit) or a TERM
(preemption) that arrives before them meets the default action: the process dies with no checkpoint,
no requeue and no word, which on a loaded node or with a short limit is the start of the job.

So the backends give submitit ``python_command()`` as its ``python``: ``python -u -c BOOTSTRAP``, whose
code holds USR2 and TERM (their numbers, in the environment variable ``HELD_ENV``), then runs
submitit's entry unchanged. Whoever takes the signals over calls ``replay()`` once its handlers are in
place: each held signal is delivered again, to them. The bootstrap is inline code, not a module of the
package: a job started from a code snapshot made before this module existed still starts.
"""
from __future__ import annotations

import os
import shlex
import sys
from typing import List, Optional

HELD_ENV = "LAUNCHER_HELD_SIGNALS"

# submitit appends "-u -m submitit.core._submit FOLDER": that module run as ``python -m`` would. One
# line, since it is part of the srun line of the batch script that `launch submit.dry_run=true` prints.
BOOTSTRAP = (  # double quotes only: shlex.quote leaves it as it reads
    'import os,runpy,signal,sys;'
    '[signal.signal(s,lambda n,f:os.environ.__setitem__('
    f'"{HELD_ENV}",os.environ.get("{HELD_ENV}","")+"%d,"%n)) for s in (signal.SIGUSR2,signal.SIGTERM)];'
    'sys.argv=sys.argv[sys.argv.index("-m")+1:];'
    'runpy.run_module(sys.argv[0],run_name="__main__",alter_sys=True)'
)


# Before the interpreter runs the bootstrap's first instruction (tens of ms, more on a loaded node) a
# stop signal still meets its default action: Slurm sends ``--signal`` up to 60 s before the time it
# was asked for, so a short job can be signalled as its step starts (measured: a 1-minute Hydra job's
# USR2 killed its task 0.1 s into the step). The shell ignores both before it execs the interpreter
# (an ignored signal stays ignored across exec), and the bootstrap replaces that with its holders:
# what comes in the shell's first instructions is lost rather than fatal, and the window is a
# shell's start, not an interpreter's.
IGNORE_THEN_EXEC = 'trap "" USR2 TERM; exec "$0" "$@"'


def python_command(executable: Optional[str] = None) -> str:
    """submitit's ``python`` option (a shell word list: Slurm's batch script and the local controller's
    shlex both read it)."""
    python = shlex.quote(executable or sys.executable)
    return f"/bin/sh -c {shlex.quote(IGNORE_THEN_EXEC)} {python} -u -c {shlex.quote(BOOTSTRAP)}"


def held() -> List[int]:
    """The signals held so far (in order of arrival, each once), taken: a second call sees only later ones."""
    raw = os.environ.pop(HELD_ENV, "")
    return list(dict.fromkeys(int(s) for s in raw.split(",") if s.strip().isdigit()))


def replay() -> List[int]:
    """Each signal held since the start delivered again to this process, now that its handlers are in
    place (a Python handler runs as ``os.kill`` returns). Returns them."""
    sigs = held()
    for signum in sigs:
        os.kill(os.getpid(), signum)
    return sigs
