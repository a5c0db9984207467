"""`python -m launcher.runtime.seal RUN_DIR...`: seal runs whose job ended with the seal due.

What the backend's job after the run's job runs (Slurm: a one-node, one-task job with
``--dependency=afterany``, SlurmBackend.seal_after_job), so that hashing the run dir holds one CPU
after the allocation is released rather than every node of it. A run already sealed, not final, or
reopened by ``launcher resume`` since is left as it is (docs/archive.md, "The seal").
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import List, Optional

from launcher.run.rundir import RunDir


def seal_if_due(rd: RunDir) -> bool:
    """Seal ``rd`` if its seal is due (a final run its job left unsealed); True if this sealed it."""
    with rd.seal_lock():  # cluster.elastic's deciding job may be reopening it (launcher.features.elastic.regrow)
        if not rd.seal_due():
            return False
        return bool(rd.seal())


def main(argv: Optional[List[str]] = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    for path in args:
        rd = RunDir(Path(path))
        done = seal_if_due(rd)
        print(f"launcher: {rd.path}: {'sealed' if done else 'nothing due'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
