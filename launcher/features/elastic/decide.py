"""cluster.elastic's deciding job: ``python -m launcher.features.elastic.decide RUN JOB_ID`` (the rule:
launcher.features.elastic.resize; docs/fault-tolerance.md "Keep going when a node is lost").

The run queues it for itself, a one-node, one-task job: after each of its jobs (``--dependency=afternotok``:
it runs only where the job did not end well; Slurm cancels it otherwise), and after a shrunk job that
ends at a checkpoint to grow (``afterany``, launcher.features.elastic.regrow). It reads the run's status and the
scheduler's word for the job, and

- a job the cluster ended (a lost node, a preemption that cancels) with no requeue coming: the run's
  outcome is recorded if its ranks could not, and it goes on from its latest checkpoint on the most
  nodes it can have now (idle, and this job's own) that a layout of the same global batch fits;
- a shrunk job that ended to grow: the same, up to cluster.elastic.target_nodes;
- a job that ended asking for a restart (a time limit, a failure worth a restart, a hang: under
  cluster.elastic the batch script is --no-requeue, and a rank's request only records why): the same,
  at the full node count where the nodes are there, on fewer where not;
- anything else (completed, cancelled, the run's own failure): nothing.

The new attempt goes through ``launcher resume``'s path (checked by the rules, the recipe's planner and
the reshard check; recorded in restarts.jsonl with the old and new layout; one submission, which queues
its own deciding job). Nothing runs on the login node.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any, List, Optional

from launcher import backends
from launcher.backends.slurm import submit_environment
from launcher.config.errors import ConfigErrors
from launcher.features.elastic import resize as elastic
from launcher.run.rundir import RunDir
from launcher.run.status import Status
from launcher.submit import resume

COMPLETING_WAIT_S = 300.0  # the longest wait for the ended job's processes (Slurm's KillWait and teardown)


def decide(rd: RunDir, job_id: str, backend: Any, own_node: Optional[str] = None, out=None) -> Optional[str]:
    """Carry out cluster.elastic's decision for run ``rd`` after job ``job_id``; returns the new job's
    id (None: nothing to do, or no layout fits the nodes there are: the run keeps its outcome)."""
    out = out or sys.stdout
    # the dependency holds once the job has ended, while its processes on the nodes left may still be
    # dying (COMPLETING) and writing the run's records: decided once they are gone
    deadline = time.time() + COMPLETING_WAIT_S
    while backend.job_state_now(job_id).startswith("COMPLETING") and time.time() < deadline:
        time.sleep(1.0)
    st = rd.status()
    word = backend.ended_state(job_id)
    what = elastic.decision(st.state.value, st.stop, word)
    if what is None:
        print(f"launcher elastic: run {rd.path.name} is {st.state.value} after job {job_id} ({word or '?'}): "
              "nothing to do", file=out, flush=True)
        return None
    if what == elastic.SHRINK and not st.is_final:  # its ranks died with the node: the outcome they could not record
        rd.finish(Status.failed, exit_code=None, error=f"job {job_id} ended by the cluster ({word})")
    elif rd.seal_due():
        rd.seal()
    plain = rd.config()
    el = elastic.settings(plain)
    tgt = elastic.target(plain)
    now_nodes = int((plain.get("cluster") or {}).get("nodes") or 1)
    part = (plain.get("cluster") or {}).get("partition")
    nodes = backend.usable_nodes(str(part) if part else None, own_node)
    counts = elastic.node_counts(tgt, len(nodes), el["min_nodes"])
    why = {elastic.SHRINK: f"job {job_id} ended by the cluster ({word})",
           elastic.GROW: f"nodes back: growing toward {tgt} node(s)"}.get(
        what, f"job {job_id} ended for a restart ({(st.stop or {}).get('reason')}: {(st.stop or {}).get('detail')})")
    if not counts:
        msg = (f"{why}; {len(nodes)} usable node(s) now, fewer than cluster.elastic.min_nodes={el['min_nodes']}: "
               "the run ends here (`launcher resume RUN` when nodes are back)")
        print(f"launcher elastic: run {rd.path.name}: {msg}", file=out, flush=True)
        if not rd.is_final():
            rd.finish(Status.failed, exit_code=None, error=msg)
        return None
    try:
        n, nxt = elastic.pick(counts, lambda k: resume.prepare(rd.path, changes=elastic.changes(plain, k),
                                                               elastic=True))
    except ConfigErrors as e:
        msg = f"{why}; no layout fits {counts[0]} to {counts[-1]} node(s): {e}"
        print(f"launcher elastic: run {rd.path.name}: {msg}", file=out, flush=True)
        if not rd.is_final():
            rd.finish(Status.failed, exit_code=None, error=msg)
        return None
    before = (rd.run() or {}).get("layout") or {}
    after = nxt.layout["to"] if nxt.layout else before
    line = elastic.summary_line(before, after, why)
    print(f"launcher elastic: run {rd.path.name}: {line}", file=out, flush=True)
    reason = elastic.restart_reason(what, now_nodes, n, st.stop)
    result = resume.resubmit([rd.path], reason=reason, detail=line, out=out, prepared=[nxt])
    return result.runs[0].job_id if result.runs else None


def main(argv: Optional[List[str]] = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m launcher.features.elastic.decide RUN_DIR JOB_ID", file=sys.stderr)
        return 2
    own = os.environ.get("SLURMD_NODENAME")
    # sbatch from inside this job: none of its own SLURM_/SBATCH_ settings may reach the new job
    for k in set(os.environ) - set(submit_environment(os.environ)):
        del os.environ[k]
    rd = RunDir(Path(args[0]))
    backend = backends.get(str(((rd.config().get("cluster") or {}).get("backend")) or "slurm"))
    with rd.seal_lock():
        decide(rd, args[1], backend, own_node=own)
    return 0


if __name__ == "__main__":
    sys.exit(main())
