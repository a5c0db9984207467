"""N ranks of one job simulated in this process, one after another, against a counting file-system
layer: what each rank's node-side code asks of the shared run dir (tests/unit/test_rundir_scale.py,
benchmarks/rundir_scale.py).

The layer wraps the os calls the launcher's file work reaches (directly or through pathlib, shutil,
tempfile, io.open) and counts, per simulated rank and phase, the calls on paths under the runs root
(``ops``: open, stat, scandir, listdir, mkdir, rename/replace, link, unlink, rmdir, chmod, fsync,
utime; a DirEntry's stat counts as a stat) and the directory entries listings returned (``dirents``).
Nothing here starts a process: the scheduler's ``scontrol`` is a fake that counts its calls, and
the job environment (a Slurm task's variables, read by its backend) set per rank.

Phases, each rank in turn (rank 0 first, as the ranks of a real job start within seconds):

- ``startup``: launcher.runtime.attempt.attempt() (wait for the run dir, settings, the distributed
  environment with a master host DNS does not know, rank 0's shared files, the rank record, the
  node's topology from its local rank 0) and rank 0's status running and environment records;
- ``watch``: 16 looks of each rank's peer watch at steady state (no rank failed);
- ``failure``: one rank records an error, every other rank's watch looks once and must see it;
- ``checkpoint``: a save through launcher.training.checkpoint's public API (Checkpoint, synchronous)
  by every rank, the last one committing it;
- ``resume``: every rank resumes from that checkpoint (Checkpoint.resume: rank 0 checks the names and
  sizes and offers it, each rank hashes its share of the files; the broadcast and the gather are
  answered in this process, where no rank finds a problem);
- ``hang``: every rank's hang watch dumps its stacks; then the one that claimed the gathering gathers,
  the others wait for hang.json.
"""
from __future__ import annotations

import builtins
import io
import json
import os
import socket
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional

PHASES = ("startup", "watch", "failure", "checkpoint", "resume", "hang")
RANKS_PER_NODE = 8
_PATH_CALLS = ("stat", "lstat", "mkdir", "rename", "replace", "link", "unlink", "remove", "rmdir",
               "chmod", "utime", "open")


@dataclass
class Counts:
    """ops[phase][rank] and dirents[phase][rank]; scontrol[rank]: the scheduler asked."""

    ops: Dict[str, Dict[int, int]] = field(default_factory=lambda: defaultdict(lambda: defaultdict(int)))
    dirents: Dict[str, Dict[int, int]] = field(default_factory=lambda: defaultdict(lambda: defaultdict(int)))
    kinds: Dict[str, Dict[str, int]] = field(default_factory=lambda: defaultdict(lambda: defaultdict(int)))
    scontrol: Dict[int, int] = field(default_factory=lambda: defaultdict(int))
    # bytes of files read to hash them (checkpoint digests), per phase and rank; each rank's own
    # checkpoint bytes (the files its done mark names, and the mark)
    hashed: Dict[str, Dict[int, int]] = field(default_factory=lambda: defaultdict(lambda: defaultdict(int)))
    own: Dict[int, int] = field(default_factory=lambda: defaultdict(int))

    def per_rank(self, phase: str, world: int) -> List[int]:
        return [self.ops[phase].get(r, 0) for r in range(world)]

    def dirents_per_rank(self, phase: str, world: int) -> List[int]:
        return [self.dirents[phase].get(r, 0) for r in range(world)]


class _Entry:
    """A DirEntry whose stat() is counted (is_dir/is_file come from the listing's d_type)."""

    def __init__(self, entry: os.DirEntry, layer: Layer) -> None:
        self._e, self._layer = entry, layer
        self.name, self.path = entry.name, entry.path

    def stat(self, *, follow_symlinks: bool = True):
        self._layer.hit("stat", self.path)
        return self._e.stat(follow_symlinks=follow_symlinks)

    def is_dir(self, *, follow_symlinks: bool = True) -> bool:
        return self._e.is_dir(follow_symlinks=follow_symlinks)

    def is_file(self, *, follow_symlinks: bool = True) -> bool:
        return self._e.is_file(follow_symlinks=follow_symlinks)

    def is_symlink(self) -> bool:
        return self._e.is_symlink()

    def inode(self) -> int:
        return self._e.inode()

    def __fspath__(self) -> str:
        return self.path


