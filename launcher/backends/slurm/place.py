"""``python -m launcher.backends.slurm.place RUN_DIR JOB_ID NODE[,NODE...]``: a requeued job started again
without the nodes the node ledger leaves out (launcher.features.nodes).

Slurm takes a job's ``ExcNodeList`` only while the job is pending. A rank whose node failed cannot
set it on its own job (running) and does not outlive the requeue (Slurm ends every process of the job),
so before it asks for the requeue it queues this one-task job and holds its own (``requeuehold``):
this job waits until the held job is pending, sets ``ExcNodeList``, and releases it. It releases the
job whatever happens (a refused update, a deadline): a job is never left held by it. No torch.
"""
from __future__ import annotations

import subprocess
import sys
import time
from typing import Callable, List, Optional

from launcher.backends.slurm import BACKEND
from launcher.backends.slurm.text import state_of

WAIT_S = 600.0  # the longest wait for the held job to be pending (its processes ending: KillWait, the epilog)
POLL_S = 1.0


def _scontrol(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["scontrol", *args], capture_output=True, text=True, timeout=60)


def _ended(state: str) -> bool:
    known = state_of(state)
    return known is not None and known.ended


def place(job_id: str, nodes: List[str], state: Callable[[str], str] = BACKEND.job_state_now, wait_s: float = WAIT_S,
          poll_s: float = POLL_S, out=None) -> Optional[str]:
    """Wait for the held job to be pending, leave ``nodes`` out, release it; what was done (None: the
    job ended meanwhile, nothing to place). ``state``: the controller's JobState ("": gone)."""
    out = out or sys.stdout
    deadline = time.monotonic() + wait_s
    now = state(job_id)
    while now != "PENDING" and time.monotonic() < deadline:
        if not now or _ended(now):
            print(f"place: job {job_id} is {now or 'gone'}: nothing to place", file=out, flush=True)
            return None
        time.sleep(poll_s)
        now = state(job_id)
    done = "not pending in time: released as it is"
    if now == "PENDING":
        res = _scontrol("update", f"JobId={job_id}", f"ExcNodeList={','.join(nodes)}")
        done = f"ExcNodeList={','.join(nodes)}" if res.returncode == 0 else \
            f"ExcNodeList refused ({(res.stderr or res.stdout).strip()}): released as it is"
    rel = _scontrol("release", str(job_id))
    print(f"place: job {job_id}: {done}; release: {'done' if rel.returncode == 0 else rel.stderr.strip()}",
          file=out, flush=True)
    return done


def main(argv: Optional[List[str]] = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 3:
        print("usage: python -m launcher.backends.slurm.place RUN_DIR JOB_ID NODE[,NODE...]", file=sys.stderr)
        return 2
    place(args[1], [n for n in args[2].split(",") if n])
    return 0


if __name__ == "__main__":
    sys.exit(main())
