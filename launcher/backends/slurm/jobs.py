"""The Slurm backend's jobs once queued: states (sacct, then squeue), cancel, requeue, pause and resume,
what the scheduler is doing with a job, and the jobs queued after one (the seal, cluster.elastic)."""
from __future__ import annotations

import os
import pwd
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence

import launcher.backends.slurm.limits as limits
from launcher.backends.base import (
    PACK_STEP_ENV,
    JobState,
)
from launcher.backends.slurm.limits import (
    job_end_of,
    job_ending_of,
)
from launcher.backends.slurm.text import (
    ELASTIC_MODULE,
    ELASTIC_TIME_MIN,
    WAVES_MODULE,
    WAVES_TIME_MIN,
    after_job_command,
    job_scope,
    node_states_from_sinfo,
    parse_states,
    seal_job_command,
    submit_environment,
    with_array_tasks,
)
from launcher.features.elastic import resize as elastic
from launcher.run.job_record import JobRecord
from launcher.run.status import Status

# the ends Slurm may follow with a requeue of the same job id (JobRequeue, --requeue)
REQUEUED_AFTER = ("NODE_FAIL", "PREEMPTED", "BOOT_FAIL")


class SlurmJobs:
    """A Slurm job's life after sbatch (a mixin of SlurmBackend)."""

    def states(self, jobs: Iterable[Dict[str, Any]]) -> Dict[str, JobState]:
        ids = sorted({str(j["job_id"]) for j in jobs if j.get("job_id")})
        if not ids:
            return {}
        out = parse_states(limits.run(["sacct", "-X", "-n", "-P", "--format=JobID,State", "-j", ",".join(ids)],
                                      say_failure=True))
        # accounting lags submission, and keeps REQUEUED for a job requeued held and then cancelled
        # (a pruned point's); a job Slurm requeues after a node failure reads NODE_FAIL there (its first
        # allocation's record) for a moment while the controller holds it PENDING: the controller's
        # word for these, while it still knows the job (-t all: ended ones too, for MinJobAge)
        ask = [i for i in ids if i not in out or out[i].status is Status.requeued
               or out[i].raw.split()[0].rstrip("+").upper() in REQUEUED_AFTER]
        if ask:
            live = parse_states(limits.run(["squeue", "-h", "-t", "all", "-o", "%i|%T", "-j", ",".join(ask)],
                                           say_failure=True))
            out.update({i: st for i, st in live.items() if i in ask})
        # an array whose tasks never started is one compressed record (A_[0-999%4]): each task takes its
        # state, so runs cancelled, or purged, while pending settle instead of staying pending for ever
        missing = [i for i in ids if i not in out and "_" in i]
        if missing:
            arrays = sorted({i.partition("_")[0] for i in missing})
            packed = parse_states(limits.run(["sacct", "-X", "-n", "-P", "--format=JobID,State", "-j",
                                              ",".join(arrays)]))
            packed.update(parse_states(limits.run(["squeue", "-h", "-t", "all", "-o", "%i|%T", "-j",
                                                   ",".join(arrays)])))
            out = with_array_tasks({**packed, **out}, missing)
        return {i: out[i] for i in ids if i in out}

    def cancel(self, job: JobRecord, wait_s: float = 60.0) -> None:
        """``cancel_all`` of one job."""
        self.cancel_all([job], wait_s)

    def ours(self, jobs: List[JobRecord]) -> List[JobRecord]:
        """The jobs the controller still holds that are these runs' own: this user's, their batch script
        in the run's submitit folder (a job id recorded in job.json may since name another job: ids are
        reused after a controller restart or a wrap-around). Each other one is named on stderr, never
        cancelled. A job the controller no longer holds has ended: nothing to cancel."""
        from submitit.core.utils import JobPaths  # only to cancel

        ids = sorted({j.job_id for j in jobs if j.job_id})
        if not ids:
            return []
        try:
            res = subprocess.run(["squeue", "-h", "-r", "-o", "%i|%u|%o", "-j", ",".join(ids)], capture_output=True,
                                 text=True, timeout=60)
        except (OSError, subprocess.SubprocessError) as e:
            res = subprocess.CompletedProcess([], 1, "", str(e))
        if res.returncode != 0 and "Invalid job id" not in res.stderr:  # (every id ended: nothing to cancel)
            print(f"launcher: squeue failed ({(res.stderr or '').strip()[:200] or 'no answer'}): the jobs "
                  f"{', '.join(ids[:10])}{' ...' if len(ids) > 10 else ''} could not be checked as this run's own, "
                  "so none was cancelled; try again once the controller answers", file=sys.stderr)
            return []
        held = {}
        for line in res.stdout.splitlines():
            jid, user, command = (line.split("|", 2) + ["", ""])[:3]
            held[jid.strip()] = (user.strip(), command.strip())
            # a whole array asked for by its own id (a refused launch cancels what it queued): its tasks
            held.setdefault(jid.strip().partition("_")[0], (user.strip(), command.strip()))
        me, mine = pwd.getpwuid(os.getuid()).pw_name, []  # as squeue names the owner (not $USER)
        for job in jobs:
            if job.job_id not in held:
                continue
            user, command = held[job.job_id]
            folder = Path(job.submitit_folder) if job.submitit_folder else None
            home = str(JobPaths.get_first_id_independent_folder(folder)) if folder else ""
            if user == me and home and command.startswith(home.rstrip("/") + "/"):
                mine.append(job)
            else:
                print(f"launcher: job {job.job_id} is not this run's (user {user or '?'}, batch script "
                      f"{command or '?'}; the run's folder {home or '?'}): not cancelled", file=sys.stderr)
        return mine

    def cancel_all(self, jobs: List[JobRecord], wait_s: float = 60.0) -> None:
        """One scancel for every job (a sweep's array tasks, by their ids), then one state query a second
        for all of them until each has ended (or ``wait_s``): a 10,000-run sweep costs one command, not
        a cancel and a poll per run. A packed point's step is cancelled alone, as ``cancel`` does."""
        for job in jobs:
            if job.pack_index is not None:
                self._cancel_point(job, wait_s)
        whole = [job.to_json() for job in self.ours([j for j in jobs if j.pack_index is None and j.job_id])]
        if not whole:
            return
        subprocess.run(["scancel", *sorted({str(j["job_id"]) for j in whole})], check=False, timeout=120)
        deadline = time.time() + wait_s
        while whole and time.time() < deadline:
            states = self.states(whole)
            whole = [j for j in whole if (s := states.get(str(j["job_id"]))) is not None and not s.ended]
            if whole:
                time.sleep(1.0)

    def _cancel_point(self, job: JobRecord, wait_s: float) -> None:
        """scancel the step of a packed point (found by its name: launcher.features.pack.runner.step_name), then
        wait until it is gone. A point still queued has no step: its run, recorded cancelled first
        (launcher cancel), is one its pack's runner never starts."""
        prefix = f"pack{job.pack_index}-"

        def steps() -> List[str]:
            out = limits.run(["squeue", "-h", "-s", "-j", job.job_id, "-o", "%i|%j"])
            return [i.strip() for i, _, name in (ln.partition("|") for ln in out.splitlines())
                    if name.strip().startswith(prefix)]

        for step in steps():
            subprocess.run(["scancel", step], check=False, timeout=60)
        deadline = time.time() + wait_s
        while time.time() < deadline and steps():
            time.sleep(1.0)

    def request_requeue(self, job_id: Optional[str]) -> None:
        """``scontrol requeue``: Slurm ends this job's processes and queues the same job id again."""
        if os.environ.get(PACK_STEP_ENV):  # a packed point: its pack's runner starts it again, not Slurm
            return
        if os.environ.get(elastic.ENV) == "1":  # cluster.elastic: the job queued after this one restarts the
            return  # run, as a new job on the nodes there are then (launcher.features.elastic.decide)
        if not job_id:
            raise RuntimeError("no Slurm job id to requeue (SLURM_JOB_ID unset)")
        res = subprocess.run(["scontrol", "requeue", str(job_id)], timeout=60, capture_output=True, text=True)
        if res.returncode:
            raise subprocess.CalledProcessError(res.returncode, res.args, res.stdout, res.stderr.strip())


    def pause(self, job_id: Optional[str]) -> None:
        """``scontrol requeuehold``: Slurm ends this job and keeps it pending, held (out of the array's
        running slots, never purged as an ended job would be) until ``resume_paused`` releases it."""
        try:
            self._scontrol("requeuehold", job_id)
        except subprocess.CalledProcessError as e:
            if e.returncode >= 0:
                raise
            # scontrol runs inside the job: the requeue it asked for ends the job's processes and can kill
            # scontrol before it exits. The request was taken; a hold makes sure of it (already held: no-op).
            subprocess.run(["scontrol", "hold", str(job_id)], check=False, timeout=60, capture_output=True)

    def resume_paused(self, job_id: Optional[str], tries: int = 5, wait_s: float = 2.0) -> None:
        """``scontrol release`` of the held job: it runs again, same job id, and resumes. Asked again a
        few times: a job paused a moment ago may still be completing its requeue."""
        for i in range(tries):
            try:
                return self._scontrol("release", job_id)
            except subprocess.CalledProcessError:
                if i == tries - 1:
                    raise
                time.sleep(wait_s)

    def drop_paused(self, job_id: Optional[str]) -> None:
        """``scancel`` of the held job."""
        if job_id:
            subprocess.run(["scancel", str(job_id)], check=False, timeout=60, capture_output=True)

    def _scontrol(self, verb: str, job_id: Optional[str]) -> None:
        if not job_id:
            raise RuntimeError(f"no Slurm job id to {verb}")
        res = subprocess.run(["scontrol", verb, str(job_id)], timeout=60, capture_output=True, text=True)
        if res.returncode:
            raise subprocess.CalledProcessError(res.returncode, res.args, res.stdout, res.stderr.strip())

    def requeued_since_start(self, job_id: Optional[str]) -> bool:
        """Whether this job was requeued since it started (its restart count went up): an earlier
        request went through, and a second one would fail ("Job is pending execution")."""
        if os.environ.get(PACK_STEP_ENV):
            return False
        m = re.search(r"\bRestarts=(\d+)", limits.run(["scontrol", "show", "job", "-o", str(job_id)]))
        return bool(m) and int(m.group(1)) > int(os.environ.get("SLURM_RESTART_COUNT") or 0)

    def job_ending(self, job_id: Optional[str]) -> Optional[str]:
        """``scontrol show job`` read at the TERM (slurmctld's word, before accounting's): see
        ``job_ending_of``. A packed point's step: None (the pack runner decides for its points)."""
        if not job_id or os.environ.get(PACK_STEP_ENV):
            return None
        return job_ending_of(limits.run(["scontrol", "show", "job", "-o", str(job_id)]),
                             int(os.environ.get("SLURM_RESTART_COUNT") or 0))

    def job_end(self, job_id: Optional[str]) -> Optional[float]:
        """``scontrol show job``'s EndTime (Slurm 22.05 sets no SLURM_JOB_END_TIME); a packed point's
        step: None (the pack's job ends for all its points)."""
        if not job_id or os.environ.get(PACK_STEP_ENV):
            return None
        return job_end_of(limits.run(["scontrol", "show", "job", "-o", str(job_id)]))

    def job_state_now(self, job_id: Optional[str]) -> str:
        """``scontrol show job``'s JobState (slurmctld's word, without accounting's lag); "": unknown."""
        if not job_id:
            return ""
        m = re.search(r"\bJobState=(\S+)", limits.run(["scontrol", "show", "job", "-o", str(job_id)]))
        return m.group(1) if m else ""


    def seal_after_job(self, run_dir: Path, job_id: Optional[str], folder: Path) -> Optional[str]:
        """A one-node, one-task job after this one (afterany) seals the run: the allocation is released
        first, not held while one process hashes the run dir (seal_job_command)."""
        if not job_id:
            return None
        try:
            return self._sbatch(seal_job_command(run_dir, job_id, folder, sys.executable, os.environ))
        except (OSError, subprocess.SubprocessError, RuntimeError):
            return None

    def elastic_after_job(self, run_dir: Path, job_id: str, folder: Path, when: str = "afternotok",
                          scope: Optional[Mapping[str, str]] = None) -> str:
        """Queue the one-node job that decides where run ``run_dir`` goes on once job ``job_id`` ends
        (``when``: afternotok, the cluster may have ended it; afterany, it ends to grow back), in
        ``scope`` (partition, account, QOS; None: this job's); its id. Raises RuntimeError: refused."""
        cmd = after_job_command("elastic", ELASTIC_MODULE, run_dir, f"{when}:{job_id}", folder, sys.executable,
                                job_scope(os.environ) if scope is None else scope, ELASTIC_TIME_MIN, (str(job_id),))
        return self._sbatch(cmd)

    def cancel_helper(self, job_id: str, kind: str) -> bool:
        """scancel a job of ``kind`` the launcher queued beside the runs' (a sweep's wave job), only where
        the controller says it is this user's and named ``<kind>-...`` (an id may since name another
        job); whether it was cancelled."""
        user = pwd.getpwuid(os.getuid()).pw_name
        for line in limits.run(["squeue", "-h", "-j", str(job_id), "-o", "%u|%j"]).splitlines():
            owner, _, name = line.partition("|")
            if owner.strip() == user and name.strip().startswith(f"{kind}-"):
                subprocess.run(["scancel", str(job_id)], check=False, timeout=60)
                return True
        return False

    def wave_job(self, sweep_dir: Path, after: Sequence[str], folder: Path, scope: Mapping[str, str],
                 begin: Optional[str] = None) -> str:
        """Queue the job that queues sweep ``sweep_dir``'s next wave (launcher.submit.waves) once every job
        of ``after`` has ended, whatever its end (afterany; none: once ``begin`` has come), in ``scope``
        (partition, account, QOS: the wave's); its id. Raises RuntimeError: refused."""
        dependency = "afterany:" + ":".join(str(j) for j in after) if after else ""
        return self._sbatch(after_job_command("waves", WAVES_MODULE, sweep_dir, dependency, folder, sys.executable,
                                              scope, WAVES_TIME_MIN, begin=begin))

    def usable_nodes(self, partition: Optional[str], own: Optional[str] = None) -> List[str]:
        """The nodes of ``partition`` (None: the default one) a job queued now could start on at once: the
        idle ones, and ``own`` (launcher.features.elastic.resize.usable)."""
        rows = node_states_from_sinfo(limits.run(["sinfo", "-h", "-N", "-o", "%N|%P|%T"]), partition)
        return elastic.usable(rows, own)

    def ended_state(self, job_id: str) -> str:
        """The scheduler's word for a job that has ended (sacct, the controller's while accounting lags)."""
        state = self.states([{"job_id": job_id}]).get(str(job_id))
        return state.raw if state is not None else ""

    @staticmethod
    def _sbatch(cmd: List[str]) -> str:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=submit_environment(os.environ))
        if res.returncode != 0 or not res.stdout.strip():
            raise RuntimeError(f"sbatch refused: {(res.stderr or res.stdout).strip()}")
        return res.stdout.strip().split(";")[0]

