"""RunDir's status transitions: status.json written whole, a final status once, the seal due or done."""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Iterator

from launcher.archive import atomic
from launcher.run.io import (
    file_lock,
    now_iso,
)
from launcher.run.status import FINAL, RunStatus, Status


class Transitions:
    """A run's status transitions (a mixin of RunDir)."""

    # ---- status ----------------------------------------------------------------------------------
    def is_sealed(self) -> bool:
        return self._p(self.MANIFEST).exists()

    def is_final(self) -> bool:
        return self.status().is_final

    def _write_status(self, record: RunStatus) -> None:
        atomic.write_json(self._p(self.STATUS), record.to_json())

    def set_status(self, status: Status, **fields: Any) -> bool:
        """Record a non-final or final status and these RunStatus fields; False (nothing written)
        once the run is final."""
        if not isinstance(status, Status):
            raise TypeError(f"set_status takes a Status, not {type(status).__name__} {status!r}")
        prev = self.status()
        if prev.is_final or self._unsealed_since():  # sealed once: nothing is recorded over what changed
            return False
        record = dataclasses.replace(prev, **fields, state=status, updated=now_iso())
        if status is Status.running and record.started is None:
            record = dataclasses.replace(record, started=now_iso())
        if record.is_final:
            record = dataclasses.replace(record, ended=now_iso())
        self._write_status(record)
        if status is Status.cancelled:  # every rank's peer watch finds it in errors/ (no status.json read)
            atomic.write_text(self._p(self.CANCELLED_MARK), now_iso() + "\n")
        return True

    def finish(self, status: Status, seal: bool = True, **fields: Any) -> bool:
        """Record the run's outcome (a final status) and seal it; False if it already had one."""
        if not isinstance(status, Status):
            raise TypeError(f"finish takes a Status, not {type(status).__name__} {status!r}")
        if status.value not in FINAL:
            raise ValueError(f"{status.value} is not a final status ({', '.join(FINAL)})")
        done = self.set_status(status, **fields)
        if done and seal:
            self.seal()
        return done

    def finish_in_job(self, status: Status, **fields: Any) -> bool:
        """``finish`` from inside the job (a rank, the step's teardown): the outcome recorded, the seal
        left due (a mark beside the run says so) for when the job has ended, off its allocation: the
        backend's ``seal_after_job``, the local controller, or the login side's next refresh
        (launcher.run.outcome). Its ranks may still be writing their last records until then."""
        done = self.finish(status, seal=False, **fields)
        if done and not self.is_sealed():
            # the records launch wrote, by digest, as the job ends: the seal made later finds a change
            # made in between and never seals it in (Sealing.changed_since_end)
            atomic.write_json(self._seal_mark(), {"run_dir": str(self.path), "due": now_iso(),
                                                  "held": self.held_at_end()})
        return done

    @contextlib.contextmanager
    def seal_lock(self) -> Iterator[None]:
        """The run's lock (fcntl, a file beside the run dir on the shared file system) for sealing it and
        reopening it from a job: the seal job after a run's job and cluster.elastic's deciding job start
        together (launcher.runtime.seal, launcher.features.elastic.regrow); one seals, the other finds it done."""
        with file_lock(self.path.parent / f".{self.path.name}.lock"):
            yield

    def seal_due(self) -> bool:
        """A final run whose job left its seal for later (finish_in_job), not sealed yet."""
        if self._p(self.MANIFEST).exists():
            return False
        found = atomic.read_json(self._seal_mark())
        return isinstance(found, dict) and "due" in found and "manifest_sha256" not in found and self.is_final()
