"""What a recipe gets besides its config (``fn(cfg, ctx)``): who it is in the job, the layout it runs
with, its run dir, and a metrics logger. This is the recipes' public API of the launcher."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Optional, Sequence

from launcher.config.layout import Layout
from launcher.features.elastic.resize import GROW
from launcher.run.rundir import RunDir
from launcher.runtime.restarts import STOP_CODES, STOP_REASONS, Interrupted

STOP_VOTES = max(STOP_CODES.values())  # one vote slot per stop reason (codes 1..STOP_VOTES)


@dataclass
class RunContext:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    hostname: str
    rundir: RunDir  # write files of the run dir through it (ctx.rundir.write_state(...), ...)
    layout: Layout  # the layout archived at launch (engine, dp/tp/pp, grad accumulation, placement)
    device: str  # "cpu" or "cuda:N"
    backend: str  # torch.distributed backend: "gloo" or "nccl"
    attempt: int = 1  # 1 = first start of the run's job, 2 = first restart, ...
    watch: Optional[Any] = field(default=None, repr=False)  # the rank's watchdog (hang watch)
    stop_flag: Optional[Any] = field(default=None, repr=False)  # the signals the job received
    # an exception out of the recipe aborts the process (os.abort) before any handler runs, as
    # ProcessGroupNCCL's teardown does (fault drills: train.fail_peers=abort)
    abort_on_error: bool = False
    # train.faults mode=requeue on this attempt: the step after which the run stops as a time-limit signal
    # stops it (every rank reads the same config: they agree without a collective)
    stop_after: Optional[int] = None
    # rank 0's watch of the job's end (launcher.runtime.time_guard), told how long each save took
    time_guard: Optional[Any] = field(default=None, repr=False)
    # the straggler watch (launcher.features.nodes.record.Stragglers): every rank's step timings ride on
    # the stop agreement's all-reduce, and every rank reaches its verdict
    stragglers: Optional[Any] = field(default=None, repr=False)
    _timing: Any = field(default=(0.0, 0.0), repr=False)  # this rank's (own, data) seconds of its last step
    _step: Optional[int] = field(default=None, repr=False)  # the last step heartbeat was told of
    _metrics_file: Optional[Any] = field(default=None, repr=False)
    _settled: Any = field(default=None, repr=False)  # (reason,) agreed inside this step's own all-reduce

    @property
    def run_dir(self) -> Path:
        return self.rundir.path

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def log_metrics(self, step: int, **metrics: Any) -> None:
        """Append one JSON line per step to the run's metrics file (rank 0 only; others no-op)."""
        if not self.is_main:
            return
        if self._metrics_file is None:
            self._metrics_file = open(self.rundir.metrics_path, "a", buffering=1)
        row: Dict[str, Any] = {"step": step, **metrics, "time": time.time()}
        self._metrics_file.write(json.dumps(row) + "\n")

    def heartbeat(self, step: Optional[int] = None) -> None:
        """Progress (a finished step, a long save): resets the hang watchdog (train.hang_timeout_s)."""
        if step is not None:
            self._step = step
        if self.watch is not None:
            self.watch.beat(step)

    def save_took(self, seconds: float) -> None:
        """A checkpoint was written and committed in ``seconds``: the time limit's margin follows it."""
        if self.time_guard is not None:
            self.time_guard.saved(seconds)

    def progress(self) -> None:
        """Start-up progress before the first step (a checkpoint verified, a long load): resets the
        start-up watch (train.startup_timeout_s) without arming the hang watch."""
        if self.watch is not None and hasattr(self.watch, "progress"):
            self.watch.progress()

    def should_stop(self) -> Optional[str]:
        """At a step boundary, on every rank together: the reason the job must stop now ("time_limit":
        USR2 before the time limit; "preempted": TERM), or None. When the step's engine folded the stop
        votes into its own all-reduce (``stop_votes`` / ``settle_stop``), that agreement is the answer
        and no collective runs here; otherwise one tiny all-reduce, so that all ranks agree at the same
        step even when the signal reached them at different times."""
        if self.stop_after is not None and self._step == self.stop_after:  # every rank alike, from the config
            self._settled = None  # (this step's folded votes: the stop is decided)
            return "time_limit"
        # torch: only on the node
        import torch.distributed as dist

        if self._settled is not None:  # (agreed in the step's own all-reduce)
            (agreed,), self._settled = self._settled, None
            return agreed
        own = self.stop_flag.reason if self.stop_flag is not None else None
        if not dist.is_initialized() or self.world_size == 1:
            return own
        votes = self.stop_votes(self.device)
        dist.all_reduce(votes)  # (SUM)
        self.settle_stop(votes.tolist())
        (agreed,), self._settled = self._settled, None
        return agreed

    def step_times(self, own_s: float, data_s: float) -> None:
        """This rank's last step: its own seconds (the step less its waits for the other ranks) and its
        data seconds, for the straggler watch (carried by the next stop agreement)."""
        self._timing = (float(own_s), float(data_s))

    def _timed(self) -> bool:
        return self.stragglers is not None and self.stragglers.on and self.world_size > 1

    def stop_votes(self, device: Any) -> Any:
        """This rank's stop reason as float32 votes, one slot per reason (code 1, 2, ...; a one-hot, or
        zeros), for an engine to SUM over the world inside the step's own all-reduce (its loss), and
        hand back to ``settle_stop`` with the same host read: the stop then costs no collective and
        no device sync of its own. With the straggler watch on, two slots per rank follow, holding
        this rank's last step timings at its own index (zeros elsewhere): summed, every rank's."""
        import torch

        own = self.stop_flag.reason if self.stop_flag is not None else None
        size = STOP_VOTES + (2 * self.world_size if self._timed() else 0)
        votes = torch.zeros(size, dtype=torch.float32, device=device)  # kernels only: no host copy
        if own is not None:
            votes[STOP_CODES[own] - 1] = 1.0
        if size > STOP_VOTES:
            votes[STOP_VOTES + self.rank] = self._timing[0]
            votes[STOP_VOTES + self.world_size + self.rank] = self._timing[1]
        return votes

    def settle_stop(self, summed: Sequence[float]) -> None:
        """Every rank's ``stop_votes`` summed (as floats): the reason of the highest code any rank voted
        for (time_limit outranks preempted) is what the next ``should_stop`` returns, on every rank;
        failing any, the straggler watch's verdict on the timings that came with them."""
        voted = [code for code in range(1, STOP_VOTES + 1) if summed[code - 1] > 0]
        reason = STOP_REASONS[max(voted, default=0)]
        w = self.world_size
        if len(summed) >= STOP_VOTES + 2 * w and self._timed():
            own = list(summed[STOP_VOTES:STOP_VOTES + w])
            data = list(summed[STOP_VOTES + w:STOP_VOTES + 2 * w])
            verdict = self.stragglers.feed(own, data, self._step)
            reason = reason or verdict
        self._settled = (reason,)

    def offer_grow(self) -> None:
        """Rank 0, the step before a due save: a run cluster.elastic shrank votes to stop at that save when
        enough nodes are back and the job that grows it is queued (launcher.features.elastic.regrow); the vote
        rides on the next step's agreement, so every rank stops there together."""
        if not self.is_main or self.stop_flag is None or self.stop_flag.reason is not None:
            return
        from launcher.features.elastic import regrow as elastic

        if elastic.offer_grow(self.rundir):
            self.stop_flag.reason = GROW

    def interrupted(self, reason: str, step: int):
        """The exception a recipe raises after saving, once ``should_stop`` said so."""
        why = self.stragglers.line if reason == "straggler" and self.stragglers is not None else ""
        return Interrupted(reason, step, why)

    def close(self) -> None:
        if self._metrics_file is not None:
            self._metrics_file.close()
            self._metrics_file = None
