"""sweep=asha on real jobs: points pause at their rungs (checkpointed, their jobs ended), the rung's
decision resumes the best from their checkpoints and prunes the rest, and the winner ends bit for bit
where the same point run straight through ends.

- cluster=local, a user's own function recipe on the public StepLoop: 4 points, reduction 2 (4 -> 2 -> 1);
- cluster=local_slurm, the GPT recipe with the shipped defaults (wandb on): 4 points (optim.lr x
  optim.warmup_steps), rungs [2, 4, 8], reduction 2 (4 -> 2 -> 1), more points than array slots
  (cluster.array_parallelism=3): the paused array tasks held (their slots freed for the pending ones)
  and released by Slurm; no point fails at its pause, no job is left in the queue, and the winner's one
  wandb run holds every step.
"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Dict, List

import pytest
from test_fault_tolerance import QUICK, assert_identical

from helpers import BIN, assert_one_wandb_run, launch, read_metrics, run_cmd, runs_json, wait_final

USER_TRAIN = '''"""A user's loop on the public API: an MLP, data seeded by (seed, step, rank), lr from its params."""
import torch
import torch.nn.functional as F

from launcher.training import Checkpoint, StepLoop


def batch(seed, step, rank):
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1_009 + rank)
    x = torch.randn(16, 8, generator=g)
    return x, x[:, :4].sum(1, keepdim=True) - x[:, 4:].prod(1, keepdim=True)


def main(cfg, ctx):
    seed = int(cfg.seed)
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Dropout(0.1), torch.nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=float(cfg.recipe.params.lr))
    loop = StepLoop(cfg, ctx, Checkpoint(cfg, ctx, {"model": model, "optimizer": opt}))
    for step in loop:
        x, y = batch(seed, step, ctx.rank)
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        loop.log(loss=loss.item())
    return {"steps": loop.steps, "resumed_from": loop.start, "final_loss": loop.values("loss")[-1]}
'''


def user_package(where: Path) -> Path:
    pkg = where / "asha_user"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "train.py").write_text(USER_TRAIN)
    return where


def status_json(root: Path, sweep: str, env=None) -> Dict:
    res = run_cmd([str(BIN / "launcher"), "status", sweep, "--json", "--root", str(root)], root, timeout=120,
                  extra_env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    return json.loads(res.stdout)


def check_rule(runs: List[dict], summ: Dict, rungs: List[int], reduction: int, steps: int) -> dict:
    """The decisions, recomputed from each point's own metrics: at every pause rung the best
    max(1, n // reduction) by loss went on; returns the winner's run row."""
    by_index = {int(Path(r["dir"]).name): r for r in runs}
    alive = sorted(by_index)
    for i, step in enumerate(rungs):
        row = summ["rungs"][i]
        assert sorted(row["points"]) == alive, (i, row, alive)
        if step >= steps:
            break
        loss = {p: next(m["loss"] for m in read_metrics(by_index[p]["dir"]) if m["step"] == step) for p in alive}
        best = sorted(alive, key=lambda p: (loss[p], p))[:max(1, len(alive) // reduction)]
        assert sorted(row["promoted"]) == sorted(best), (i, row, loss)
        assert sorted(row["pruned"]) == sorted(set(alive) - set(best))
        alive = sorted(best)
    (winner,) = alive
    for p, r in by_index.items():
        assert r["status"] == ("completed" if p == winner else "pruned"), (p, r["status"])
    return by_index[winner]


@pytest.mark.timeout(600)
def test_asha_on_local_with_a_users_steploop(tmp_path):
    project = user_package(tmp_path / "project")
    base = ["recipe._target_=asha_user.train.main", "cluster=local", "cluster.gpus_per_node=1", "train.steps=6",
            *QUICK]
    root = tmp_path / "runs"
    res = launch(["-m", *base, "+recipe.params.lr=0.001,0.003,0.01,0.03", "sweep=asha", "sweep.rungs=[2,4]",
                  "sweep.reduction=2"], root, timeout=500, cwd=project)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    runs = wait_final(root, 4, timeout=120)
    summ = status_json(root, runs[0]["sweep_id"])["rungs"]
    assert [r["reported"] for r in summ["rungs"]] == [4, 2]
    winner = check_rule(runs, summ, [2, 4], 2, 6)
    assert [m["step"] for m in read_metrics(winner["dir"])] == list(range(1, 7))
    # steps run: 4 x 2 + 2 x 2 + 1 x 2 of 4 x 6; each start's cost counted as measured (summ["spent_s"])
    # starts: 4, and one per promotion but where the point that decided a rung went on itself
    assert (summ["steps"], summ["grid_steps"]) == (14, 24) and 4 < summ["starts"] <= 4 + 2 + 1
    assert 0 < summ["loop_s"] < summ["grid_loop_s"] and summ["spent_s"] > summ["loop_s"]
    # the winner, run straight through with the same budget: the same losses and weights, bit for bit
    from launcher.run.rundir import RunDir

    lr = RunDir(winner["dir"]).config()["recipe"]["params"]["lr"]
    ref_root = tmp_path / "ref"
    res = launch([*base, f"+recipe.params.lr={lr}"], ref_root, timeout=300, cwd=project)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    (ref,) = runs_json(ref_root)
    assert_identical(Path(winner["dir"]), Path(ref["dir"]))  # every step's loss, weights, optimizer, RNG


@pytest.mark.slurm
@pytest.mark.timeout(1800)
def test_asha_4_points_3_rungs_of_the_gpt_on_slurm(slurm, tmp_path):
    base = ["model=gpt_tiny", "cluster=local_slurm", "cluster.nodes=1", "cluster.gpus_per_node=1",
            "train.steps=8", "train.global_batch_size=4", "train.micro_batch_size=2", *QUICK]
    root = tmp_path / "runs"
    # 4 points, 3 rungs: every rung decides (4 -> 2 -> 1) with fewer array slots than points (3), 7 starts
    res = launch(["-m", *base, "optim.lr=1e-3,1e-2", "optim.warmup_steps=0,2", "sweep=asha",
                  "sweep.rungs=[2,4,8]", "sweep.reduction=2", "cluster.array_parallelism=3"], root,
                 extra_env=slurm, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    runs = wait_final(root, 4, timeout=1500)
    summ = status_json(root, runs[0]["sweep_id"], slurm)["rungs"]
    print(json.dumps({k: v for k, v in summ.items() if k != "lines"}, indent=1))
    print("\n".join(summ["lines"]))
    # wandb on (the default): every pause (the job's TERM reaches wandb's service) ends cleanly
    assert sorted(r["status"] for r in runs) == ["completed"] + ["pruned"] * 3, [r["status"] for r in runs]
    assert [r["reported"] for r in summ["rungs"]] == [4, 2, 1]
    winner = check_rule(runs, summ, [2, 4, 8], 2, 8)
    # steps run: 4 x 2 + 2 x 2 + 1 x 4 of 4 x 8; starts: 4 + 2 + 1 less the deciders that went on
    assert (summ["steps"], summ["grid_steps"]) == (16, 32) and 4 < summ["starts"] <= 7
    queued = subprocess.run(["squeue", "-h", "-j", ",".join(sorted({str(r["job_id"]).split("_")[0] for r in runs}))],
                            capture_output=True, text=True, env={**os.environ, **slurm}).stdout
    assert queued.strip() == "", queued  # no paused or pruned point's job left in the queue
    assert_one_wandb_run(Path(winner["dir"]), 8)  # one wandb run across its pauses, every step in it
    assert 0 < summ["loop_s"] < summ["grid_loop_s"] and summ["spent_s"] > summ["loop_s"]
    from launcher.run.rundir import RunDir

    cfg = RunDir(winner["dir"]).config()
    ref_root = tmp_path / "ref"
    res = launch([*base, f"optim.lr={cfg['optim']['lr']}", f"optim.warmup_steps={cfg['optim']['warmup_steps']}"],
                 ref_root, extra_env=slurm, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    (ref,) = wait_final(ref_root, 1, timeout=600)
    assert ref["status"] == "completed"
    assert_identical(Path(winner["dir"]), Path(ref["dir"]))  # every step's loss, weights, optimizer, RNG


HYDRA_APP = '''"""A Hydra app of its own: gradient descent on w^2, its state in its output dir, the loss reported."""
import json
import os
import subprocess
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig

from launcher.features.asha.rungs import at_step


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg):
    ckpt = Path(HydraConfig.get().runtime.output_dir) / "state.json"
    state = json.loads(ckpt.read_text()) if ckpt.exists() else {"step": 0, "w": 5.0, "losses": []}
    for step in range(state["step"] + 1, int(cfg.steps) + 1):
        state["w"] -= float(cfg.lr) * 2 * state["w"]
        state["losses"].append(state["w"] ** 2)
        state["step"] = step
        ckpt.write_text(json.dumps(state))  # saved before the report: a promotion resumes from here
        at_step(step, state["losses"][-1])
    return state["losses"][-1]


if __name__ == "__main__":
    main()
'''


@pytest.mark.timeout(600)
def test_asha_with_a_hydra_app_on_launcher_local(tmp_path):
    hydra_app_sweep(tmp_path, ["hydra/launcher=launcher_local"], None)


@pytest.mark.slurm
@pytest.mark.timeout(900)
def test_asha_with_a_hydra_app_on_launcher_slurm(slurm, tmp_path):
    # a paused point's job is held (scontrol requeuehold: its array slot freed); a promoted one released
    hydra_app_sweep(tmp_path, ["hydra/launcher=launcher_slurm", "hydra.launcher.partition=debug",
                               "hydra.launcher.timeout_min=10"], dict(slurm))


def hydra_app_sweep(tmp_path, launcher, env):
    import sys

    project = tmp_path / "app"
    (project / "conf").mkdir(parents=True)
    (project / "conf" / "config.yaml").write_text("lr: 0.1\nsteps: 6\n")
    (project / "app.py").write_text(HYDRA_APP)
    root = tmp_path / "runs"
    res = run_cmd([sys.executable, "app.py", "-m", "lr=0.3,0.01,0.1,0.05", *launcher,
                   f"hydra.sweep.dir={tmp_path / 'out'}",
                   "+hydra.launcher.sweep={scheduler: asha, rungs: [2, 4], reduction: 2}"], root, timeout=500,
                  cwd=project, extra_env=env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]  # the launcher waits for every point
    runs = wait_final(root, 4, timeout=300)
    summ = status_json(root, runs[0]["sweep_id"], env)["rungs"]
    assert [r["reported"] for r in summ["rungs"]] == [4, 2]
    # the loss falls fastest with lr 0.3, then 0.1 (points 0 and 2): they go on, then 0 alone
    assert summ["rungs"][0]["promoted"] == [0, 2] and summ["rungs"][1]["promoted"] == [0]
    assert {int(Path(r["dir"]).name): r["status"] for r in runs} == {0: "completed", 1: "pruned", 2: "pruned",
                                                                      3: "pruned"}
    from launcher.run.rundir import RunDir

    w = 5.0 * (1 - 2 * 0.3) ** 6
    assert RunDir(runs[0]["dir"]).status().summary["return_value"] == pytest.approx(w ** 2, rel=1e-12)
