"""cluster.elastic inside a shrunk run's job: rank 0 looks for the missing nodes before each checkpoint
(the rule: launcher.features.elastic.resize; the deciding job: launcher.features.elastic.decide;
docs/fault-tolerance.md).
When every missing node is idle, it queues the deciding job after this one (``afterany``) and the ranks
stop together at the checkpoint; that job grows the run back. No torch here.
"""
from __future__ import annotations

import sys
from functools import lru_cache
from pathlib import Path
from typing import Any, Dict

from launcher import backends
from launcher.features.elastic import resize as elastic
from launcher.run.rundir import RunDir, SweepDir


@lru_cache(maxsize=8)
def _settings(run_dir: str) -> Dict[str, Any]:
    """What a running job reads of its config for the grow check (once per process; a run dir with no
    archived config, as a recipe's own tests make: not a cluster.elastic run)."""
    try:
        plain = RunDir(Path(run_dir)).config()
    except FileNotFoundError:
        plain = {}
    cluster = plain.get("cluster") or {}
    return {**elastic.settings(plain), "target": elastic.target(plain), "nodes": int(cluster.get("nodes") or 1),
            "partition": cluster.get("partition"), "backend": str(cluster.get("backend") or "local")}


def offer_grow(rd: RunDir) -> bool:
    """Rank 0 of a shrunk run, before a checkpoint: True when enough nodes are idle to grow back and the
    job that grows the run after this one is queued (the caller then votes to stop at the checkpoint).
    Any other run returns at once (its config read once per process)."""
    s = _settings(str(rd.path))
    if not (s["enabled"] and s["grow"]) or s["target"] <= s["nodes"]:
        return False
    job_id = rd.status().job_id
    if not job_id:
        return False
    backend = backends.get(s["backend"])
    try:
        idle = backend.usable_nodes(str(s["partition"]) if s["partition"] else None)
        if not elastic.grow_due(s["nodes"], s["target"], len(idle), s["grow"]):
            return False
        backend.elastic_after_job(rd.path, str(job_id), SweepDir(rd.path.parent).submitit_folder, "afterany")
    except Exception as e:  # the run trains on where it is: the next checkpoint looks again
        print(f"launcher elastic: the grow was not arranged ({type(e).__name__}: {e})", file=sys.stderr, flush=True)
        return False
    print(f"launcher elastic: {len(idle)} idle node(s) ({', '.join(idle)}): this job ends at the next checkpoint "
          f"and the run grows back toward {s['target']} node(s)", flush=True)
    return True
