"""cluster.pack=true: the points of a sweep group run as job steps of ONE allocation.

The pack's job (one sbatch job of cluster.pack_nodes nodes, whole nodes) runs ``PackRunner`` once, in
the batch step on its first node. It keeps a queue of the points (``pack-<job>.json`` in the sweep
dir: each point's state, step and nodes), starts each as a job step (``srun --exact``, its run's task
unpickled by ``python -m launcher.features.pack.runner STEP.pkl`` in every rank, as an array task would run
it), as many at once as the free CPUs, GPUs and memory of the nodes hold (``plan_starts``, pure: the
planner's per-rank memory estimate from plan.json), and starts the next as each ends (backfill).

Each point keeps its own run dir, attempts and seal, as an array task's: after its step the runner
decides its outcome as a batch script's teardown would (launcher.runtime.after_step: a point that died
without a word is started again within train.max_restarts, else failed) and seals it. A point's
requeue (a failure worth a restart) is this queue's, not the scheduler's: the point goes back in the
queue. A time limit drains the pack (every running point checkpoints) and requeues the whole job; a
preempted or requeued pack starts again with the points that are not final (each from its own
checkpoint). No torch here.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from launcher.backends.base import PACK_STEP_ENV, STEP_START_ENV
from launcher.runtime import job_start

PROCESS_OVERHEAD_BYTES = 512 << 20  # per rank beyond the planner's estimate: the interpreter, torch, buffers
POLL_S = 0.2


@dataclass(frozen=True)
class Need:
    """What one point asks of the allocation: ``nodes`` nodes, on each ``tasks`` ranks of
    ``cpus_per_task`` CPUs, a GPU each where ``gpus`` (True), ``mem_per_task`` bytes each (None:
    unknown, not counted): the planner's per-rank estimate is of the device a rank computes on, so it
    counts against the node's memory for a CPU point and against a GPU's (gpu_slots) for a GPU point."""

    nodes: int = 1
    tasks: int = 1
    cpus_per_task: int = 1
    gpus: bool = False
    mem_per_task: Optional[int] = None


@dataclass
class NodeFree:
    """What one node of the pack has free: CPUs, GPU slots (a GPU counts ``gpu_slots`` times when the
    estimate says that many ranks fit its memory), memory bytes (None: unknown)."""

    name: str
    cpus: int
    gpu_slots: int = 0
    mem: Optional[int] = None

    def fits(self, need: Need) -> bool:
        return (self.cpus >= need.tasks * need.cpus_per_task
                and (not need.gpus or self.gpu_slots >= need.tasks)
                and (self.mem is None or host_mem(need) is None or self.mem >= need.tasks * host_mem(need)))

    def take(self, need: Need, sign: int = 1) -> None:
        self.cpus -= sign * need.tasks * need.cpus_per_task
        if need.gpus:
            self.gpu_slots -= sign * need.tasks
        if self.mem is not None and host_mem(need) is not None:
            self.mem -= sign * need.tasks * host_mem(need)


def host_mem(need: Need) -> Optional[int]:
    """Host memory one rank of the point needs by the estimate (a GPU point's estimate is its GPU's)."""
    return None if need.gpus else need.mem_per_task


def gpu_slots(gpus: int, gpu_mem: Optional[int], mem_per_task: Optional[int]) -> int:
    """GPU slots of a node: one rank per GPU, or as many as the planner's estimate fits in a GPU's
    memory when both are known (small points share a GPU)."""
    if not gpus:
        return 0
    if gpu_mem and mem_per_task and mem_per_task > 0:
        return gpus * max(1, int(gpu_mem // mem_per_task))
    return gpus


def plan_starts(waiting: Sequence[Tuple[Any, Need]], free: List[NodeFree]) -> List[Tuple[Any, List[str]]]:
    """Which waiting points start now and on which nodes (pure; ``free`` is updated): in queue order,
    each on the first nodes that hold its share, a point that does not fit now skipped so a later one
    that fits starts (backfill). A point asks ``nodes`` distinct nodes."""
    out: List[Tuple[Any, List[str]]] = []
    for key, need in waiting:
        fit = [n for n in free if n.fits(need)]
        if len(fit) < need.nodes:
            continue
        # the least busy nodes first: equal points spread over the pack (stable: ties keep the nodes' order)
        chosen = sorted(fit, key=lambda n: (-n.cpus, -n.gpu_slots))[:need.nodes]
        for n in chosen:
            n.take(need)
        out.append((key, [n.name for n in chosen]))
    return out


def never_fits(need: Need, whole: Sequence[NodeFree]) -> bool:
    """Whether a point could not start even on the empty allocation."""
    return len([n for n in whole if n.fits(need)]) < need.nodes


def plan_memory(plan: Optional[Dict[str, Any]]) -> Optional[int]:
    """Bytes one rank needs by the planner's estimate (plan.json's chosen layout), with the process's
    own overhead; None: no estimate."""
    try:
        total = int(plan["layouts"][0]["memory_bytes"]["total"])  # type: ignore[index]
    except (KeyError, IndexError, TypeError, ValueError):
        return None
    return total + PROCESS_OVERHEAD_BYTES


@dataclass
class PackPoint:
    """One point of a pack: its run dir, what its ranks run (a run's task), what it asks."""

    index: int
    run_id: str
    run_dir: str
    task: Any
    need: Need


@dataclass
class QueueEntry:
    """A point's line in the queue file."""

    index: int
    run_id: str
    run_dir: str
    state: str = "queued"  # queued | running | done | held (the pack is draining: left for its next start)
    step: Optional[str] = None  # <job>.<step> of its latest start (read from its status once running)
    nodes: List[str] = field(default_factory=list)
    starts: int = 0
    rc: Optional[int] = None


def queue_path(sweep_dir: Path, job_id: str) -> Path:
    return Path(sweep_dir) / f"pack-{job_id}.json"


def step_name(index: int, run_id: str) -> str:
    """A point's step's name (sacct, squeue -s): its place in the pack and its run (launcher cancel finds
    the step of a point by it)."""
    return f"pack{index}-{run_id}"


class PackRunner:
    """What the pack's job runs (pickled by submitit): the queue of its points, on the allocation of
    ``backend`` (the one that packed them: it reads what the job holds and starts each point's step)."""

    def __init__(self, points: List[PackPoint], folder: str, gpu_mem: Optional[int] = None, backend: str = "slurm"):
        self.points, self.folder, self.gpu_mem, self.backend = points, str(folder), gpu_mem, backend

    def __call__(self) -> Dict[str, Any]:
        from launcher import backends

        return Runner(self.points, Path(self.folder), os.environ, self.gpu_mem, backends.get(self.backend)).run()

    def __repr__(self) -> str:
        return f"PackRunner({len(self.points)} points)"


class Runner:
    def __init__(self, points: List[PackPoint], folder: Path, environ: Any, gpu_mem: Optional[int], backend: Any):
        self.points = {p.index: p for p in points}
        self.backend = backend
        held = backend.allocation(environ)
        self.job_id = held.job_id
        self.folder = Path(str(folder).replace("%j", self.job_id))
        per_task = next((p.need.mem_per_task for p in points if p.need.gpus), None)
        slots = gpu_slots(held.gpus, gpu_mem, per_task)
        self.shared_gpu = slots > held.gpus
        self.whole = [NodeFree(h, c, slots, held.mem_bytes) for h, c in zip(held.hosts, held.cpus)]
        self.free = [replace(n) for n in self.whole]
        self.sweep_dir = Path(points[0].run_dir).parent if points else self.folder
        self.queue: Dict[int, QueueEntry] = {}
        self.running: Dict[int, Tuple[subprocess.Popen, List[str]]] = {}
        self.stopping: Optional[str] = None  # why no point starts any more: "preempted" | "time_limit"

    # ---- the queue file --------------------------------------------------------------------------
    def write(self) -> None:
        from launcher.archive import atomic

        atomic.write_json(queue_path(self.sweep_dir, self.job_id), {
            "job_id": self.job_id, "nodes": [n.name for n in self.whole], "stopping": self.stopping,
            "points": [asdict(e) for e in sorted(self.queue.values(), key=lambda e: e.index)]})

    def _note(self, index: int) -> Path:
        return self.folder / f"requeue.{self.job_id}.pack{index}.json"

    def _log(self, index: int, err: bool) -> str:
        return str(self.folder / f"{self.job_id}_pack{index}_%t_log.{'err' if err else 'out'}")

    # ---- starting and ending points --------------------------------------------------------------
    def start(self, p: PackPoint, nodes: List[str]) -> None:
        import cloudpickle  # submitit's own pickler (the task is what an array task would run)

        pkl = self.folder / f"{self.job_id}_pack{p.index}.pkl"
        with open(pkl, "wb") as f:
            cloudpickle.dump(p.task, f)
        env = self.backend.step_environment(os.environ)  # without the pack job's own sizes
        env[PACK_STEP_ENV] = str(p.index)
        env["LAUNCHER_REQUEUE_NOTE"] = str(self._note(p.index))
        env[STEP_START_ENV] = repr(time.time())  # this point's step (its earlier one's errors are older)
        self._note(p.index).unlink(missing_ok=True)
        command = [sys.executable, "-u", "-m", "launcher.features.pack.runner", str(pkl)]
        cmd = self.backend.step_command(command, p.need, nodes,
                                        self._log(p.index, False), self._log(p.index, True),
                                        step_name(p.index, p.run_id), host_mem(p.need), self.shared_gpu)
        proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL)
        self.running[p.index] = (proc, nodes)
        e = self.queue[p.index]
        e.state, e.nodes, e.starts, e.rc = "running", nodes, e.starts + 1, None
        print(f"pack {self.job_id}: {p.run_id} started on {','.join(nodes)}", flush=True)

    def ended(self, index: int, rc: int) -> None:
        """A point's step ended: its outcome decided as the batch script's teardown decides an array
        task's (after_step), then sealed, or queued again."""
        from launcher.archive import atomic
        from launcher.run.rundir import RunDir
        from launcher.run.status import Status
        from launcher.runtime import after_step
        from launcher.runtime.seal import seal_if_due

        p, e = self.points[index], self.queue[index]
        _, nodes = self.running.pop(index)
        for n in self.free:
            if n.name in nodes:
                n.take(p.need, sign=-1)
        e.rc = rc
        rd = RunDir(p.run_dir)
        note = atomic.read_json(self._note(index), default=None)
        self._note(index).unlink(missing_ok=True)
        st = rd.status()
        e.step = st.job_id or e.step
        why = ""
        if not rd.is_final() and note and note.get("run"):
            outcome = after_step.judge(rd, note, after_step.StepEnd(rc, "", source="the point's step"))
            if outcome.action == "fail":
                extra = dict(outcome.stop)
                rd.finish_in_job(Status.failed, exit_code=int(extra.pop("exit_code", 1) or 1), error=outcome.why,
                                 job_id=e.step, **extra)
            elif outcome.action == "requeue":
                rd.set_status(Status.requeued, stop=outcome.stop)
            why = outcome.why
        elif not rd.is_final() and st.state is not Status.requeued:  # no rank began an attempt
            ended = after_step.describe(rc, self.backend.step_word)
            rd.finish_in_job(Status.failed, exit_code=rc or 1, job_id=e.step,
                             error=f"the point's step ended ({ended}) before its run started; see "
                                   f"{self._log(index, True).replace('%t', '0')}")
        st = rd.status()
        reason = (st.stop or {}).get("reason")
        if not rd.is_final() and reason == "preempted" and not self.stopping and self._job_runs():
            # TERM to this step alone (scancel <job>.<step>) while the pack runs on: the point is cancelled
            rd.finish_in_job(Status.cancelled, exit_code=rc or 1, job_id=e.step,
                             error=f"its step {e.step} was ended by a signal while its pack ran on")
        if rd.is_final():
            seal_if_due(rd)  # the ranks leave it due; one process here, as a one-node job's teardown
            e.state = "done"
        elif self.stopping or reason in ("time_limit", "preempted"):
            # the pack is ending: this point resumes when the pack starts again
            e.state = "held"
            if not self.stopping:
                self.stopping = (st.stop or {}).get("reason")
        else:
            e.state = "queued"  # its next attempt (begin_attempt holds it to train.max_restarts)
        print(f"pack {self.job_id}: {p.run_id} step ended (rc {rc}): {st.state.value}"
              f"{' (' + why + ')' if why else ''}{', queued again' if e.state == 'queued' else ''}", flush=True)

    # ---- the loop ----------------------------------------------------------------------------------
    def run(self) -> Dict[str, Any]:
        from launcher.run.rundir import RunDir

        def on_term(signum: int, frame: Any) -> None:  # preempted, requeued or cancelled: start nothing more
            self.stopping = self.stopping or ("time_limit" if signum == signal.SIGUSR2 else "preempted")

        signal.signal(signal.SIGTERM, on_term)
        signal.signal(signal.SIGUSR2, on_term)
        job_start.replay()  # what arrived while the job started (launcher.runtime.job_start)
        self.folder.mkdir(parents=True, exist_ok=True)
        for p in self.points.values():
            final = RunDir(p.run_dir).is_final()
            self.queue[p.index] = QueueEntry(p.index, p.run_id, p.run_dir, state="done" if final else "queued")
            if final:  # an earlier start of this pack finished it (a requeued pack): a seal it left due
                from launcher.runtime.seal import seal_if_due

                seal_if_due(RunDir(p.run_dir))
        for p in list(self.points.values()):
            if self.queue[p.index].state == "queued" and never_fits(p.need, self.whole):
                self._refuse(p)
        self.write()
        while True:
            waiting = [(i, self.points[i].need) for i, e in sorted(self.queue.items()) if e.state == "queued"]
            started = False
            if not self.stopping:
                for i, nodes in plan_starts(waiting, self.free):
                    if RunDir(self.points[i].run_dir).is_final():  # cancelled while queued (launcher cancel)
                        for n in self.free:
                            if n.name in nodes:
                                n.take(self.points[i].need, sign=-1)
                        self.queue[i].state = "done"
                        continue
                    self.start(self.points[i], nodes)
                    started = True
                if started:  # the queue file changes only when a point starts or ends
                    self.write()
            if not self.running and (self.stopping or not any(e.state == "queued" for e in self.queue.values())):
                break
            changed = False
            for i, (proc, _) in list(self.running.items()):
                rc = proc.poll()
                if rc is not None:
                    self.ended(i, rc if rc >= 0 else 128 - rc)
                    changed = True
            if changed:
                self.write()
            else:
                time.sleep(POLL_S)
        self.write()
        held = [e.run_id for e in self.queue.values() if e.state in ("held", "queued")]
        if held and self.stopping == "time_limit":  # every running point checkpointed: the whole pack again
            from launcher import backends

            print(f"pack {self.job_id}: time limit: {len(held)} point(s) left; requeueing the pack", flush=True)
            backends.get("slurm").request_requeue(self.job_id)
        return {"job_id": self.job_id, "points": {e.run_id: e.state for e in self.queue.values()}}

    def _job_runs(self) -> bool:
        """Whether Slurm still runs the pack's job (not requeueing, preempting or cancelling it)."""
        from launcher import backends
        from launcher.runtime.after_step import STILL_RUNNING

        word = backends.get("slurm").job_state_now(self.job_id)
        return (word.split()[0].rstrip("+").upper() if word else "") in STILL_RUNNING

    def _refuse(self, p: PackPoint) -> None:
        from launcher.run.rundir import RunDir
        from launcher.run.status import Status

        RunDir(p.run_dir).finish_in_job(Status.failed, exit_code=1, error=(
            f"cluster.pack_nodes: the pack's nodes ({', '.join(f'{n.name}: {n.cpus} CPUs' for n in self.whole)}) "
            f"cannot hold this point ({p.need.nodes} node(s) x {p.need.tasks} rank(s) x {p.need.cpus_per_task} "
            "CPUs)"))
        self.queue[p.index].state = "done"


def step_main(argv: Sequence[str]) -> int:
    """One rank of a point's step: the run's task (what the array task would run), its exit status."""
    import cloudpickle

    with open(argv[0], "rb") as f:
        task = cloudpickle.load(f)
    task()
    return 0


if __name__ == "__main__":
    sys.exit(step_main(sys.argv[1:]))