class _Listing:
    def __init__(self, it: Any, layer: Layer, counted: bool) -> None:
        self._it, self._layer, self._counted = it, layer, counted

    def __enter__(self) -> _Listing:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._it.close()

    def close(self) -> None:
        self._it.close()

    def __iter__(self) -> Iterator[_Entry]:
        for e in self._it:
            if self._counted:
                self._layer.dirent()
            yield _Entry(e, self._layer)


class Layer:
    """The counting layer: ``with layer: ...`` patches, ``layer.rank``/``layer.phase`` say who asks."""

    def __init__(self, root: Path) -> None:
        self.root = os.path.abspath(str(root)) + os.sep
        self.counts = Counts()
        self.rank: Optional[int] = None
        self.phase = ""
        self._saved: List[Any] = []

    def _ours(self, path: Any, kwargs: Dict[str, Any]) -> bool:
        if kwargs.get("dir_fd") is not None:  # shutil.rmtree's fd walk: under the dir it opened
            return True
        if isinstance(path, int):  # a descriptor: one the code under test opened
            return True
        try:
            p = os.fspath(path)
        except TypeError:
            return False
        p = os.fsdecode(p)
        return os.path.abspath(p).startswith(self.root) or os.path.abspath(p) + os.sep == self.root

    def hit(self, kind: str, path: Any = None, kwargs: Optional[Dict[str, Any]] = None) -> None:
        if self.rank is None or (path is not None and not self._ours(path, kwargs or {})):
            return
        self.counts.ops[self.phase][self.rank] += 1
        self.counts.kinds[self.phase][kind] += 1

    def dirent(self) -> None:
        if self.rank is not None:
            self.counts.dirents[self.phase][self.rank] += 1

    def _patch(self, owner: Any, name: str, new: Callable) -> None:
        self._saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, new)

    def __enter__(self) -> Layer:
        for name in _PATH_CALLS:
            real = getattr(os, name)

            def wrapped(path, *a, _real=real, _name=name, **kw):
                self.hit(_name, path, kw)
                return _real(path, *a, **kw)
            self._patch(os, name, wrapped)
        real_fsync, real_scandir, real_listdir = os.fsync, os.scandir, os.listdir

        def fsync(fd):
            self.hit("fsync")
            return real_fsync(fd)

        def scandir(path=".", *a, **kw):
            counted = self._ours(path, kw)
            if counted:
                self.hit("scandir", path, kw)
            return _Listing(real_scandir(path, *a, **kw), self, counted and self.rank is not None)

        def listdir(path=".", *a, **kw):
            names = real_listdir(path, *a, **kw)
            if self._ours(path, kw) and self.rank is not None:
                self.hit("listdir", path, kw)
                for _ in names:
                    self.dirent()
            return names
        real_open = io.open

        def open_(file, *a, **kw):
            if not isinstance(file, int):
                self.hit("open", file, {})
            return real_open(file, *a, **kw)
        self._patch(os, "fsync", fsync)
        self._patch(os, "scandir", scandir)
        self._patch(os, "listdir", listdir)
        self._patch(io, "open", open_)
        self._patch(builtins, "open", open_)
        return self

    def __exit__(self, *exc: Any) -> None:
        for owner, name, old in reversed(self._saved):
            setattr(owner, name, old)
        self._saved.clear()


