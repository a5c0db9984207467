"""RunDir: every file of a run directory by name, its status transitions and its seal.

As submitit's JobPaths does for a job, RunDir names each file of ``<runs_root>/<sweep_id>/<index>/``
once; the launcher (before submission), the job on the node, ``launcher cancel`` and the recipes
(through ``ctx.rundir``) all write through it. ``FILES`` is the table docs/archive.md lists; a recipe's
own files (a DeepSpeed config, a benchmark's results) are its contract's (launcher.recipe_contract).
SweepDir does the same for the sweep directory that holds the runs.

A run becomes final once (completed, failed, cancelled, timeout): ``finish`` records the outcome and
seals the dir (manifest.json over every file, symlink, directory and checkpoint, then every file
read-only); a later ``finish`` or ``set_status`` changes nothing. Inside a job, ``finish_in_job``
records it and leaves the seal due, for after the job (docs/archive.md, "The seal").
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import functools
import hashlib
import json
import os
import secrets
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import yaml

from launcher.archive import atomic, yamlio
from launcher.job_record import JobRecord
from launcher.status import FINAL, RunStatus, Status

if TYPE_CHECKING:
    from launcher.job_record import JobRecord


# restart reasons a user asked for (launcher resume / retry): the restart budget starts again there
RESTARTED_BY_USER = ("resume", "retry")
# restarts a sweep's scheduler asks for (sweep=asha: a paused point promoted at a rung): no failure,
# so train.max_restarts does not count them
# and cluster.elastic's (launcher.features.elastic.resize.SHRINK, GROW: a node lost, nodes back): no failure
# of the run's
RESTARTED_BY_SCHEDULE = ("promoted", "shrink", "grow")


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive fcntl lock on ``path`` (made if absent), held for the block: one writer at a time across
    the nodes that share the file system."""
    import fcntl

    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX)
        yield
    finally:
        try:
            fcntl.lockf(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)


def now_iso() -> str:
    return _dt.datetime.now().astimezone().isoformat(timespec="seconds")


def parse_iso(text: Optional[str]) -> Optional[float]:
    """A time now_iso wrote, as seconds since the epoch (None: absent or not such a time)."""
    try:
        return _dt.datetime.fromisoformat(str(text)).timestamp() if text else None
    except ValueError:
        return None


# (path, written by, what it holds): the run dir's files every recipe's run may hold (a recipe adds its
# own: its contract's run_files). <r> is a rank, <name>/<n> a node.
FILES: Tuple[Tuple[str, str, str], ...] = (
    ("run.json", "launcher", "run_id, sweep_id, index, created, seed, tags, backend, argv, layout (engine, dp, tp, "
     "pp, ZeRO, micro batch, grad accumulation, procs per node: what the job runs with); `reproduces` for a "
     "reproduction"),
    ("config.yaml", "launcher", "the resolved config (no interpolations left) the job runs with; secret-named "
     "values redacted"),
    ("overrides.yaml", "launcher", "command-line overrides and the chosen option of every config group"),
    ("seeds.json", "launcher", "every seed (init, data order, dropout per data-parallel rank) and how each is derived"),
    ("plan.json", "launcher", "the planner's estimate for the layout (memory, communication, bubble, step time, MFU)"),
    ("data_manifest.json", "launcher", "data=tokens: per dataset of the run (one per blend entry) the absolute path it "
     "was read from, its weight, its manifest.json as read at launch and that file's sha256 (reproduce verifies "
     "every shard against it, resume their sizes)"),
    ("code/git.json", "launcher", "repo, commit, branch, dirty flag"),
    ("code/patch.diff", "launcher", "patch of uncommitted changes including untracked files"),
    ("code/snapshot.json", "launcher", "where the code snapshot this run executes lies, its file count and sha256"),
    ("env/software.json", "launcher", "python, torch, deepspeed, hydra, submitit versions"),
    ("env/pip-freeze.txt", "launcher", "every installed distribution, as `pip freeze --all` lists them"),
    ("job.json", "launcher", "backend, job id (`<array>_<task>` in a sweep), submitit folder, log paths"),
    ("sbatch.sh", "launcher", "the exact script submitit handed to sbatch, copied from its folder (Slurm)"),
    ("status.json", "launcher, job", "launcher.status.RunStatus: status (pending, running, completed, failed, "
     "cancelled, timeout, requeued), updated/started/ended, exit_code, error, failed_rank, summary, duration_s, "
     "attempt, restarts, stop, resumed, no_restart (why a failure was not restarted, the fix), hosts, world_size, "
     "job ids, a Hydra app's output/working dir, earlier (the outcomes before a resume)"),
    ("env/runtime.json", "job", "torch, CUDA, NCCL, cuDNN as seen on the node"),
    ("env/training-env.json", "job", "the variables that shape training (NCCL, CUDA, OMP, TORCH, the scheduler's ...) "
     "of rank 0, secrets redacted"),
    ("topology/node_<name>_<n>.json", "job", "per node: hostname, Slurm node name, CPU model and cores, memory, GPUs "
     "(model, memory, driver), `nvidia-smi topo -m`, InfiniBand devices"),
    ("ranks/rank_<r>.json", "job", "hostname, SLURMD_NODENAME, pid, job and array ids, MASTER_ADDR/PORT of each rank "
     "(replaced whole, not flushed: a rank record costs one create and one rename)"),
    ("ranks/master_addr.json", "job (rank 0)", "the rendezvous host's address where DNS does not know the node name: "
     "rank 0 asks the scheduler once, the other ranks read it here"),
    ("errors/rank_<r>.error", "job", "traceback of a rank that raised (a directory of its own: the peer watch of "
     "every rank lists it, and it holds only the ranks that failed)"),
    ("errors/cancelled", "launcher, job", "the run was recorded cancelled: what ends every rank's peer watch"),
    ("ranks/rank_<r>.error", "job (older launchers)", "traceback of a rank that raised, as runs of older launchers "
     "hold it (errors/ now); still read"),
    ("ranks/attempts.json", "job", "recipe=script: the attempt rank 0 began and the start (host, pid) of each rank "
     "it was told to: how ranks that share no process group of the launcher's agree on their attempt"),
    ("ranks/mesh_<r>.json", "recipe", "(dp, pp, tp) coordinates and process groups of each rank (megatron engine)"),
    ("ds_config.json", "deepspeed engine (rank 0)", "the DeepSpeed config a deepspeed engine (launcher.training."
     "engines' or a recipe's own) generated from the composed config (launcher.training.ds_config)"),
    ("ranks/state_<r>.json", "recipe", "bytes of parameters, gradients and optimizer state each rank held; "
     "activation_bytes: the peak of live saved-for-backward bytes in the first step of its last attempt; the "
     "rank's measured memory: host_rss_before/after_build_bytes, host_peak_build_bytes (what constructing the "
     "model used at most), host_peak_step_bytes, and on GPUs device_after_build_bytes, device_peak_build_bytes, "
     "device_peak_step_bytes"),
    ("metrics.jsonl", "recipe (rank 0)", "one object per step: step, loss, tokens_per_s, samples_per_s, step_time_s, "
     "lr, grad_norm, tflops, mfu, the step's time by phase (time_<phase>_s), host_rss_bytes, peak_memory_bytes "
     "(GPU); activation_bytes (rank 0's) on the first step of each attempt; eval_loss on the steps data.eval_every "
     "evaluates"),
    ("samples/rank_<r>.jsonl", "recipe", "data.log_samples: one object per step: step, samples (the [dataset, "
     "epoch, window] of every sample the rank loaded, recipes.common.data), rewound on resume like metrics.jsonl"),
    ("wandb/", "recipe (rank 0)", "wandb's offline run files (wandb.enabled): one wandb run over the attempts; "
     "stream.json: its id, the last step it holds"),
    ("work/", "job", "the recipe's working directory: files it writes to relative paths, one dir per run (the "
                     "code snapshot is only on the import path)"),
    ("checkpoints/step_<n>/", "recipe", "a complete checkpoint after step <n>: each engine's state (model, optimizer, "
     "loss scaler; ZeRO or tensor/pipeline shards by rank), every rank's RNG states, the step and the metrics so far "
     "(meta.json)"),
    ("checkpoints/.step_<n>.partial/", "recipe", "a checkpoint being written: each rank's part and its done_rank_<r> "
     "marker; renamed to step_<n>/ once every rank's part is in, deleted by the next attempt if a rank died first"),
    ("checkpoints/script/", "recipe (script)", "recipe=script: the script's own checkpoints "
     "(LAUNCHER_CHECKPOINT_DIR), whatever it saves there"),
    ("checkpoints/latest", "recipe", "the name of the newest complete checkpoint (only ever a complete one)"),
    ("checkpoints/step_<n>/checkpoint.json", "recipe", "every file of the checkpoint: relative path, size, sha256; "
     "the step (launcher.checkpoint_manifest: verified before a resume)"),
    ("checkpoints/rejected/step_<n>.attempt_<a>/", "recipe", "a checkpoint that failed verification when attempt "
     "<a> resumed, moved aside"),
    ("checkpoint_fallbacks.jsonl", "recipe (rank 0)", "one object per resume that fell back past a checkpoint "
     "that failed verification: attempt, resumed_from, from_step, rejected (checkpoint -> the file and what is "
     "wrong), moved"),
    ("lineage.jsonl", "job (rank 0 of the member deciding)", "sweep=pbt: one object per exploit of this member: "
     "generation, step, donor (index and run id), the copied checkpoint and its checkpoint.json's sha256, the "
     "explored values before and after, factors; `replayed_from` in a reproduction"),
    ("pbt_values.json", "job (rank 0 of the member deciding)", "sweep=pbt: the member's explored values now "
     "(key -> value), laid over config.yaml when an attempt starts"),
    ("restarts.jsonl", "job, launcher", "one object per restart: attempt, time, reason (failure, hang, preempted, "
     "time_limit, scheduler, resume, retry), detail, from_step (the checkpoint resumed from), nodes, job id, "
     "failure (the exception that ended the attempt before: type, message, place, step; restart_policy), layout "
     "(a resume on another layout: from and to)"),
    ("reshard.jsonl", "recipe (rank 0)", "one object per resume on another layout: step, checkpoint, from and to, "
     "moved, load_s, verify (tensors and bytes gathered, mismatched and missing names), bitwise_equal, rng"),
    ("stacks/rank_<r>.txt", "job", "every thread's Python stack of each rank, dumped when the hang watchdog fires"),
    ("stacks/gatherer", "job", "the rank that gathers the stacks into hang.json (the first to dump; the others only "
     "dump)"),
    ("hang.json", "job", "the hang watchdog's finding: step, timeout, stuck ranks (not in a collective) and where, "
     "the collective each other rank waits in"),
    ("attempts/<a>/", "job, launcher", "what an earlier attempt left (errors/, stacks, hang.json, the "
     "manifest of a resumed run, every mesh and state record, the rank and node records of ranks and nodes the "
     "next attempt does not have), moved aside when the next attempt starts"),
    ("manifest.json", "launcher, job", "written when the run is sealed: the sha256 of every file, every "
     "symlink's target (never followed), every directory, each checkpoint's files (sha256 up to 1 MiB, size "
     "above), the checkpoints and what `latest` names, the code snapshot's digest"),
)


