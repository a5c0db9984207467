"""Parts that only mean something with more than one rank, on a real 2-process gloo group: the stop
agreement at a step boundary (RunContext.should_stop), the data-parallel gradient average
(recipes.gpt.parallel.grad_buckets), the ddp engines' resume read by one rank and the checkpoint
commit counted in the group's store (launcher.training.checkpoint). Each test spawns two worker
processes on a free loopback port."""
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
from launcher.run.rundir import RunDir
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
    """    from launcher.training.engines.engine import StepStats
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


ONE_READ = """
from types import SimpleNamespace
from torch import nn
from launcher.training.checkpoint import load_on_one_rank
from launcher.training.engines.ddp import DDPEngine as AnyModelDDP
from recipes.gpt.engines.ddp import DDPEngine as GptDDP

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.b.weight = self.a.weight  # tied: one tensor under two names
        self.register_buffer("mask", torch.tensor([True, False, True]))

def fresh(seed):
    torch.manual_seed(seed)
    net = Net()
    return net, torch.optim.AdamW(net.parameters(), lr=0.1)

ckdir = out.parent / "ckpt"
if rank == 0:  # the state after two steps, as ddp's checkpoint holds it
    ckdir.mkdir()
    net, opt = fresh(0)
    for _ in range(2):
        net.a(torch.randn(2, 4)).pow(2).sum().backward()
        opt.step()
    torch.save({"model": net.state_dict(), "optimizer": opt.state_dict(), "scaler": None}, ckdir / "model.pt")
dist.barrier()

real_load, loads = torch.load, []
def counting_load(f, *a, **k):
    loads.append(str(f))
    return real_load(f, *a, **k)
torch.load = counting_load

result = {}
for name, engine in (("any_model", AnyModelDDP), ("gpt", GptDDP)):
    net, opt = fresh(1 + rank)  # other weights on each rank: the load must replace them
    me = SimpleNamespace(FILE="model.pt", device=torch.device("cpu"), model=net, optimizer=opt, scaler=None)
    engine.load_checkpoint(me, ckdir)
    result[name] = {"model": net.state_dict(), "optimizer": opt.state_dict()}
shared = load_on_one_rank(ckdir / "model.pt", "cpu")
tied = shared["model"]["a.weight"].data_ptr() == shared["model"]["b.weight"].data_ptr()
torch.load = real_load
torch.save({"loads": loads, "result": result, "tied": tied, "file": real_load(ckdir / "model.pt")}, out)
"""


@pytest.mark.timeout(180)
def test_ddp_resume_reads_the_model_file_on_one_rank_only(tmp_path):
    """Both DDP engines' load_checkpoint on a 2-rank gloo group: rank 0 reads model.pt (once per load),
    rank 1 never opens it, and both end with the file's model and optimizer state bit for bit (a tied
    weight stays one tensor, a bool buffer arrives as written)."""
    import torch

    outs = _two_ranks(tmp_path, ONE_READ)
    r0, r1 = (torch.load(p, weights_only=False) for p in outs)
    assert [Path(f).name for f in r0["loads"]] == ["model.pt"] * 3 and r1["loads"] == []
    assert r0["tied"] and r1["tied"]
    want = r0["file"]
    for r in (r0, r1):
        for engine in ("any_model", "gpt"):
            got = r["result"][engine]
            assert got["model"].keys() == want["model"].keys()
            assert all(torch.equal(got["model"][k], v) and got["model"][k].dtype == v.dtype
                       for k, v in want["model"].items())
            assert got["optimizer"]["param_groups"] == want["optimizer"]["param_groups"]
            for pid, st in want["optimizer"]["state"].items():
                assert all(torch.equal(got["optimizer"]["state"][pid][k], v) for k, v in st.items())


COMMIT = """
import threading
from omegaconf import OmegaConf
from launcher.run.rundir import RunDir
from launcher.training import checkpoint

class Engine:
    def __init__(self):
        self.p = torch.nn.Parameter(torch.arange(4.0) + 10 * rank)
        self.optimizer = torch.optim.SGD([self.p], lr=1.0)
    def optimizers(self):
        return [self.optimizer]
    def save_native(self, path):
        pass
    def checkpoint_files(self):
        return {f"part_{rank}.pt": {"w": self.p}}
    def load_checkpoint(self, path):
        pass

class Ctx:
    attempt = 1
    def __init__(self):
        self.rank, self.world_size, self.rundir = rank, 2, RunDir(out.parent / "run")
    def heartbeat(self, step=None):
        pass

renames = []
real_replace = os.replace
def replace(src, dst):
    if str(src).endswith(".partial"):
        renames.append((threading.current_thread().name, Path(dst).name))
    return real_replace(src, dst)
os.replace = replace

if rank == 0:
    Ctx().rundir.path.mkdir()
dist.barrier()
cfg = OmegaConf.create({"train": {"steps": 4, "fail_at_step": None, "fail_rank": 0, "fail_mode": "exception",
                                  "fail_attempt": None, "checkpoint": {"every": 1, "keep": 2, "async_save": True}}})
ck = checkpoint.Checkpointer(cfg, Ctx(), Engine())
for step in range(1, 5):
    if rank == step % 2:
        time.sleep(0.3)  # the ranks take turns at finishing last
    ck.save(step, [{"step": s} for s in range(1, step + 1)])
    ck.wait()
    dist.barrier()
ck.finish()
out.write_text(json.dumps(renames))
"""


@pytest.mark.timeout(180)
def test_the_ranks_count_their_parts_in_the_groups_store_and_one_renames(tmp_path):
    """Asynchronous saves of a 2-rank gloo group, counted in the default group's store: each save is
    renamed into place exactly once, by one rank's writer thread, and the last two are kept whole."""
    from launcher.run.rundir import RunDir

    outs = _two_ranks(tmp_path, COMMIT)
    renames = [json.loads(p.read_text()) for p in outs]
    done = sorted(name for r in renames for _thread, name in r)
    assert done == [f"step_{s:08d}" for s in range(1, 5)]
    assert {thread for r in renames for thread, _name in r} == {"checkpoint-writer"}
    rd = RunDir(tmp_path / "run")
    assert [p.name for p in rd.checkpoints()] == ["step_00000003", "step_00000004"]
    for p in rd.checkpoints():
        assert {f.name for f in p.glob("part_*.pt")} == {"part_0.pt", "part_1.pt"}
        assert (p / "checkpoint.json").is_file()
