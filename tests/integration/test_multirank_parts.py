"""Parts that only mean something with more than one rank, on a real 2-process gloo group: the stop
agreement at a step boundary (RunContext.should_stop) and the data-parallel gradient average
(recipes.gpt.parallel.grad_buckets). Each test spawns two worker processes on a free loopback port."""
import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import List

import pytest

REPO = Path(__file__).resolve().parent.parent.parent

pytestmark = pytest.mark.dist

PRELUDE = """
import json, os, signal, sys, time
from pathlib import Path
import torch
import torch.distributed as dist
rank, port, out = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
"""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_ranks(tmp_path: Path, body: str, timeout: float = 120) -> List[Path]:
    """Run ``body`` (after PRELUDE) as ranks 0 and 1; each writes ``out``. Their outputs' paths."""
    script = tmp_path / "worker.py"
    # every rank done with the group before either tears it down (gloo can abort a process whose peer
    # closed its pairs while its own teardown is still running)
    script.write_text(PRELUDE + textwrap.dedent(body) + "\ndist.barrier()\ndist.destroy_process_group()\n")
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    outs = [tmp_path / f"rank_{r}.out" for r in (0, 1)]
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(port), str(outs[r])], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for r, p in enumerate(procs):
        assert p.returncode == 0, f"rank {r} exited {p.returncode}:\n" + "\n".join(logs)
    return outs


STOP = """
from launcher.rundir import RunDir
from launcher.runtime.context import RunContext
from launcher.runtime.restarts import StopFlag

flag = StopFlag().install()
ctx = RunContext(rank=rank, world_size=2, local_rank=rank, local_world_size=2, node_rank=0, hostname="h",
                 rundir=RunDir(out.parent / "run"), layout=None, device="cpu", backend="gloo", stop_flag=flag)
# per step boundary, the signal each rank receives just before it (None: none)
plan = {0: [None, None, None, "TERM", None], 1: [None, "USR2", None, None, "TERM"]}
seen = []
for step, sig in enumerate(plan[rank]):
    if step == 3:  # a fresh flag on both ranks: rank 0 is preempted, rank 1 hit the time limit
        flag.reason = None
        if rank == 1:
            os.kill(os.getpid(), signal.SIGUSR2)
    if step == 4:  # a fresh flag: only rank 1 is preempted
        flag.reason = None
    if sig is not None:
        os.kill(os.getpid(), getattr(signal, "SIG" + sig))
        time.sleep(0.05)
    seen.append({"own": flag.reason, "agreed": ctx.should_stop()})
out.write_text(json.dumps(seen))
"""


@pytest.mark.timeout(180)
def test_all_ranks_agree_on_a_stop_one_rank_saw(tmp_path):
    """Only rank 1 was signalled: both ranks' should_stop return its reason at the same boundary; when
    one rank is preempted and the other hit the time limit, both say time_limit (it outranks)."""
    outs = _two_ranks(tmp_path, STOP)
    r0, r1 = (json.loads(p.read_text()) for p in outs)
    assert [s["own"] for s in r0] == [None, None, None, "preempted", None]
    assert [s["own"] for s in r1] == [None, "time_limit", "time_limit", "time_limit", "preempted"]
    expected = [None, "time_limit", "time_limit", "time_limit", "preempted"]
    assert [s["agreed"] for s in r0] == expected
    assert [s["agreed"] for s in r1] == expected


STOP_FOLDED = STOP.replace(
    '    seen.append({"own": flag.reason, "agreed": ctx.should_stop()})',
    """    from launcher.training.engines.base import StepStats
    stats = StepStats(ctx, 2)  # an engine's step: the loss all-reduce carries the stop votes
    t = stats.with_votes(torch.full((1,), float(rank)))
    dist.all_reduce(t)
    loss, = stats.read(t)
    real, calls = dist.all_reduce, []
    dist.all_reduce = lambda *a, **k: calls.append(a) or real(*a, **k)
    seen.append({"own": flag.reason, "agreed": ctx.should_stop(), "loss": loss, "stop_collectives": len(calls)})
    dist.all_reduce = real""")


@pytest.mark.timeout(180)
def test_stop_folded_into_the_step_all_reduce_agrees_without_a_collective(tmp_path):
    """As above, with the votes summed inside the step's own all-reduce (StepStats): the same agreed
    reasons at the same boundaries, the step's value intact, and should_stop runs no collective."""
    outs = _two_ranks(tmp_path, STOP_FOLDED)
    r0, r1 = (json.loads(p.read_text()) for p in outs)
    expected = [None, "time_limit", "time_limit", "time_limit", "preempted"]
    assert [s["agreed"] for s in r0] == expected
    assert [s["agreed"] for s in r1] == expected
    assert {s["loss"] for s in r0 + r1} == {1.0}  # 0 + 1: the summed values come back without the votes
    assert {s["stop_collectives"] for s in r0 + r1} == {0}


BUCKETS = """
from torch import nn
from recipes.gpt.parallel.grad_buckets import GradBuckets

def model():
    torch.manual_seed(0)  # the same weights on both ranks
    return nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)])

torch.manual_seed(100 + rank)  # different data per rank
xs = [torch.randn(3, 16) for _ in range(2)]
ref, got = model(), model()
for x in xs:  # the local gradient, accumulated over 2 micro-batches (no communication)
    ref(x).pow(2).mean().backward()
sync = GradBuckets(list(got.parameters()), dist.group.WORLD, world=2, bucket_bytes=16 * 17 * 4 * 2)
sync.start_step(2)
for x in xs:
    got(x).pow(2).mean().backward()
sync.finish()
torch.save({"local": [p.grad for p in ref.parameters()], "synced": [p.grad for p in got.parameters()],
            "buckets": len(sync.buckets)}, out)
"""


@pytest.mark.timeout(180)
def test_grad_buckets_average_over_two_ranks(tmp_path):
    """World 2: after finish(), every gradient on both ranks is the mean of the two ranks' local
    gradients (computed here from each rank's own backward, without the buckets)."""
    import torch

    outs = _two_ranks(tmp_path, BUCKETS)
    r0, r1 = (torch.load(p, weights_only=True) for p in outs)
    assert r0["buckets"] == 2  # two layers a bucket: several buckets, so the per-bucket scaling is exercised
    for g0, g1, s0, s1 in zip(r0["local"], r1["local"], r0["synced"], r1["synced"]):
        assert not torch.allclose(g0, g1)  # the ranks' data differ: the average is not either one
        assert torch.equal(s0, s1)
        torch.testing.assert_close(s0, (g0 + g1) / 2, rtol=1e-5, atol=1e-7)
