"""Communication benchmark recipe: ``main(cfg, ctx) -> summary``.

For every op (all_reduce, all_gather, reduce_scatter, and sendrecv between rank 0 and the last rank)
and every message size, time ``iters`` operations after ``warmup_iters`` and record one row: time per
operation (the slowest rank's: an op is only done when every rank is), algbw, busbw (recipes.commbench.math)
and whether the ranks taking part span nodes. The launcher runtime has initialised torch.distributed
(gloo on CPU, nccl on GPU) before ``main`` runs. Rows go to the run's metrics file (one per op and
size) and, with the world size, backend and hosts, to commbench.json in the run dir (its contract's RESULTS).
"""
from __future__ import annotations

import dataclasses
import json
import os
import socket
import time
from typing import TYPE_CHECKING, Any, Callable, Dict, List

import torch
import torch.distributed as dist

from launcher.runtime.env import scheduler_node_name
from launcher.training.metrics import MetricsSink
from recipes.commbench import math as cbmath, ops, settings
from recipes.commbench.contract import RESULTS

if TYPE_CHECKING:
    from launcher.config.schema import RunConfig


def node_names(ctx: Any) -> List[str]:
    """The node of every rank, in rank order. The Slurm node name first: on a cluster whose nodes
    share one host (scripts/slurm-local.sh) every rank has the same hostname."""
    own = scheduler_node_name() or ctx.hostname or socket.gethostname()
    names: List[Any] = [None] * int(ctx.world_size)
    dist.all_gather_object(names, own)
    return [str(n) for n in names]


def _agree(ctx: Any, value: float) -> float:
    """The largest ``value`` over all ranks (every rank gets it)."""
    t = torch.tensor([value], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _time(op: ops.Op, s: settings.Settings, sync: Callable[[], None]) -> float:
    """Seconds per operation on this rank, after the warm-up (the first call already warmed up once)."""
    for _ in range(max(0, s.warmup_iters - 1)):
        op.run()
    sync()
    dist.barrier()  # start together: a late rank would be timed as slow communication
    t0 = time.perf_counter()
    for _ in range(s.iters):
        op.run()
    sync()
    return (time.perf_counter() - t0) / s.iters


def _write_json(path: Any, data: Dict[str, Any]) -> None:
    """Whole or not at all: a reader never sees half a file."""
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


def main(cfg: RunConfig, ctx: Any) -> Dict[str, Any]:
    s = settings.from_cfg(cfg)
    world, rank = int(ctx.world_size), int(ctx.rank)
    sizes = cbmath.message_sizes(s.min_bytes, s.max_bytes, s.factor)
    elem = ops.element_size(s.dtype)
    nodes = node_names(ctx)
    device = torch.device(ctx.device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    if ctx.is_main:
        if ctx.attempt > 1:  # no checkpoints: a restarted run measures everything again
            ctx.rundir.rewrite_metrics([])
        print(f"[commbench] world={world} backend={ctx.backend} nodes={sorted(set(nodes))} dtype={s.dtype} "
              f"sizes={sizes[0]}..{sizes[-1]} B x{s.factor} warmup={s.warmup_iters} iters={s.iters}", flush=True)

    sink = MetricsSink(cfg, ctx)
    rows: List[Dict[str, Any]] = []
    skipped: List[Dict[str, str]] = []
    step = 0
    try:
        for name in cbmath.OPS:
            for nbytes in sizes:
                count = cbmath.element_count(name, nbytes, elem, world)
                reason = ""
                try:
                    op = ops.make(name, count, s.dtype, ctx.device, rank, world)
                    op.run()  # the first warm-up call also picks the form the backend runs
                except ops.Unsupported as e:
                    reason = str(e)
                # every rank must skip together, or the next collective pairs with a different one
                if _agree(ctx, 1.0 if reason else 0.0) > 0:
                    skipped.append({"op": name, "reason": reason or "refused on another rank"})
                    break
                seconds = _agree(ctx, _time(op, s, sync))
                step += 1
                moved = count * elem
                row = {"op": name, "bytes": moved, "count": count, "dtype": s.dtype, "impl": op.impl,
                       "time_us": seconds * 1e6, "algbw_gbs": cbmath.algbw(moved, seconds),
                       "busbw_gbs": cbmath.busbw(name, moved, seconds, world),
                       "scope": cbmath.scope(nodes, name), "world_size": world}
                rows.append(row)
                sink.log(step, row)
                ctx.heartbeat(step)
                stop = ctx.should_stop()  # all ranks agree: the time limit is near, or preempted
                if stop:
                    raise ctx.interrupted(stop, step)
                if ctx.is_main:
                    print(f"[commbench] {name:>14} {moved:>12} B {row['time_us']:>12.1f} us "
                          f"algbw {row['algbw_gbs']:8.3f} busbw {row['busbw_gbs']:8.3f} GB/s {row['scope']}",
                          flush=True)
    finally:
        sink.close()

    peak_bus, peak_alg = cbmath.peaks(rows), cbmath.peaks(rows, "algbw_gbs")
    if ctx.is_main:
        for sk in skipped:
            print(f"[commbench] skipped {sk['op']}: {sk['reason']}", flush=True)
        _write_json(ctx.run_dir / RESULTS, {
            "world_size": world, "backend": ctx.backend, "device": str(ctx.device), "dtype": s.dtype,
            "nodes": nodes, "hosts": sorted(set(nodes)), "settings": dataclasses.asdict(s),
            "rows": rows, "skipped": skipped,
        })
    summary: Dict[str, Any] = {"world_size": world, "backend": ctx.backend, "rows": len(rows),
                               "skipped": [sk["op"] for sk in skipped]}
    for name in peak_bus:
        summary[f"{name}_peak_busbw_gbs"] = peak_bus[name]
        summary[f"{name}_peak_algbw_gbs"] = peak_alg[name]
    return summary
