"""RunDir: every file of a run directory by name, its status transitions and its seal.

As submitit's JobPaths does for a job, RunDir names each file of ``<runs_root>/<sweep_id>/<index>/``
once; the launcher (before submission), the job on the node, ``launcher cancel`` and the recipes
(through ``ctx.rundir``) all write through it. ``FILES`` is the table docs/archive.md lists; a recipe's
own files (a DeepSpeed config, a benchmark's results) are its contract's (launcher.config.recipe_contract).
SweepDir does the same for the sweep directory that holds the runs.

A run becomes final once (completed, failed, cancelled, timeout): ``finish`` records the outcome and
seals the dir (manifest.json over every file, symlink, directory and checkpoint, then every file
read-only); a later ``finish`` or ``set_status`` changes nothing. Inside a job, ``finish_in_job``
records it and leaves the seal due, for after the job (docs/archive.md, "The seal").
"""
from __future__ import annotations

import contextlib
import json
import os
import secrets
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple, Union

from launcher.archive import atomic
from launcher.run.attempts import RESTARTED_BY_SCHEDULE, RESTARTED_BY_USER, Attempts
from launcher.run.checkpoints import Checkpoints, is_checkpoint_problem
from launcher.run.io import (
    SweepNames,
    Unreadable,
    file_lock,
    file_sha256,
    now_iso,
    parse_iso,
    read_object_lines,
    read_record,
)
from launcher.run.reads import Reads
from launcher.run.sealing import Sealing, tree_sha256, walk
from launcher.run.transitions import Transitions
from launcher.run.waves_record import WavePlan
from launcher.run.writes import Writes

# what the launcher's other modules import from here (the run dir's parts live in launcher/run/)
__all__ = ["FILES", "RESTARTED_BY_SCHEDULE", "RESTARTED_BY_USER", "RunDir", "SweepDir", "Unreadable", "file_lock",
           "file_sha256", "is_checkpoint_problem", "now_iso", "parse_iso", "read_record", "runs", "sweeps",
           "tree_sha256", "walk"]


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
    ("checks.json", "launcher", "launcher.run.checks_record.ChecksRecord: what was checked before the run was "
     "queued (by: launch, the rule table and the recipe's planner; hydra_app, the plugin's sweep keys), forced (the "
     "warnings submit.force=true let through, as printed), advice (the rules' advice printed)"),
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
    ("status.json", "launcher, job", "launcher.run.status.RunStatus: status (pending, running, completed, failed, "
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
     "the step (launcher.run.checkpoint_manifest: verified before a resume)"),
    ("checkpoints/.universal_<n>/", "recipe (rank 0)", "while a resume on another layout loads the checkpoint "
     "of step <n> whose save named its universal form in the engine's own files: that form written out from "
     "them; deleted once every rank loaded and checked it"),
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




class RunDir(Writes, Checkpoints, Attempts, Reads, Transitions, Sealing):
    RUN, CONFIG, OVERRIDES, SEEDS, PLAN = "run.json", "config.yaml", "overrides.yaml", "seeds.json", "plan.json"
    CHECKS = "checks.json"
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
    # the universal form a reshard writes from a checkpoint's linked files, while it loads (training.universal_links)
    RESHARD_SOURCE = "checkpoints/.universal_<n>"
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



class SweepDir(SweepNames):
    """``<runs_root>/<sweep_id>/``: sweep.json, the code snapshot, submitit's folder, and the runs
    (``<index>/``, staged as ``.<index>.partial`` until submitted)."""

    SWEEP, CODE, SUBMITIT = "sweep.json", "code", ".submitit"  # (SHARED, POINTS, SEALS: SweepNames)
    # sweep=asha: every point's reports at the rungs, the decisions and the measured segments, one a line
    # (launcher.features.asha.rungs), appended under the lock beside it
    RUNGS, RUNGS_LOCK = "rungs.jsonl", ".rungs.lock"
    # resume, retry and a cluster.elastic decision claim a run's next attempt under this lock: one at a time
    CLAIMS_LOCK = ".claims.lock"
    # a launch's journal while it stages and submits (launcher.submit.interrupted repairs a killed one)
    LAUNCH_JOURNAL = ".launch.json"
    # a sweep past the scheduler's room: the points its wave jobs queue later (launcher.submit.waves), under
    # the lock beside it (a wave job, a repair, a cancel: one at a time)
    WAVES, WAVES_LOCK = "waves.json", ".waves.lock"

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
        atomic.write_json(path, {**(atomic.read_json(path) or {}), **points}, visible=True, compact=True)

    def read(self) -> Optional[Dict[str, Any]]:
        return atomic.read_json(self.path / self.SWEEP)

    @contextlib.contextmanager
    def claims_lock(self) -> Iterator[None]:
        """Held while a command claims its runs' next attempts (launcher.submit.resume): one writer at a time."""
        with file_lock(self.path / self.CLAIMS_LOCK):
            yield

    def waves(self) -> Optional[WavePlan]:
        """The sweep's plan of waves (None: it was queued whole)."""
        return WavePlan.from_json(atomic.read_json(self.path / self.WAVES))

    def write_waves(self, plan: WavePlan) -> None:
        atomic.write_json(self.path / self.WAVES, plan.to_json())

    @contextlib.contextmanager
    def waves_lock(self) -> Iterator[None]:
        with file_lock(self.path / self.WAVES_LOCK):
            yield

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
        return read_object_lines(p) if p.exists() else []

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
