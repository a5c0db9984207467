"""A user's own code is a first-class recipe: a package written outside the project (a small MLP under
torch DDP, its own seeded data) that uses only the public training API (launcher.training, the loop
of docs/training-api.md) survives two preemptions on 2 Slurm nodes and ends bit for bit where an
uninterrupted run ends: every step's loss, the final weights, optimizer and RNG states, and one
metrics row per step."""
import os
import random
import time
from pathlib import Path

import pytest
from test_fault_tolerance import QUICK, assert_identical, only_run, preempt_twice_and_check

from helpers import launch, read_metrics

USER_TRAIN = '''"""My own training loop: an MLP, DDP, data seeded by (seed, step, rank)."""
import time

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from launcher.training import Checkpoint, StepLoop


def batch(seed, step, rank):
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1_009 + rank)
    x = torch.randn(16, 8, generator=g)
    return x, x[:, :4].sum(1, keepdim=True) - x[:, 4:].prod(1, keepdim=True)


def main(cfg, ctx):
    seed = int(cfg.seed)
    torch.manual_seed(seed)
    model = DistributedDataParallel(torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Dropout(0.1), torch.nn.Linear(32, 1)))
    torch.manual_seed(seed + 1 + ctx.rank)  # each rank's own dropout masks
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loop = StepLoop(cfg, ctx, Checkpoint(cfg, ctx, {"model": model, "optimizer": opt}))
    # a drill's moment (recipe.params.hold_<attempt>=k): held at the start of step k + 1 until the job is
    # signalled, every rank together; the step then runs and the loop stops at its boundary
    hold = int(cfg.recipe.params.get(f"hold_{ctx.attempt}", -1)) + 1
    for step in loop:
        while step == hold and ctx.should_stop() is None:
            time.sleep(0.05)
        x, y = batch(seed, step, ctx.rank)
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean)
        loop.log(loss=mean.item() / ctx.world_size)
        time.sleep(float(cfg.recipe.params.step_s))  # a step that takes a while, as real ones do
    return {"steps": loop.steps, "resumed_from": loop.start, "final_loss": loop.values("loss")[-1]}
'''


def user_package(where: Path) -> Path:
    """The user's project dir (not a git repo, outside the launcher's tree) holding mlp_user/."""
    pkg = where / "mlp_user"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "train.py").write_text(USER_TRAIN)
    return where


@pytest.mark.slurm
@pytest.mark.timeout(900)
def test_a_users_ddp_loop_preempted_twice_on_slurm_ends_bitwise_identical(slurm, tmp_path):
    seed = int(os.environ.get("FT_SEED", time.time_ns() % 10_000))
    rng = random.Random(seed)
    print(f"FT_SEED={seed}")
    project = user_package(tmp_path / "project")
    # the requeue once attempt 1 logged a random step k1 (by step 14), the time-limit signal once attempt 2
    # logged k2 (within 8 of k1): each attempt held in the step after until its signal, so every signal
    # finds the job running however fast the machine
    k1 = rng.randint(3, 14)
    k2 = rng.randint(k1 + 2, k1 + 8)
    cfg = ["recipe._target_=mlp_user.train.main", "+recipe.params.step_s=0.05", "cluster=local_slurm",
           "cluster.nodes=2", "cluster.gpus_per_node=1", "train.global_batch_size=64", "train.steps=60",
           "train.checkpoint.every=5", *QUICK]
    hold = [f"+recipe.params.hold_1={k1}", f"+recipe.params.hold_2={k2}"]
    roots = {k: tmp_path / k for k in ("interrupted", "reference")}
    for name, root in roots.items():  # both jobs queue at once; Slurm runs them side by side
        res = launch([*cfg, *(hold if name == "interrupted" else [])], root, extra_env=slurm, cwd=project)
        assert res.returncode == 0, res.stdout + res.stderr
    run, ref = only_run(roots["interrupted"]), only_run(roots["reference"])
    preempt_twice_and_check(run, ref, slurm, k1, k2)
    assert [r["step"] for r in read_metrics(ref)] == list(range(1, 61))
    assert_identical(run, ref)  # one row per step 1..60, equal losses, every tensor of the last checkpoint
    assert (run / "checkpoints" / "latest").read_text().strip().endswith("60")