def _name(pattern: str, **parts: Any) -> str:
    for k, v in parts.items():
        pattern = pattern.replace(f"<{k}>", str(v))
    return pattern


class RunDir:
    RUN, CONFIG, OVERRIDES, SEEDS, PLAN = "run.json", "config.yaml", "overrides.yaml", "seeds.json", "plan.json"
    DATA_MANIFEST = "data_manifest.json"
    GIT, PATCH, SNAPSHOT = "code/git.json", "code/patch.diff", "code/snapshot.json"
    SOFTWARE, PIP_FREEZE = "env/software.json", "env/pip-freeze.txt"
    JOB, SCRIPT, STATUS = "job.json", "sbatch.sh", "status.json"
    RUNTIME, TRAINING_ENV = "env/runtime.json", "env/training-env.json"
    TOPOLOGY = "topology/node_<name>_<n>.json"
    RANK, RANK_ERROR, MESH, STATE = ("ranks/rank_<r>.json", "errors/rank_<r>.error", "ranks/mesh_<r>.json",
                                     "ranks/state_<r>.json")
    OLD_RANK_ERROR, CANCELLED_MARK = "ranks/rank_<r>.error", "errors/cancelled"  # (older launchers' rank errors)
    MASTER_ADDR, STACK_GATHERER = "ranks/master_addr.json", "stacks/gatherer"
    METRICS, WANDB, MANIFEST = "metrics.jsonl", "wandb", "manifest.json"
    SAMPLES = "samples/rank_<r>.jsonl"
    CHECKPOINT, CHECKPOINT_PARTIAL, LATEST = ("checkpoints/step_<n>", "checkpoints/.step_<n>.partial",
                                              "checkpoints/latest")
    RESTARTS, STACK, HANG, ATTEMPT = "restarts.jsonl", "stacks/rank_<r>.txt", "hang.json", "attempts/<a>"
    RANK_ATTEMPTS, SCRIPT_CHECKPOINTS = "ranks/attempts.json", "checkpoints/script"
    RESHARDS = "reshard.jsonl"  # each resume on another layout: what moved, the bitwise check (training.universal)
    FALLBACKS, CHECKPOINT_REJECTED = "checkpoint_fallbacks.jsonl", "checkpoints/rejected/step_<n>.attempt_<a>"
    WORK = "work"
    DS_CONFIG = "ds_config.json"
    SHARED_FILES = (GIT, PATCH, SNAPSHOT, SOFTWARE, PIP_FREEZE)  # alike for every run of a sweep

    def __init__(self, path: Union[str, Path]) -> None:
        self.path = Path(path)

    @property
    def run_id(self) -> str:
        """``<sweep_id>-<index>``, from where the run dir lies (SweepDir.run_id composes it)."""
        return SweepDir(self.path.parent).run_id(self.path.name)

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r})"

    def __fspath__(self) -> str:
        return str(self.path)

    def _p(self, name: str) -> Path:
        return self.path / name

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

    def link_from(self, other: RunDir, names: Tuple[str, ...]) -> None:
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

    def write_data_manifest(self, record: Dict[str, Any]) -> None:
        atomic.write_json(self._p(self.DATA_MANIFEST), record)

    def write_seeds(self, seeds: Dict[str, Any]) -> None:
        atomic.write_json(self._p(self.SEEDS), seeds)

    def write_job(self, job: JobRecord) -> None:
        atomic.write_json(self._p(self.JOB), job.to_json())

    def archive_script(self, shared: RunDir) -> None:
        """The script this run's job was submitted with, as ``shared`` holds it (written once for an
        array, linked into each of its runs); it replaces an earlier attempt's (resume, retry)."""
        own = self._p(self.SCRIPT)
        if own.exists() and not os.path.samefile(own, shared._p(self.SCRIPT)):
            own.unlink()
        self.link_from(shared, (self.SCRIPT,))

    def write_script(self, text: str) -> None:
        atomic.write_text(self._p(self.SCRIPT), text)

    def write_run(self, meta: Dict[str, Any]) -> None:
        """run.json goes last: a dir without it is not a run."""
        atomic.write_json(self._p(self.RUN), {**meta, "created": now_iso(), "created_ts": time.time()})

    # ---- on the node -----------------------------------------------------------------------------
    def write_rank(self, rank: int, info: Dict[str, Any]) -> None:
        _put_json(self._p(_name(self.RANK, r=rank)), info)

    @property
    def master_addr_path(self) -> Path:
        """Where rank 0 leaves the rendezvous host's address for the others (launcher.runtime.env)."""
        return self._p(self.MASTER_ADDR)

    def write_rank_attempts(self, record: Dict[str, Any]) -> None:
        atomic.write_json(self._p(self.RANK_ATTEMPTS), record)

    def write_rank_error(self, rank: int, traceback_text: str) -> None:
        atomic.write_text(self._p(_name(self.RANK_ERROR, r=rank)), traceback_text)

    def write_mesh(self, rank: int, placement: Dict[str, Any]) -> None:
        _put_json(self._p(_name(self.MESH, r=rank)), placement)

    def write_state(self, rank: int, state: Dict[str, Any]) -> None:
        _put_json(self._p(_name(self.STATE, r=rank)), state)

    def write_topology(self, node: str, node_rank: int, info: Dict[str, Any]) -> None:
        atomic.write_json(self._p(_name(self.TOPOLOGY, name=node, n=node_rank)), info)

    def write_environment(self, training_env: Dict[str, Any], runtime: Dict[str, Any]) -> None:
        atomic.write_json(self._p(self.TRAINING_ENV), training_env)
        atomic.write_json(self._p(self.RUNTIME), runtime)

    def rewrite_metrics(self, rows: List[Dict[str, Any]]) -> None:
        """The metrics file holds exactly ``rows`` (a resumed attempt drops the steps it redoes)."""
        atomic.write_text(self._p(self.METRICS), "".join(json.dumps(r) + "\n" for r in rows))

    # ---- checkpoints -----------------------------------------------------------------------------
    @property
    def script_checkpoint_dir(self) -> Path:
        """recipe=script: the dir the script owns (LAUNCHER_CHECKPOINT_DIR)."""
        return self._p(self.SCRIPT_CHECKPOINTS)

    def checkpoint_dir(self, step: int) -> Path:
        return self._p(_name(self.CHECKPOINT, n=f"{int(step):08d}"))

    def checkpoint_partial(self, step: int) -> Path:
        """Where a checkpoint is written until every rank has its part in (then one rename)."""
        return self._p(_name(self.CHECKPOINT_PARTIAL, n=f"{int(step):08d}"))

    def checkpoints(self) -> List[Path]:
        """Complete checkpoints, oldest first."""
        return self._glob(self.CHECKPOINT, n="*")

    def latest_checkpoint(self) -> Optional[Path]:
        """The checkpoint ``latest`` names (None: none yet, or it names one that is gone)."""
        p = self._p(self.LATEST)
        name = p.read_text().strip() if p.is_file() else ""
        ckpt = p.parent / name if name else None
        return ckpt if ckpt is not None and ckpt.is_dir() else None

    def set_latest(self, ckpt: Path) -> None:
        atomic.write_text(self._p(self.LATEST), Path(ckpt).name + "\n")

    def stale_partials(self) -> List[Path]:
        return self._glob(self.CHECKPOINT_PARTIAL, n="*")

    @staticmethod
    def checkpoint_step(ckpt: Path) -> int:
        return int(Path(ckpt).name.rsplit("_", 1)[-1])

    def rejected_checkpoint(self, ckpt: Path, attempt: int) -> Path:
        """Where a checkpoint that failed verification when ``attempt`` resumed is moved aside."""
        return self._p(_name(self.CHECKPOINT_REJECTED, n=f"{self.checkpoint_step(ckpt):08d}", a=int(attempt)))

    def record_fallback(self, row: Dict[str, Any]) -> None:
        """A resume that fell back past checkpoints that failed verification (not a restart)."""
        with open(self._p(self.FALLBACKS), "a") as f:
            f.write(json.dumps({"time": now_iso(), **row}) + "\n")

    def fallbacks(self) -> List[Dict[str, Any]]:
        p = self._p(self.FALLBACKS)
        return [json.loads(line) for line in p.read_text().splitlines() if line.strip()] if p.exists() else []

    # ---- attempts, restarts, hangs ---------------------------------------------------------------
    def restarts(self) -> List[Dict[str, Any]]:
        p = self._p(self.RESTARTS)
        if not p.exists():
            return []
        return _object_lines(p)

    def reshards(self) -> List[Dict[str, Any]]:
        p = self._p(self.RESHARDS)
        return _object_lines(p) if p.exists() else []

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
        return self._p(_name(self.STACK, r=rank))

    def stacks(self) -> Dict[int, str]:
        return {int(p.stem.split("_")[-1]): p.read_text(errors="replace") for p in self._glob(self.STACK, r="*")}

    def stack_count(self) -> int:
        """How many ranks dumped their stacks (one listing, no file read)."""
        prefix, _, suffix = self.STACK.rsplit("/", 1)[-1].partition("<r>")
        return sum(1 for n in _names(self.stack_path(0).parent) if n.startswith(prefix) and n.endswith(suffix))

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
        return self._p(_name(self.ATTEMPT, a=attempt))

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
        leftovers = ([errors / n for n in _names(errors)] + self._glob(self.OLD_RANK_ERROR, r="*")
                     + self._glob(self.STACK, r="*")
                     + [p for p in (self._p(self.HANG), self._p(self.STACK_GATHERER)) if p.exists()])
        ranks = self._p(self.RANK).parent
        for n in _names(ranks):
            kind, _, r = n[:-len(".json")].rpartition("_") if n.endswith(".json") else ("", "", "")
            if kind in ("mesh", "state") or (kind == "rank" and world is not None and r.isdigit() and int(r) >= world):
                leftovers.append(ranks / n)
        if hosts is not None:
            topo = self._p(self.TOPOLOGY).parent
            for n in _names(topo):
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
        return self._p(_name(self.SAMPLES, r=rank))

    @property
    def work_dir(self) -> Path:
        """The job's working directory: what a recipe writes to a relative path lands in its own run."""
        return self._p(self.WORK)

    @property
    def wandb_dir(self) -> Path:
        """wandb.init(dir=...): wandb makes its own ``wandb/`` folder inside."""
        return self.path

    # ---- reading ---------------------------------------------------------------------------------
    def exists(self) -> bool:
        return self._p(self.RUN).is_file()

    def run(self) -> Optional[Dict[str, Any]]:
        """run.json (None: not written yet); Unreadable when it holds anything but a JSON object."""
        return _record(self._p(self.RUN))

    def config(self) -> Dict[str, Any]:
        """config.yaml (FileNotFoundError: none); Unreadable when it is not a YAML mapping of plain
        values (a python/object tag, binary junk, aliases expanding beyond yamlio's bound)."""
        return _yaml_mapping(self._p(self.CONFIG))

    def overrides(self) -> Dict[str, Any]:
        p = self._p(self.OVERRIDES)
        if p.exists():
            return _yaml_mapping(p) or {}
        return (self._point_record() or {}).get("overrides") or {}

    def layout(self):
        """The Layout archived at launch: what the job runs with (never recomputed on the node)."""
        from launcher.layout import (
            Layout,  # omegaconf (through launcher.schema): most readers of a run dir need no layout
        )

        return Layout.from_json((self.run() or {})["layout"])

    def status(self) -> RunStatus:
        """status.json (a run whose job has not written one yet is pending); Unreadable when it is
        not a status record."""
        found = _record(self._p(self.STATUS))
        try:
            return RunStatus.from_json(found or {})
        except (TypeError, ValueError) as e:  # an unknown status, a field of another shape
            raise Unreadable(f"{self.STATUS} is not a status record ({e})", self._p(self.STATUS)) from None

    def backend_name(self) -> str:
        """The backend its job was submitted to: job.json's, else run.json's (a Hydra app's run has no
        cluster group), else its config's cluster.backend; "local" when none says."""
        job = self.job()
        if job is not None and job.backend:
            return str(job.backend)
        meta = self.run() or {}
        if meta.get("backend"):
            return str(meta["backend"])
        try:
            return str((self.config().get("cluster") or {}).get("backend") or "local")
        except (OSError, ValueError):
            return "local"

    def job(self) -> Optional[JobRecord]:
        """job.json (None: the run was never submitted, or it is no job record)."""
        found = atomic.read_json(self._p(self.JOB))
        if not isinstance(found, dict) or not found:
            return None
        try:
            return JobRecord.from_json(found)
        except (TypeError, ValueError):  # a field of another shape: no job this launcher can ask about
            return None

    def seeds(self) -> Optional[Dict[str, Any]]:
        found = atomic.read_json(self._p(self.SEEDS))
        return found if found is not None else (self._point_record() or {}).get("seeds")

    def plan(self) -> Optional[Dict[str, Any]]:
        return atomic.read_json(self._p(self.PLAN))

    def data_manifest(self) -> Optional[Dict[str, Any]]:
        """The datasets the run was launched with (launcher.data.archived), or None (it reads none)."""
        found = atomic.read_json(self._p(self.DATA_MANIFEST))
        return found if isinstance(found, dict) else None

    def git(self) -> Dict[str, Any]:
        return atomic.read_json(self._shared_p(self.GIT), {}) or {}

    def has_patch(self) -> bool:
        return self._shared_p(self.PATCH).exists()

    def patch(self) -> str:
        return self._shared_p(self.PATCH).read_text() if self.has_patch() else ""

    def snapshot(self) -> Dict[str, Any]:
        return atomic.read_json(self._shared_p(self.SNAPSHOT), {}) or {}

    def software(self) -> Optional[Dict[str, Any]]:
        return atomic.read_json(self._shared_p(self.SOFTWARE))

    # A sweep writes the files every run holds alike (SHARED_FILES: code and software records) once,
    # into <sweep>/shared/; a run links them in when it starts (adopt_shared) and at the latest when
    # it is sealed. Until then they are read from there.
    def _shared_p(self, name: str) -> Path:
        own = self._p(name)
        if own.exists():
            return own
        shared = self.path.parent / SweepDir.SHARED / name
        return shared if shared.exists() else own

    def adopt_shared(self) -> None:
        """Link the sweep's shared files this run lacks into it, and write its own seeds.json and
        overrides.yaml from the sweep's per-point record (idempotent; safe from many tasks at once:
        each write replaces the file whole, with the same content)."""
        shared = RunDir(self.path.parent / SweepDir.SHARED)
        missing = tuple(n for n in self.SHARED_FILES if not self._p(n).exists() and shared._p(n).exists())
        self.link_from(shared, missing)  # ranks racing to it: each link made once (link_from)
        point = self._point_record()
        if point is not None:
            if not self._p(self.SEEDS).exists() and point.get("seeds") is not None:
                self.write_seeds(point["seeds"])
            if not self._p(self.OVERRIDES).exists() and point.get("overrides") is not None:
                ov = point["overrides"]
                self.write_overrides(ov.get("overrides") or [], ov.get("choices") or {})

    def _point_record(self) -> Optional[Dict[str, Any]]:
        """This run's entry in its sweep's per-point record (<sweep>/shared/points.json: seeds and
        overrides of every point, written in one file at launch), or None."""
        if not self.path.name.isdigit():
            return None
        found = _points(self.path.parent / SweepDir.SHARED / SweepDir.POINTS).get(self.path.name)
        return None if found is None else json.loads(json.dumps(found))  # the caller's own copy

    def runtime(self) -> Optional[Dict[str, Any]]:
        return atomic.read_json(self._p(self.RUNTIME))

    def script(self) -> Optional[str]:
        p = self._p(self.SCRIPT)
        return p.read_text() if p.exists() else None

    def rank(self, rank: int) -> Dict[str, Any]:
        """ranks/rank_<r>.json of one rank ({} before it started)."""
        return atomic.read_json(self._p(_name(self.RANK, r=rank)), {}) or {}

    def rank_attempts(self) -> Dict[str, Any]:
        return atomic.read_json(self._p(self.RANK_ATTEMPTS), {}) or {}

    def rank_file_mtimes(self) -> Dict[int, float]:
        """The modification time of each rank's ranks/rank_<r>.json, by rank (cheap: no file read)."""
        out = {}
        for p in self._glob(self.RANK, r="*"):
            rank = p.stem.rsplit("_", 1)[-1]
            try:
                if rank.isdigit():
                    out[int(rank)] = p.stat().st_mtime
            except FileNotFoundError:
                pass
        return out

    def ranks(self) -> List[Dict[str, Any]]:
        rows = [atomic.read_json(p, {}) for p in self._glob(self.RANK, r="*")]
        return sorted(rows, key=lambda r: r.get("rank", 0))

    def states(self) -> Dict[int, Dict[str, Any]]:
        """ranks/state_<r>.json of every rank that wrote one, by rank."""
        out = {}
        for p in self._glob(self.STATE, r="*"):
            rank, data = p.stem.rsplit("_", 1)[-1], atomic.read_json(p)
            if rank.isdigit() and isinstance(data, dict):
                out[int(rank)] = data
        return out

    def topology(self) -> List[Dict[str, Any]]:
        return [atomic.read_json(p, {}) for p in self._glob(self.TOPOLOGY, name="*", n="*")]

    def failed_ranks(self, except_rank: Optional[int] = None, since: Optional[float] = None) -> List[str]:
        """Names of the ranks that recorded an error (``rank_3``), other than ``except_rank``; with
        ``since``, only errors recorded at or after that time (not an earlier attempt's). Asked for
        all of them (no ``since``), an older launcher's errors (in ranks/) count too."""
        out = [n for n in self._alarms(except_rank, since) if n != self._cancel_name()]
        if since is None:
            old = {p.name.split(".")[0] for p in self._glob(self.OLD_RANK_ERROR, r="*")}
            out = sorted(set(out) | old - {f"rank_{except_rank}"}, key=lambda n: int(n.rsplit("_", 1)[-1]))
        return out

    def alarm(self, except_rank: Optional[int] = None, since: Optional[float] = None) -> Optional[str]:
        """What ends a rank's peer watch, from one listing of errors/ (which holds only the ranks that
        failed: its cost does not grow with the job): ``rank_3`` (another rank failed), ``cancelled``
        (the run was recorded cancelled), or None. ``since`` as for failed_ranks."""
        found = self._alarms(except_rank, since)
        ranks = [n for n in found if n != self._cancel_name()]
        return ranks[0] if ranks else found[0] if found else None

    def _cancel_name(self) -> str:
        return self.CANCELLED_MARK.rsplit("/", 1)[-1]

    def _alarms(self, except_rank: Optional[int], since: Optional[float]) -> List[str]:
        """errors/ listed once: each rank error's name (``rank_3``) and the cancel mark's, by rank."""
        own = _name(self.RANK_ERROR, r=except_rank).rsplit("/", 1)[-1] if except_rank is not None else None
        out = []
        try:
            with os.scandir(self._p(self.RANK_ERROR).parent) as it:
                entries = [e for e in it if e.name.endswith(".error") or e.name == self._cancel_name()]
        except (FileNotFoundError, NotADirectoryError):  # no rank has failed
            return []
        for p in entries:
            try:
                fresh = since is None or p.stat().st_mtime >= since
            except FileNotFoundError:  # moved aside by the next attempt
                continue
            if p.name != own and fresh:
                out.append(p.name.split(".")[0])
        return sorted(out, key=lambda n: (0, int(n[5:])) if n.startswith("rank_") and n[5:].isdigit() else (1, 0))

    def rank_error_path(self, rank: int) -> Path:
        """errors/rank_<r>.error (ranks/rank_<r>.error where an older launcher left it)."""
        p = self._p(_name(self.RANK_ERROR, r=rank))
        old = self._p(_name(self.OLD_RANK_ERROR, r=rank))
        return old if not p.exists() and old.exists() else p

    def attempts(self) -> List[Path]:
        """The dirs of earlier attempts (attempts/<a>/), in order."""
        return sorted(self._glob(self.ATTEMPT, a="*"), key=lambda p: int(p.name) if p.name.isdigit() else 0)

    def rank_errors(self) -> Dict[int, str]:
        """Each failed rank's recorded error text, by rank (an older launcher's in ranks/ too)."""
        return {int(p.name.split(".")[0].split("_")[-1]): p.read_text(errors="replace")
                for p in self._glob(self.OLD_RANK_ERROR, r="*") + self._glob(self.RANK_ERROR, r="*")}

    def metrics(self) -> List[Dict[str, Any]]:
        if not self.metrics_path.exists():
            return []
        return _object_lines(self.metrics_path)  # a line being written right now is skipped

    def _glob(self, pattern: str, **parts: Any) -> List[Path]:
        return sorted(self.path.glob(_name(pattern, **parts)))

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
        (launcher.outcome). Its ranks may still be writing their last records until then."""
        done = self.finish(status, seal=False, **fields)
        if done and not self.is_sealed():
            atomic.write_json(self._seal_mark(), {"run_dir": str(self.path), "due": now_iso()})
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

    # ---- seal ------------------------------------------------------------------------------------
    # The seal covers everything that can run or be resumed: every file (its sha256), symlink (as a
    # link: its target's text, never followed, wherever it points), directory (empty ones too) and
    # checkpoint of the run dir. Checkpoint files up to CHECKPOINT_HASHED_BYTES are hashed (each
    # checkpoint's own record checkpoint.json, meta.json, `latest`), larger ones named with their size
    # (checkpoint.json holds their sha256). A seal also leaves a mark beside the run dir
    # (<sweep>/.seals/<index>.json: when, and the manifest's sha256), so a manifest deleted or replaced
    # later is found, and the run is never sealed again over what changed.
    def _tree(self, trust_checkpoints: bool = False) -> Dict[str, Tuple[str, str]]:
        """rel -> (kind, digest) of everything in the run dir but manifest.json and wandb's late logs:
        ("file", sha256), ("link", target), ("dir", ""), ("other", ""); under checkpoints/, a file is
        ("checkpoint", "sha256:<hex>" or "bytes:<size>"). ``trust_checkpoints`` (the seal): a
        checkpoint file its checkpoint.json lists with this size takes its sha256 from there, unread
        (the committing rank hashed it; every rank's RNG file and done mark would be read again)."""
        ckpts = self._p(self.LATEST).parent.name + "/"
        known = _CheckpointDigests(self._p(self.LATEST).parent) if trust_checkpoints else None
        out: Dict[str, Tuple[str, str]] = {}
        for rel, kind, entry in walk(self.path):
            if rel == self.MANIFEST or (kind == "file" and self._late_log(rel)):
                continue
            try:
                if kind == "file" and rel.startswith(ckpts):
                    size = entry.stat(follow_symlinks=False).st_size
                    sha = (known.get(rel[len(ckpts):], size) if known is not None else None) \
                        if size <= CHECKPOINT_HASHED_BYTES else None
                    out[rel] = ("checkpoint", f"sha256:{sha or file_sha256(Path(entry.path))}"
                                if size <= CHECKPOINT_HASHED_BYTES else f"bytes:{size}")
                elif kind == "file":
                    out[rel] = ("file", file_sha256(Path(entry.path)))
                elif kind == "link":
                    out[rel] = ("link", os.readlink(entry.path))
                else:
                    out[rel] = (kind, "")
            except FileNotFoundError:  # gone while walked (a write of an atomic file finishing)
                continue
        return out

    def _late_log(self, rel: str) -> bool:
        """wandb's own debug logs (wandb/<run>/logs/): its service process may still append to them
        after the run ended and was sealed; they are not run data."""
        parts = rel.split("/")
        return len(parts) > 2 and parts[0] == self.WANDB and "logs" in parts[1:-1]

    def _seal_mark(self) -> Path:
        return self.path.parent / SweepDir.SEALS / f"{self.path.name}.json"

    def seal_mark(self) -> Optional[Dict[str, Any]]:
        """The mark the run's seal left beside it (sealed, manifest_sha256), or None: never sealed
        (or reopened by ``launcher resume`` since)."""
        found = atomic.read_json(self._seal_mark())
        return found if isinstance(found, dict) and "due" not in found else None

    def _snapshot_digest(self) -> Optional[Dict[str, Any]]:
        """The shared code snapshot this run executes (outside the run dir): one digest of its tree."""
        path = self.snapshot().get("path")
        if not path or not Path(path).is_dir():
            return None
        return {"path": str(path), "sha256": tree_sha256(Path(path)), "digest": TREE_DIGEST}

    def seal(self) -> Dict[str, Any]:
        """manifest.json over everything in the run dir and the code snapshot's digest, then every file
        read-only (a symlink's target is never touched). Once: an existing manifest is never rewritten,
        and a run sealed before whose manifest is gone (its mark) is never sealed again, nor its status
        recorded (returns {}: a new seal would hide what changed; ``verify`` reports it)."""
        mpath = self._p(self.MANIFEST)
        existing = atomic.read_json(mpath)
        if existing:
            return existing
        if self._unsealed_since():
            return {}
        self.adopt_shared()  # a run that never started holds them too once sealed
        tree = self._tree(trust_checkpoints=True)
        manifest = {"run_dir": str(self.path), "sealed": now_iso(), "status": self.status().state.value,
                    "version": MANIFEST_VERSION,
                    "files": {rel: d for rel, (kind, d) in tree.items() if kind == "file"},
                    "links": {rel: d for rel, (kind, d) in tree.items() if kind == "link"},
                    "dirs": sorted(rel for rel, (kind, _) in tree.items() if kind == "dir"),
                    "special": {rel: kind for rel, (kind, _) in tree.items() if kind in ("other", "unreadable")},
                    "checkpoint_files": {rel: d for rel, (kind, d) in tree.items() if kind == "checkpoint"},
                    "snapshot": self._snapshot_digest(),
                    "checkpoints": [p.name for p in self.checkpoints()], "latest": self._latest_name()}
        text = json.dumps(manifest, indent=2, sort_keys=True, default=str) + "\n"
        if not _create_once(mpath, text):  # another process sealed it first: its manifest stands
            return atomic.read_json(mpath) or {}
        atomic.write_json(self._seal_mark(), {"run_dir": str(self.path), "sealed": manifest["sealed"],
                                              "manifest_sha256": hashlib.sha256(text.encode()).hexdigest()})
        for _, kind, entry in walk(self.path):
            if kind == "file":
                os.chmod(entry.path, entry.stat(follow_symlinks=False).st_mode & ~0o222)
        return manifest

    def _latest_name(self) -> Optional[str]:
        p = self._p(self.LATEST)
        try:
            return p.read_text().strip() if p.is_file() and not p.is_symlink() else None
        except OSError:
            return None

    def _unsealed_since(self) -> bool:
        """Sealed once (its mark says so), and its manifest is gone."""
        return self.seal_mark() is not None and not self._p(self.MANIFEST).exists()

    def lost_seal(self) -> Optional[str]:
        """Why a run without its manifest was sealed or started all the same (its manifest, or its
        status.json, removed since: it must not read as pending), cheaply (nothing hashed); None when
        nothing says so."""
        if self._p(self.MANIFEST).exists():
            return None
        mark = self.seal_mark()
        if mark is not None:
            return f"{self.MANIFEST} missing: the run was sealed {mark.get('sealed')} ({self._seal_mark()})"
        started = self._started()
        if started and not self._p(self.STATUS).exists():
            return f"{self.STATUS} missing although the run started ({', '.join(started)} exist)"
        return None

    def _started(self) -> List[str]:
        """What only a started job writes (after its first status): metrics, checkpoints."""
        return [n for n in (self.METRICS, self.LATEST) if self._p(n).exists() or self._p(n).is_symlink()]

    def verify(self) -> List[str]:
        """What no longer matches the seal (empty = intact): a file, symlink, directory or checkpoint
        changed, missing or added, ``latest`` re-pointed, the code snapshot changed or holding a
        symlink; the manifest missing for a finished run or one sealed before (its mark), or not the
        one sealed; status.json missing for a run that started. An unfinished, unsealed run is intact
        by definition, and so is a finished one whose seal is due (seal_due: its job's end seals it)."""
        manifest = atomic.read_json(self._p(self.MANIFEST))
        mark = self.seal_mark()
        if not isinstance(manifest, dict) or not manifest:
            lost = self.lost_seal()
            if lost or not self.is_final():
                return [lost] if lost else []
            return [] if self.seal_due() else [f"{self.MANIFEST} missing for a finished run"]
        problems = []
        if mark is not None and mark.get("manifest_sha256") != file_sha256(self._p(self.MANIFEST)):
            problems.append(f"{self.MANIFEST} is not the manifest the run was sealed with {mark.get('sealed')}")
        names, latest = [p.name for p in self.checkpoints()], self._latest_name()
        if "links" in manifest:
            problems += _tree_problems(_sealed_tree(manifest), self._tree(), manifest, names, latest)
        else:  # a manifest of an older launcher: files only (links followed), checkpoints by name
            now = self._legacy_files()
            sealed = manifest.get("files", {})
            problems += [f"{rel} changed" for rel, digest in sealed.items() if rel in now and now[rel] != digest]
            problems += [f"{rel} missing" for rel in sealed if rel not in now]
            problems += [f"{rel} added after the seal" for rel in now if rel not in sealed]
            problems += _checkpoint_problems(manifest, names, latest)[0]
        snap = manifest.get("snapshot")
        if snap:
            path = Path(snap["path"])
            if not path.is_dir():
                problems.append(f"code snapshot {path} missing")
            else:
                digest, links = _tree_digest(path)
                if snap.get("digest") != TREE_DIGEST:
                    digest = _legacy_tree_sha256(path)
                if digest != snap["sha256"]:
                    problems.append(f"code snapshot {path} changed")
                problems += [f"code snapshot {path} holds a symlink {rel} -> {target} (a snapshot never does)"
                             for rel, target in links.items()]
        return problems

    def _legacy_files(self) -> Dict[str, str]:
        """The files a manifest of an older launcher hashed (symlinks followed; no checkpoint, no *.tmp)."""
        ckpts = self._p(self.LATEST).parent
        return {str(p.relative_to(self.path)): file_sha256(p) for p in sorted(self.path.rglob("*"))
                if p.is_file() and p.name != self.MANIFEST and not p.name.endswith(".tmp")
                and ckpts not in p.parents and not self._late_log(str(p.relative_to(self.path)))}


MANIFEST_VERSION = 2  # 2: symlinks, directories and checkpoint files sealed too (1: files only)
TREE_DIGEST = 2  # tree_sha256's scheme (2: files, symlinks as links, directories); 1: files only
CHECKPOINT_HASHED_BYTES = 1 << 20  # larger checkpoint files are sealed by size (checkpoint.json: their sha256)


def walk(root: Path) -> Iterator[Tuple[str, str, os.DirEntry]]:
    """Everything under ``root``, depth first and sorted, never following a symlink: (relative path,
    kind, entry), kind one of file, link, dir, other (a fifo, a socket), unreadable (a directory that
    cannot be listed). What vanishes while walked is left out."""
    def below(top: str, prefix: str) -> Iterator[Tuple[str, str, os.DirEntry]]:
        try:
            with os.scandir(top) as it:
                entries = sorted(it, key=lambda e: e.name)
        except (FileNotFoundError, NotADirectoryError):
            return
        for e in entries:
            rel = prefix + e.name
            try:
                kind = ("link" if e.is_symlink() else "dir" if e.is_dir(follow_symlinks=False)
                        else "file" if e.is_file(follow_symlinks=False) else "other")
            except FileNotFoundError:
                continue
            if kind == "dir":
                try:
                    os.scandir(e.path).close()
                except PermissionError:
                    kind = "unreadable"
            yield rel, kind, e
            if kind == "dir":
                yield from below(e.path, rel + "/")

    yield from below(str(root), "")


def _tree_digest(root: Path) -> Tuple[str, Dict[str, str]]:
    """(tree_sha256 of ``root``, its symlinks: rel -> target)."""
    h = hashlib.sha256()
    links: Dict[str, str] = {}
    for rel, kind, entry in walk(root):
        name = os.fsencode(rel)
        if kind == "file":
            h.update(b"f\0" + name + b"\0" + file_sha256(Path(entry.path)).encode() + b"\n")
        elif kind == "link":
            links[rel] = os.readlink(entry.path)
            h.update(b"l\0" + name + b"\0" + os.fsencode(links[rel]) + b"\n")
        else:
            h.update(kind[0].encode() + b"\0" + name + b"\n")
    return h.hexdigest(), links


class Unreadable(ValueError):
    """A file of a run dir that is there but does not hold what it should (junk, binary, another
    shape): the message names the file and why; ``path``: the file."""

    def __init__(self, why: str, path: Optional[Path] = None) -> None:
        super().__init__(why)
        self.path = path


def _record(path: Path) -> Optional[Dict[str, Any]]:
    """The JSON object ``path`` holds (None: no such file); Unreadable for anything else."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise Unreadable(f"{path.name} cannot be read ({e.strerror or e})", path) from None
    try:
        found = json.loads(data)
    except ValueError:  # not JSON, or not UTF-8 text at all
        raise Unreadable(f"{path.name} is not JSON", path) from None
    if not isinstance(found, dict):
        kind = {list: "list", str: "string", bool: "boolean", type(None): "null"}.get(type(found), "number")
        raise Unreadable(f"{path.name} holds a JSON {kind}, not an object", path)
    return found


def _yaml_mapping(path: Path) -> Dict[str, Any]:
    """The YAML mapping ``path`` holds ({} for an empty file); FileNotFoundError where there is none,
    Unreadable for anything else."""
    try:
        text = path.read_text()
    except UnicodeDecodeError:
        raise Unreadable(f"{path.name} is not text", path) from None
    try:
        found = yamlio.load(text)
    except yaml.YAMLError as e:  # a python/object tag, a syntax error, aliases past the bound
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise Unreadable(f"{path.name} is not a plain YAML mapping ({first})", path) from None
    if found is None:
        return {}
    if not isinstance(found, dict):
        raise Unreadable(f"{path.name} holds a YAML {type(found).__name__}, not a mapping", path)
    return found


def _object_lines(path: Path) -> List[Dict[str, Any]]:
    """The JSON objects of a JSON-lines file, one a line; lines that are not one (junk, a line being
    written) are skipped."""
    rows = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def tree_sha256(root: Path) -> str:
    """One digest of everything under ``root``: each file's relative path and content, each symlink's
    path and target (never followed), each directory's path."""
    return _tree_digest(Path(root))[0]


def _legacy_tree_sha256(root: Path) -> str:
    """tree_sha256 as an older launcher computed it (files only, symlinks followed): its manifests."""
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        if p.is_file():
            h.update(str(p.relative_to(root)).encode() + b"\0" + file_sha256(p).encode())
    return h.hexdigest()


_KIND = {"file": "file", "link": "symlink", "dir": "directory", "other": "special file",
         "unreadable": "unreadable directory", "checkpoint": "checkpoint file"}


def _sealed_tree(manifest: Dict[str, Any]) -> Dict[str, Tuple[str, str]]:
    """What a manifest sealed, in RunDir._tree's shape."""
    out: Dict[str, Tuple[str, str]] = {rel: ("dir", "") for rel in manifest.get("dirs", [])}
    out.update({rel: (kind, "") for rel, kind in manifest.get("special", {}).items()})
    out.update({rel: ("file", d) for rel, d in manifest.get("files", {}).items()})
    out.update({rel: ("link", d) for rel, d in manifest.get("links", {}).items()})
    out.update({rel: ("checkpoint", d) for rel, d in manifest.get("checkpoint_files", {}).items()})
    return out


def _tree_problems(sealed: Dict[str, Tuple[str, str]], now: Dict[str, Tuple[str, str]],
                   manifest: Dict[str, Any], names: List[str], latest: Optional[str]) -> List[str]:
    """What differs between a sealed tree and the run dir now (``names``: its checkpoints, ``latest``:
    what checkpoints/latest names): one line per path, one per checkpoint added or missing (not one
    per file in it), one for ``latest`` re-pointed."""
    problems, whole = _checkpoint_problems(manifest, names, latest)
    repointed = manifest.get("latest") != latest
    for rel in sorted(set(sealed) | set(now)):
        if any(rel == w or rel.startswith(w + "/") for w in whole) or (rel == RunDir.LATEST and repointed):
            continue
        was, got = sealed.get(rel), now.get(rel)
        if was == got:
            continue
        if got is None:
            if not rel.endswith(".tmp"):  # an atomic write's temporary file, sealed as it was being renamed
                plain = was[0] in ("file", "checkpoint")
                problems.append(f"{rel} missing" + ("" if plain else f" (a {_KIND[was[0]]})"))
        elif was is None:
            what = "" if got[0] in ("file", "checkpoint") else f" (a {_KIND[got[0]]}" + (
                f" to {got[1]})" if got[0] == "link" else ")")
            problems.append(f"{rel} added after the seal{what}")
        elif was[0] != got[0]:
            problems.append(f"{rel} changed (a {_KIND[was[0]]} when sealed, a {_KIND[got[0]]} now)")
        elif got[0] == "link":
            problems.append(f"{rel} changed (a symlink to {got[1]}, sealed pointing to {was[1]})")
        else:
            problems.append(f"{rel} changed")
    return problems


def is_checkpoint_problem(problem: str) -> bool:
    """Whether a problem ``RunDir.verify`` names is about checkpoints/ alone (a checkpoint added,
    missing or changed, ``latest`` re-pointed): what a checkpoint's own checkpoint.json decides at
    resume (launcher.checkpoint_manifest: fall back to an intact one, or refuse naming the file)."""
    first = problem.split(" ", 1)[0]  # the path (or "checkpoint <name>") a problem starts with
    return first in ("checkpoint", "checkpoints") or first.startswith("checkpoints/")


def _checkpoint_problems(manifest: Dict[str, Any], names: List[str],
                         latest: Optional[str]) -> Tuple[List[str], List[str]]:
    """(problems, the checkpoint dirs they cover whole): checkpoints added or missing versus the
    manifest's names, ``latest`` re-pointed."""
    sealed = list(manifest.get("checkpoints") or [])
    problems = [f"checkpoint {n} missing" for n in sealed if n not in names]
    problems += [f"checkpoint {n} added after the seal" for n in names if n not in sealed]
    if "latest" in manifest and manifest["latest"] != latest:
        problems.append(f"checkpoints/latest re-pointed: {manifest['latest']} when sealed, {latest} now")
    return problems, [f"checkpoints/{n}" for n in {*sealed, *names} if (n in sealed) != (n in names)]


class _CheckpointDigests:
    """The sha256 each checkpoint's checkpoint.json records per file, read once per checkpoint."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.by_ckpt: Dict[str, Dict[str, Any]] = {}

    def get(self, rel: str, size: int) -> Optional[str]:
        """The recorded sha256 of ``<checkpoint>/<file>`` (relative to checkpoints/) if its recorded
        size is ``size``; None where nothing (or something else) is recorded."""
        ckpt, _, file = rel.partition("/")
        if not file:
            return None
        if ckpt not in self.by_ckpt:
            found = atomic.read_json(self.root / ckpt / "checkpoint.json")
            files = found.get("files") if isinstance(found, dict) else None
            self.by_ckpt[ckpt] = files if isinstance(files, dict) else {}
        d = self.by_ckpt[ckpt].get(file)
        ok = isinstance(d, dict) and d.get("size") == size and isinstance(d.get("sha256"), str)
        return d["sha256"] if ok else None


def _names(directory: Path) -> List[str]:
    """The names in ``directory`` (one listing; none where it does not exist)."""
    try:
        return os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return []


def _put_json(path: Path, obj: Any) -> None:
    """A node-side record written by many ranks at once (each its own file), replaced whole (a reader
    sees the old or the new one) but not flushed: one create, one write and one rename each, no fsync
    per rank (thousands at once in one directory). A crash may lose it; the next attempt writes it
    again."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        f = open(tmp, "w")
    except FileNotFoundError:  # its folder (ranks/) not made yet
        path.parent.mkdir(parents=True, exist_ok=True)
        f = open(tmp, "w")
    with f:
        f.write(json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")
    os.replace(tmp, path)


def _create_once(path: Path, text: str) -> bool:
    """``path`` written with ``text`` if it does not exist (False: it does; two processes sealing at
    once: one manifest, never a second over it). Flushed before it appears."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.seal")
    with open(tmp, "x") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    try:
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    except OSError:  # no hard links on this file system
        if path.exists():
            return False
        os.replace(tmp, path)
        return True
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)


def _points(path: Path) -> Dict[str, Any]:
    """A sweep's per-point record, read once per version of the file (listing a sweep's runs asks for
    every point: the file is parsed once, not once per run)."""
    try:
        st = path.stat()
    except OSError:
        return {}
    return _points_at(str(path), st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=8)
def _points_at(path: str, mtime_ns: int, size: int) -> Dict[str, Any]:
    return atomic.read_json(path, {}) or {}


def file_sha256(path: Path) -> str:
    """sha256 of one file, streamed 1 MiB at a time (checkpoints may be far larger than memory)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


class SweepDir:
    """``<runs_root>/<sweep_id>/``: sweep.json, the code snapshot, submitit's folder, and the runs
    (``<index>/``, staged as ``.<index>.partial`` until submitted)."""

    SWEEP, CODE, SUBMITIT, SHARED, POINTS = "sweep.json", "code", ".submitit", "shared", "points.json"
    SEALS = ".seals"  # <index>.json: each sealed run's mark (RunDir.seal_mark)
    # sweep=asha: every point's reports at the rungs, the decisions and the measured segments, one a line
    # (launcher.features.asha.rungs), appended under the lock beside it
    RUNGS, RUNGS_LOCK = "rungs.jsonl", ".rungs.lock"

    def __init__(self, path: Union[str, Path]) -> None:
        self.path = Path(path)

    @classmethod
    def new(cls, runs_root: Path) -> SweepDir:
        return cls(Path(runs_root) / (time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(2)))

    @property
    def sweep_id(self) -> str:
        return self.path.name

    @property
    def code_dir(self) -> Path:
        return self.path / self.CODE

    @property
    def submitit_folder(self) -> Path:
        return self.path / self.SUBMITIT

    def run_id(self, index: Union[int, str]) -> str:
        return f"{self.sweep_id}-{index}"

    @staticmethod
    def index_of(run_id: str) -> int:
        """The run index a run id (``<sweep_id>-<index>``) ends with."""
        return int(run_id.rsplit("-", 1)[1])

    def run(self, index: int) -> RunDir:
        return RunDir(self.path / str(index))

    def shared(self) -> RunDir:
        """The files every run of the sweep holds alike (RunDir.SHARED_FILES), written once, linked
        into each run (RunDir.adopt_shared)."""
        return RunDir(self.path / self.SHARED)

    def staging(self, index: int) -> RunDir:
        """Invisible (dot name) until complete and submitted."""
        return RunDir(self.path / f".{index}.partial")

    def publish(self, index: int) -> RunDir:
        """Rename the staged run into place (atomic): the run becomes visible whole."""
        staged, final = self.staging(index), self.run(index)
        if staged.path.exists():
            os.replace(staged.path, final.path)
        return final

    def extend(self, meta: Dict[str, Any]) -> None:
        """sweep.json once a batch of runs is in the sweep (written by its first batch): ``runs`` and
        ``job_ids`` added to the ones recorded (a multirun's later batches join its first one's
        sweep), the rest as ``meta`` says, ``created`` kept."""
        old = self.read() or {}
        runs = sorted(dict.fromkeys([*old.get("runs", []), *meta.get("runs", [])]),
                      key=self.index_of)
        job_ids = list(dict.fromkeys([*old.get("job_ids", []), *meta.get("job_ids", [])]))
        atomic.write_json(self.path / self.SWEEP, {**old, **meta, "runs": runs, "job_ids": job_ids,
                                                   "num_runs": len(runs), "created": old.get("created") or now_iso()})

    def add_points(self, points: Dict[str, Any]) -> None:
        """The per-point record (seeds, overrides by run index) with these points added. Replaced whole
        (never rewritten in place): runs of the sweep's earlier batches may be reading it."""
        path = self.path / self.SHARED / self.POINTS
        atomic.write_json(path, {**(atomic.read_json(path) or {}), **points}, visible=True)

    def read(self) -> Optional[Dict[str, Any]]:
        return atomic.read_json(self.path / self.SWEEP)

    @contextlib.contextmanager
    def rungs_lock(self) -> Iterator[None]:
        """The sweep's scheduler lock (fcntl, on the shared file system): one writer decides a rung."""
        with file_lock(self.path / self.RUNGS_LOCK):
            yield

    def add_rung_rows(self, rows: List[Dict[str, Any]]) -> None:
        """Rows of the scheduler's record (call under ``rungs_lock``), flushed to the disk."""
        with open(self.path / self.RUNGS, "a") as f:
            for row in rows:
                f.write(json.dumps({"time": now_iso(), **row}) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def add_report(self, point: int, rung: int, step: int, value: Optional[float], *, attempt: int, seconds: float,
                   startup_s: float, from_step: int, world: int) -> None:
        """A point's report at a rung (asha) or generation (pbt): its objective and the segment it measured."""
        self.add_rung_rows([{"kind": "report", "point": point, "rung": rung, "step": step, "value": value,
                             "attempt": attempt, "seconds": round(seconds, 3), "startup_s": round(startup_s, 3),
                             "from_step": from_step, "world": world}])

    def rung_rows(self) -> List[Dict[str, Any]]:
        p = self.path / self.RUNGS
        return _object_lines(p) if p.exists() else []

    def runs(self) -> List[RunDir]:
        """Every archived run of the sweep (a dir counts once its run.json exists)."""
        if not self.path.is_dir():
            return []
        dirs = sorted(self.path.iterdir(), key=lambda p: (len(p.name), p.name))
        return [RunDir(d) for d in dirs if not d.name.startswith(".") and (d / RunDir.RUN).is_file()]


def sweeps(runs_root: Path) -> List[SweepDir]:
    root = Path(runs_root)
    if not root.is_dir():
        return []
    return [SweepDir(d) for d in sorted(root.iterdir()) if d.is_dir() and not d.name.startswith(".")]


def runs(runs_root: Path, sweep: Optional[str] = None) -> Iterator[RunDir]:
    """Every archived run under runs_root (or of one sweep)."""
    for sd in ([SweepDir(Path(runs_root) / sweep)] if sweep else sweeps(runs_root)):
        yield from sd.runs()