def _hosts(world: int) -> List[str]:
    return [f"sim{n:04d}" for n in range((world + RANKS_PER_NODE - 1) // RANKS_PER_NODE)]


def _job_env(rank: int, world: int) -> Dict[str, str]:
    """A Slurm task's environment, as the Slurm backend reads it (launcher.backends.slurm.place)."""
    hosts = _hosts(world)
    return {"SUBMITIT_EXECUTOR": "slurm", "SLURM_JOB_ID": "4242", "SLURM_PROCID": str(rank),
            "SLURM_LOCALID": str(rank % RANKS_PER_NODE), "SLURM_NODEID": str(rank // RANKS_PER_NODE),
            "SLURM_JOB_NUM_NODES": str(len(hosts)), "SLURM_NTASKS": str(world),
            "SLURM_JOB_NODELIST": ",".join(hosts), "SLURMD_NODENAME": hosts[rank // RANKS_PER_NODE]}


def make_run(root: Path, world: int):
    """A sweep of one point as the launcher stages it: shared code and software records, the per-point
    seeds and overrides, config and run.json, status pending (not counted)."""
    from launcher.run.rundir import SweepDir
    from launcher.run.status import Status

    sweep = SweepDir(root / "S")
    shared = sweep.shared()
    shared.path.mkdir(parents=True)
    shared.write_code({"commit": "c"}, "", {"path": str(root / "code")})
    shared.write_software({"python": sys.version.split()[0]}, "")
    sweep.add_points({"0": {"seeds": {"seed": 1}, "overrides": {"overrides": [], "choices": {}}}})
    rd = sweep.run(0)
    rd.path.mkdir()
    rd.write_config({"cluster": {"backend": "local"}, "train": {"steps": 4}})
    rd.write_run({"run_id": "S-0", "layout": {}})
    rd.set_status(Status.pending)
    return rd


class _Ctx:
    """The part of RunContext the checkpointer uses."""

    attempt, device = 1, "cpu"

    def __init__(self, rd: Any, rank: int, world: int) -> None:
        self.rundir, self.rank, self.world_size = rd, rank, world

    def heartbeat(self, step: Optional[int] = None) -> None:
        pass


def simulate(root: Path, world: int, phases=PHASES) -> Counts:
    """Every phase for ranks 0..world-1 in turn; the counts."""
    from launcher.archive import topology
    from launcher.backends import slurm
    from launcher.runtime import attempt as attempt_mod, watchdog

    rd = make_run(Path(root), world)
    layer = Layer(root)
    saved_env = dict(os.environ)
    restore: List[Any] = []

    def patch(owner: Any, name: str, new: Any) -> None:
        restore.append((owner, name, getattr(owner, name)))
        setattr(owner, name, new)

    def getaddrinfo(host, *a, **kw):  # DNS does not know the node names (the scontrol fallback runs)
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    def scontrol(argv):  # the scheduler's answer, counted
        layer.counts.scontrol[layer.rank if layer.rank is not None else -1] += 1
        return f"NodeName={argv[3]} NodeAddr=10.0.0.1 State=ALLOCATED"

    patch(socket, "getaddrinfo", getaddrinfo)
    patch(slurm.limits, "run", scontrol)
    patch(topology, "gather", lambda: {"cpu": "simulated"})
    patch(attempt_mod, "process_start", lambda pid: 1)
    from launcher.run import checkpoint_manifest
    real_sha = checkpoint_manifest.file_sha256

    def file_sha256(path):  # the digests' reads, by rank
        if layer.rank is not None:
            layer.counts.hashed[layer.phase][layer.rank] += os.stat(path).st_size
        return real_sha(path)
    patch(checkpoint_manifest, "file_sha256", file_sha256)
    watches: Dict[int, Any] = {}
    try:
        with layer:
            for phase in phases:
                layer.phase = phase
                _PHASE[phase](rd, world, layer, watches, attempt_mod, watchdog)
    finally:
        layer.rank = None
        for owner, name, old in reversed(restore):
            setattr(owner, name, old)
        os.environ.clear()
        os.environ.update(saved_env)
    return layer.counts


def _startup(rd, world, layer, watches, attempt_mod, watchdog) -> None:
    def settings(rd):
        cluster = rd.config().get("cluster", {})
        return cluster.get("master_port"), cluster.get("env") or {}

    for rank in range(world):
        os.environ.update(_job_env(rank, world))
        layer.rank = rank
        with attempt_mod.attempt(rd, settings) as a:
            a.record_environment({"torch": "simulated"})
            a.running()
        layer.rank = None


def _watch(rd, world, layer, watches, attempt_mod, watchdog) -> None:
    looks = getattr(watchdog, "STATUS_EVERY", 16)
    for rank in range(world):
        layer.rank = rank
        w = watches[rank] = watchdog.Watch(rd, rank, world)
        w._born -= 60  # (what it looks for is recorded after it started)
        for _ in range(looks):
            assert _look(w) is None
    layer.rank = None


def _look(w) -> Optional[str]:
    if hasattr(w, "look"):
        return w.look()
    # an older launcher's watch: its look, inline
    failed = w.rd.failed_ranks(except_rank=w.rank, since=w._born)
    if failed:
        return f"{failed[0]} failed"
    return "cancelled" if w.rd.status().state.value == "cancelled" else None


def _failure(rd, world, layer, watches, attempt_mod, watchdog) -> None:
    failing = world // 2 + 1
    layer.rank = failing
    rd.write_rank_error(failing, "Traceback (most recent call last):\nRuntimeError: simulated\n")
    for rank in range(world):
        if rank != failing:
            layer.rank = rank
            assert _look(watches[rank]).startswith(f"rank_{failing} failed")
    layer.rank = None
    layer.phase, kept = "", layer.phase  # (not counted) the failure moved aside: the job goes on
    for p in list(rd.path.rglob(f"rank_{failing}.error")):
        p.unlink()
    layer.phase = kept


def _checkpoint(rd, world, layer, watches, attempt_mod, watchdog) -> None:
    import torch

    store = torch.distributed.HashStore()  # the job's store (not the file system): the ranks count the save there
    for rank in range(world):
        layer.rank = rank
        _checkpointer(rd, world, rank, store).save(2, [])
    layer.rank = None
    assert rd.latest_checkpoint() is not None, "the last rank's part did not commit the checkpoint"
    ckpt = rd.latest_checkpoint()
    for mark in ckpt.glob("done_rank_*"):  # (not counted: no rank is set)
        rank = int(mark.name.rsplit("_", 1)[1])
        files = json.loads(mark.read_text()).get("files") or {}
        layer.counts.own[rank] = mark.stat().st_size + sum(int(d["size"]) for d in files.values())


def _checkpointer(rd, world: int, rank: int, store: Any) -> Any:
    import torch
    from omegaconf import OmegaConf

    from launcher.training.checkpoint import Checkpoint

    checkpoint = {"every": 2, "keep": 2, "async_save": False}
    cfg = OmegaConf.create({"train": {"steps": 4, "fail_at_step": None, "fail_rank": 0, "fail_mode": "exception",
                                      "fail_attempt": None, "checkpoint": checkpoint}})
    torch.manual_seed(0)
    return Checkpoint(cfg, _Ctx(rd, rank, world), {"model": torch.nn.Linear(2, 2)}, async_save=False, store=store)


def _resume(rd, world, layer, watches, attempt_mod, watchdog) -> None:
    import torch
    import torch.distributed as dist

    offered: Dict[str, Any] = {}

    def broadcast(box, src):  # rank 0 (first) offers, the others receive its offer
        if layer.rank == src:
            offered["offer"] = box[0]
        else:
            box[0] = offered["offer"]

    def gather(out, found):  # every rank's findings: none found a problem here
        assert found == [], found
        out[:] = [[]] * len(out)

    fakes = {"is_initialized": lambda: True, "get_world_size": lambda: world,
             "broadcast_object_list": broadcast, "all_gather_object": gather}
    saved = {name: getattr(dist, name) for name in fakes}
    try:
        for name, fake in fakes.items():
            setattr(dist, name, fake)
        store = torch.distributed.HashStore()
        for rank in range(world):
            layer.rank = rank
            step, _ = _checkpointer(rd, world, rank, store).resume()
            assert step == 2, step
    finally:
        layer.rank = None
        for name, real in saved.items():
            setattr(dist, name, real)


def _hang(rd, world, layer, watches, attempt_mod, watchdog) -> None:
    if not hasattr(watchdog.Watch, "dump_stack"):
        return _old_hang(rd, world, layer, watches)
    gathers = {}
    for rank in range(world):
        layer.rank = rank
        w = watches[rank]
        w.hang_timeout_s, w.step = 5.0, 2
        gathers[rank] = w.dump_stack()
    assert sum(gathers.values()) == 1, gathers
    for rank in sorted(gathers, key=lambda r: not gathers[r]):  # the gatherer first
        layer.rank = rank
        finding = watches[rank].gather() if gathers[rank] else watches[rank].await_finding()
        assert finding is not None and finding["no_stack"] == []
    layer.rank = None


def _old_hang(rd, world, layer, watches) -> None:
    """An older launcher's hang watch, at its cheapest: every rank dumps, then reads every dump twice
    (once to count, once for the finding; a real hang repeats the count every 0.2 s until all are in)."""
    from launcher.runtime import stacks

    for rank in range(world):
        layer.rank = rank
        path = rd.stack_path(rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"# rank {rank}\n")
    for rank in range(world):
        layer.rank = rank
        assert len(rd.stacks()) == world
        finding = stacks.finding(rd.stacks(), world, 2, 5.0)
        if rd.hang() is None and not rd.is_final():
            rd.write_hang(finding)
    layer.rank = None


_PHASE = {"startup": _startup, "watch": _watch, "failure": _failure, "checkpoint": _checkpoint, "resume": _resume,
          "hang": _hang}


def table(results: Dict[int, Counts], phases=PHASES) -> str:
    """Per phase and N: the most ops one rank made, the median rank's, all ranks' total, the most
    dirents one rank listed, scontrol calls."""
    lines = ["| phase | N | max ops/rank | median ops/rank | total ops | max dirents/rank | total dirents |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for phase in phases:
        for world, c in sorted(results.items()):
            ops, de = sorted(c.per_rank(phase, world)), c.dirents_per_rank(phase, world)
            lines.append(f"| {phase} | {world} | {ops[-1]} | {ops[len(ops) // 2]} | {sum(ops)} | {max(de)} | "
                         f"{sum(de)} |")
    lines.append("")
    lines.append("| N | most bytes one rank hashed at commit | at resume | that rank's own bytes | all ranks hashed at "
                 "resume | the checkpoint's bytes |")
    lines.append("|---:|---:|---:|---:|---:|---:|")
    for world, c in sorted(results.items()):
        commit, resume = c.hashed["checkpoint"], c.hashed["resume"]
        worst = max(range(world), key=lambda r: max(commit.get(r, 0), resume.get(r, 0)))
        lines.append(f"| {world} | {max(commit.values(), default=0)} | {max(resume.values(), default=0)} | "
                     f"{c.own.get(worst, 0)} | {sum(resume.values())} | {sum(c.own.values())} |")
    lines.append("")
    lines.append("scontrol calls per job: " + ", ".join(f"N={w}: {sum(c.scontrol.values())}"
                                                        for w, c in sorted(results.items())))
    return "\n".join(lines)


def as_json(results: Dict[int, Counts]) -> str:
    return json.dumps({w: {p: {"ops": c.per_rank(p, w), "dirents": c.dirents_per_rank(p, w)} for p in PHASES}
                       for w, c in results.items()})
