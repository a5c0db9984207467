"""The step loop of any training function: ``for step in StepLoop(cfg, ctx, checkpoint): ...``.

The loop resumes (``Checkpointer.resume``: the latest checkpoint's state, the metrics file rewound to
its step) when it is made, then yields the steps still to run, ``start + 1 .. steps``. The body trains
one step and gives its metrics row (``loop.log(loss=...)``); after the body the loop

- writes the row (the run's metrics.jsonl, and wandb when enabled: ``MetricsSink``),
- beats the hang watchdog (``ctx.heartbeat``),
- asks every rank whether the job must stop (``ctx.should_stop``: all ranks stop after the same step;
  the engines fold the stop votes into their loss all-reduce, ``engines.base.StepStats``, so this
  costs no collective of its own; else one tiny all-reduce); if so, saves blocking, waits for every
  rank's save and raises ``ctx.interrupted`` (the runtime requeues the job; the next attempt resumes after this step),
- saves when due (train.checkpoint.every, the last step, a kill_in_save drill's step); the step before
  a due save, a run that ``cluster.elastic`` shrank looks for its nodes (``ctx.offer_grow``): when they
  are back, every rank stops at that save and the run grows back (launcher.features.elastic.regrow),
- at a rung of ``sweep=asha`` (launcher.features.asha.schedule, launcher.features.asha.rungs): saves
  blocking, rank 0 reports the row's ``sweep.objective`` into the sweep dir and learns the verdict
  (every rank gets it): go on, or raise ``AtRung`` (paused: the job ends, a promotion resumes it from
  this checkpoint; or pruned). A generation's boundary of ``sweep=pbt`` is such a rung
  (launcher.features.pbt.generations, launcher.features.pbt.population): the decision may resume the
  run from another member's checkpoint with other values.

After the last step it waits until every save of every rank is committed.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Optional

from launcher.features.asha import rungs
from launcher.features.nodes import straggler
from launcher.runtime import teardown
from launcher.runtime.restarts import AtRung
from launcher.training.checkpoint import Checkpointer
from launcher.training.metrics import MetricsSink

if TYPE_CHECKING:
    from launcher.config.schema import RunConfig


class StepLoop:
    """Steps ``start + 1 .. steps`` (train.steps unless given) of one rank, resumed by ``checkpoint``
    (None: nothing is saved, a restarted attempt starts again from step 1)."""

    def __init__(self, cfg: RunConfig, ctx: Any, checkpoint: Optional[Checkpointer] = None, *,
                 steps: Optional[int] = None) -> None:
        self.cfg, self.ctx, self.checkpoint = cfg, ctx, checkpoint
        self.steps = int(cfg.train.steps if steps is None else steps)
        if checkpoint is not None:
            checkpoint.steps = self.steps  # the last step is always saved
            self.start, self.history = checkpoint.resume()
        else:
            self.start, self.history = 0, []
            if ctx.is_main and int(ctx.attempt) > 1:
                ctx.rundir.rewrite_metrics([])  # every step is redone: each logged once
        self.step = self.start  # the step the body runs (the last one finished, after the loop)
        self._row: Optional[Dict[str, Any]] = None
        self._sink: Optional[MetricsSink] = None
        # sweep=asha: the rungs this run reports at (None: not a point of such a sweep)
        self._rule = rungs.rule_of(ctx.rundir, cfg) if _in_sweep(ctx) else None
        # the measured segment (the compute spent; a clock that never steps back)
        self._t0, self._from = time.monotonic(), self.start
        # and what this start cost before its first step (imports, construction, resume): once an attempt
        self._startup = rungs.since_process_start() if self._rule is not None and ctx.is_main else 0.0

    @property
    def resumed(self) -> bool:
        return self.start > 0

    def log(self, **row: Any) -> None:
        """The metrics row of the step the body runs (numbers; written after the body, on rank 0)."""
        self._row = {**(self._row or {}), **row}

    def values(self, key: str) -> List[Any]:
        """``key`` of every step's row so far, the resumed steps' included (e.g. ``values("loss")``)."""
        return [r[key] for r in self.history if key in r]

    def __iter__(self) -> Iterator[int]:
        self._sink = MetricsSink(self.cfg, self.ctx, self.history)
        self._ended = time.monotonic()  # the last step's end (the first step counts from here)
        try:
            for step in range(self.start + 1, self.steps + 1):
                self.step, self._row = step, None
                yield step
                self._end_step(step)
            if self.checkpoint is not None:
                self.checkpoint.finish()
            if self._rule is not None and self.ctx.is_main and self._from < self.steps:
                rungs.record_end(self.ctx.rundir, self._rule, self.steps, seconds=time.monotonic() - self._t0,
                                 from_step=self._from, world=int(self.ctx.world_size), startup_s=self._startup)
        finally:
            teardown.step(self.close, "closing the metrics sink")

    def _end_step(self, step: int) -> None:
        if self._row is not None:
            self._sink.log(step, self._row)
            self.history.append({"step": step, **self._row})
        self.ctx.heartbeat(step)
        now = time.monotonic()  # this rank's own and data time, for the straggler watch (on every rank)
        if hasattr(self.ctx, "step_times"):
            self.ctx.step_times(*straggler.own_and_data(self._row or {}, now - self._ended))
        self._ended = now
        stop = self.ctx.should_stop()  # all ranks agree: signalled before the time limit, or preempted
        ck = self.checkpoint
        # a rung first: a job stopped at its rung step resumes after it, and the rung must have its report
        saved = self._rule is not None and step in self._rule.rungs and self._at_rung(step)
        if stop:
            if ck is not None:
                if not saved:
                    ck.save(step, self.history, block=True)
                ck.finish()
            raise self.ctx.interrupted(stop, step)
        if ck is not None and not saved and ck.due(step):
            ck.save(step, self.history)
        if ck is not None and ck.due(step + 1) and step + 1 < self.steps:
            # cluster.elastic, shrunk: the vote to stop at that checkpoint and grow back
            getattr(self.ctx, "offer_grow", lambda: None)()

    def _at_rung(self, step: int) -> bool:
        """A rung: saved (where the run pauses), reported by rank 0, the verdict agreed by every rank;
        raises AtRung unless the run goes on. True: this step is saved."""
        rule, ck = self._rule, self.checkpoint
        saved = step in rule.pause_rungs and ck is not None
        if saved:
            ck.save(step, self.history, block=True)
            ck.finish()  # committed before the report: a decision may resume it from here at once
        verdict = None
        if self.ctx.is_main:
            key = str(self.cfg.sweep.objective)
            value = (self._row or {}).get(key)
            try:
                value = None if value is None else float(value)
            except (TypeError, ValueError):
                value = None
            if value is None:
                print(f"launcher: step {step} logged no number under sweep.objective={key!r}: this point counts "
                      "as the worst at the rung", flush=True)
            verdict = rungs.report(self.ctx.rundir, rule, step, value, attempt=int(self.ctx.attempt),
                                   seconds=time.monotonic() - self._t0, from_step=self._from,
                                   world=int(self.ctx.world_size), job_id=self.ctx.rundir.status().job_id,
                                   startup_s=self._startup)
        verdict = _agree(self.ctx, verdict)
        self._t0, self._from, self._startup = time.monotonic(), step, 0.0
        if verdict in ("wait", "pruned"):
            raise AtRung(verdict, step)
        return saved

    def close(self) -> None:
        """End the wandb run (also when the body raised: call it, or use the loop as a context manager)."""
        if self._sink is not None:
            self._sink.close()
            self._sink = None

    def __enter__(self) -> StepLoop:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _in_sweep(ctx: Any) -> bool:
    rd = getattr(ctx, "rundir", None)
    return rd is not None and rd.path.name.isdigit()


def _agree(ctx: Any, verdict: Optional[str]) -> Optional[str]:
    """Rank 0's verdict, on every rank (one broadcast where there are several)."""
    if int(ctx.world_size) <= 1:
        return verdict
    import torch.distributed as dist

    if not dist.is_initialized():
        return verdict
    box = [verdict]
    dist.broadcast_object_list(box, src=0)
    return box[0]
