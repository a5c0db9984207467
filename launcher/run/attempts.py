"""RunDir's attempts, restarts, reshards, hangs and stacks, and the paths of what a running attempt writes."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from launcher.archive import atomic
from launcher.run.io import (
    fill_name,
    names_in,
    now_iso,
    read_object_lines,
)
from launcher.run.sealing import walk
from launcher.run.status import RunStatus, Status

# restart reasons a user asked for (launcher resume / retry): the restart budget starts again there
RESTARTED_BY_USER = ("resume", "retry")
# restarts a sweep's scheduler asks for (sweep=asha: a paused point promoted at a rung) and cluster.elastic's
# (launcher.features.elastic.resize.SHRINK, GROW: a node lost, nodes back): no failure of the run's, so
# train.max_restarts does not count them
RESTARTED_BY_SCHEDULE = ("promoted", "shrink", "grow")


class Attempts:
    """A run's attempts and what they left (a mixin of RunDir)."""

    # ---- attempts, restarts, hangs ---------------------------------------------------------------
    def restarts(self) -> List[Dict[str, Any]]:
        p = self._p(self.RESTARTS)
        if not p.exists():
            return []
        return read_object_lines(p)

    def reshards(self) -> List[Dict[str, Any]]:
        p = self._p(self.RESHARDS)
        return read_object_lines(p) if p.exists() else []

    def record_reshard(self, row: Dict[str, Any]) -> None:
        with open(self._p(self.RESHARDS), "a") as f:
            f.write(json.dumps({"time": now_iso(), **row}) + "\n")

    def set_layout(self, layout: Dict[str, Any]) -> None:
        """run.json's layout, for a new attempt on another layout (what the job runs with)."""
        meta = self.run() or {}
        atomic.write_json(self._p(self.RUN), {**meta, "layout": layout})

    def record_restart(self, row: Dict[str, Any]) -> None:
        with open(self._p(self.RESTARTS), "a") as f:
            f.write(json.dumps({"time": now_iso(), **row}) + "\n")

    def restarts_since_launch(self) -> int:
        """Automatic restarts since the run was launched, resumed or retried (what train.max_restarts bounds)."""
        n = 0
        for row in self.restarts():
            if row.get("reason") in RESTARTED_BY_SCHEDULE:
                continue
            n = 0 if row.get("reason") in RESTARTED_BY_USER else n + 1
        return n

    def stack_path(self, rank: int) -> Path:
        return self._p(fill_name(self.STACK, r=rank))

    def stacks(self) -> Dict[int, str]:
        return {int(p.stem.split("_")[-1]): p.read_text(errors="replace") for p in self._glob(self.STACK, r="*")}

    def stack_count(self) -> int:
        """How many ranks dumped their stacks (one listing, no file read)."""
        prefix, _, suffix = self.STACK.rsplit("/", 1)[-1].partition("<r>")
        return sum(1 for n in names_in(self.stack_path(0).parent) if n.startswith(prefix) and n.endswith(suffix))

    def claim_gathering(self, rank: int) -> bool:
        """Whether ``rank`` is the one that gathers the hang's stacks (the first to ask: one exclusive
        create); the others only dump theirs."""
        path = self._p(self.STACK_GATHERER)
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            f.write(f"{rank}\n")
        return True

    def write_hang(self, finding: Dict[str, Any]) -> None:
        atomic.write_json(self._p(self.HANG), finding)

    def hang(self) -> Optional[Dict[str, Any]]:
        return atomic.read_json(self._p(self.HANG))

    def attempt_dir(self, attempt: int) -> Path:
        return self._p(fill_name(self.ATTEMPT, a=attempt))

    def move_aside(self, attempt: int, world: Optional[int] = None, hosts: Optional[Sequence[str]] = None) -> None:
        """What attempt ``attempt`` left that would mislead the next one (errors/: its rank errors and
        cancel mark, which the watchdog reads as a peer's failure; its stacks, the gatherer's claim and
        the hang finding; each rank's mesh and state record, written again by the recipe after this)
        goes to attempts/<a>/. Given the next attempt's ``world`` and ``hosts``: also the records of
        ranks and nodes it does not have (a smaller world, a node gone; rank 0 runs this while the
        other ranks may be recording themselves, so a rank and a node it does have keep its record, the
        new one or soon replaced by it). One listing of ranks/, topology/ and errors/, by one rank."""
        dest = self.attempt_dir(attempt)
        errors = self._p(self.RANK_ERROR).parent
        leftovers = ([errors / n for n in names_in(errors)] + self._glob(self.OLD_RANK_ERROR, r="*")
                     + self._glob(self.STACK, r="*")
                     + [p for p in (self._p(self.HANG), self._p(self.STACK_GATHERER)) if p.exists()])
        ranks = self._p(self.RANK).parent
        for n in names_in(ranks):
            kind, _, r = n[:-len(".json")].rpartition("_") if n.endswith(".json") else ("", "", "")
            if kind in ("mesh", "state") or (kind == "rank" and world is not None and r.isdigit() and int(r) >= world):
                leftovers.append(ranks / n)
        if hosts is not None:
            topo = self._p(self.TOPOLOGY).parent
            for n in names_in(topo):
                name, _, i = n[len("node_"):-len(".json")].rpartition("_")
                if n.startswith("node_") and n.endswith(".json") and (
                        name not in hosts or not i.isdigit() or int(i) >= len(hosts)):
                    leftovers.append(topo / n)
        for p in leftovers:
            target = dest / p.relative_to(self.path)
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(p, target)

    def reopen(self, attempt: int) -> None:
        """Make a finished run writable again for a new attempt (``launcher resume``): its manifest
        moves to attempts/<a>/ (the seal of that attempt, kept, never rewritten) and its files become
        writable. The caller has verified the seal first."""
        m = self._p(self.MANIFEST)
        for _, kind, entry in walk(self.path):
            if kind != "file":  # a symlink's target is not the run's: never made writable
                continue
            p = Path(entry.path)
            if p.stat().st_nlink > 1:  # shared with the sweep's other runs (link_from): made its own
                tmp = p.with_name(f".{p.name}.own")
                shutil.copyfile(p, tmp)
                os.replace(tmp, p)
            os.chmod(p, p.stat().st_mode | 0o200)
        self._seal_mark().unlink(missing_ok=True)  # first: a crash before the move leaves a plain sealed run
        if m.exists():
            dest = self.attempt_dir(attempt) / self.MANIFEST
            dest.parent.mkdir(parents=True, exist_ok=True)
            os.replace(m, dest)
        prev = self.status()
        ended = {"status": prev.state.value, "error": prev.error, "exit_code": prev.exit_code,
                 "failed_rank": prev.failed_rank, "ended": prev.ended}
        self._write_status(RunStatus(state=Status.pending, updated=now_iso(), attempt=prev.attempt, hosts=prev.hosts,
                                     world_size=prev.world_size, job_id=prev.job_id,
                                     earlier=[*prev.earlier, ended]))

    @property
    def metrics_path(self) -> Path:
        return self._p(self.METRICS)

    def samples_path(self, rank: int) -> Path:
        """data.log_samples: the sample ids rank ``rank`` loaded, one line per step."""
        return self._p(fill_name(self.SAMPLES, r=rank))

    @property
    def work_dir(self) -> Path:
        """The job's working directory: what a recipe writes to a relative path lands in its own run."""
        return self._p(self.WORK)

    @property
    def wandb_dir(self) -> Path:
        """wandb.init(dir=...): wandb makes its own ``wandb/`` folder inside."""
        return self.path
