"""RunDir's writers: the records written before submission (login side) and on the node."""
from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Dict, List, Tuple

from launcher.archive import atomic, yamlio
from launcher.run.checks_record import ChecksRecord
from launcher.run.io import (
    fill_name,
    now_iso,
    put_json,
)
from launcher.run.job_record import JobRecord


class Writes:
    """Writers of a run dir's records (a mixin of RunDir: its paths and names)."""

    # ---- before submission (login side) ----------------------------------------------------------
    def write_config(self, resolved: Dict[str, Any]) -> None:
        atomic.write_text(self._p(self.CONFIG), yamlio.dump(resolved))

    def write_overrides(self, overrides: List[str], choices: Dict[str, Any]) -> None:
        atomic.write_text(self._p(self.OVERRIDES),
                          yamlio.dump({"overrides": list(overrides), "choices": dict(choices)}))

    def write_code(self, git: Dict[str, Any], patch: str, snapshot: Dict[str, Any]) -> None:
        atomic.write_json(self._p(self.GIT), git)
        atomic.write_text(self._p(self.PATCH), patch)
        atomic.write_json(self._p(self.SNAPSHOT), snapshot)

    def write_software(self, versions: Dict[str, Any], pip_freeze: str) -> None:
        atomic.write_json(self._p(self.SOFTWARE), versions)
        atomic.write_text(self._p(self.PIP_FREEZE), pip_freeze)

    def link_from(self, other: Writes, names: Tuple[str, ...]) -> None:
        """These files as ``other`` holds them, hard-linked (a sweep's runs share their code and
        software records: written once, linked into each run). Safe because no archive file is ever
        changed in place (atomic writes replace them), so a link never makes two runs share a change.
        Copied where the file system refuses links."""
        for name in names:
            src, dst = other._p(name), self._p(name)
            try:
                try:
                    os.link(src, dst)
                except FileNotFoundError:  # its folder (code/, env/) not made yet
                    dst.parent.mkdir(parents=True, exist_ok=True)
                    os.link(src, dst)
            except FileExistsError:  # linked already (every rank of a run adopts the shared files)
                if not os.path.samefile(src, dst):
                    raise
            except OSError:  # the file system refuses hard links: a copy, put in place whole
                tmp = dst.with_name(f".{dst.name}.{os.getpid()}.copy")
                shutil.copyfile(src, tmp)
                os.replace(tmp, dst)

    def write_plan(self, plan: Dict[str, Any]) -> None:
        atomic.write_json(self._p(self.PLAN), plan)

    def write_checks(self, record: ChecksRecord) -> None:
        atomic.write_json(self._p(self.CHECKS), record.to_json())

    def write_data_manifest(self, record: Dict[str, Any]) -> None:
        atomic.write_json(self._p(self.DATA_MANIFEST), record)

    def write_seeds(self, seeds: Dict[str, Any]) -> None:
        atomic.write_json(self._p(self.SEEDS), seeds)

    def write_job(self, job: JobRecord) -> None:
        atomic.write_json(self._p(self.JOB), job.to_json())

    def archive_script(self, shared: Writes) -> None:
        """The script this run's job was submitted with, as ``shared`` holds it (written once for an
        array, linked into each of its runs); it replaces an earlier attempt's (resume, retry)."""
        own = self._p(self.SCRIPT)
        if own.exists() and not os.path.samefile(own, shared._p(self.SCRIPT)):
            own.unlink()
        self.link_from(shared, (self.SCRIPT,))

    def write_script(self, text: str) -> None:
        atomic.write_text(self._p(self.SCRIPT), text)

    def write_run(self, meta: Dict[str, Any]) -> Dict[str, Any]:
        """run.json goes last: a dir without it is not a run. Returns what it wrote."""
        written = {**meta, "created": now_iso(), "created_ts": time.time()}
        atomic.write_json(self._p(self.RUN), written)
        return written

    # ---- on the node -----------------------------------------------------------------------------
    def write_rank(self, rank: int, info: Dict[str, Any]) -> None:
        put_json(self._p(fill_name(self.RANK, r=rank)), info)

    @property
    def master_addr_path(self) -> Path:
        """Where rank 0 leaves the rendezvous host's address for the others (launcher.runtime.env)."""
        return self._p(self.MASTER_ADDR)

    def write_rank_attempts(self, record: Dict[str, Any]) -> None:
        atomic.write_json(self._p(self.RANK_ATTEMPTS), record)

    def write_rank_error(self, rank: int, traceback_text: str) -> None:
        atomic.write_text(self._p(fill_name(self.RANK_ERROR, r=rank)), traceback_text)

    def write_mesh(self, rank: int, placement: Dict[str, Any]) -> None:
        put_json(self._p(fill_name(self.MESH, r=rank)), placement)

    def write_state(self, rank: int, state: Dict[str, Any]) -> None:
        put_json(self._p(fill_name(self.STATE, r=rank)), state)

    def write_topology(self, node: str, node_rank: int, info: Dict[str, Any]) -> None:
        atomic.write_json(self._p(fill_name(self.TOPOLOGY, name=node, n=node_rank)), info)

    def write_environment(self, training_env: Dict[str, Any], runtime: Dict[str, Any]) -> None:
        atomic.write_json(self._p(self.TRAINING_ENV), training_env)
        atomic.write_json(self._p(self.RUNTIME), runtime)

    def rewrite_metrics(self, rows: List[Dict[str, Any]]) -> None:
        """The metrics file holds exactly ``rows`` (a resumed attempt drops the steps it redoes)."""
        atomic.write_text(self._p(self.METRICS), "".join(json.dumps(r) + "\n" for r in rows))
