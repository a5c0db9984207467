"""`launcher verify-resume` on user programs that resume wrongly on purpose, one per kind of mistake, and
on ones that resume right: each real run stopped by the product's stop path and resumed as a requeue
resumes it, against the same run straight through. The verdict must name the first step after the
stop and the right component (docs/training-api.md, "Verifying a resume")."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from helpers import BIN, run_cmd

# A user's function recipe on the public training API (an MLP with dropout, AdamW, a learning-rate
# schedule), with one mistake chosen by `+recipe.params.bug=...`: the optimizer left out of the checkpoint, the RNG
# seeded again after the resume, a data stream of its own that starts over, a scheduler left out, a
# number it reports kept in a module global.
PROGRAM = '''
import torch
import torch.nn.functional as F

from launcher.training import Checkpoint, StepLoop

_EMA = None  # the "global" mistake: a running mean kept in the module, lost at a restart


def main(cfg, ctx):
    global _EMA
    bug = str(cfg.recipe.params.get("bug", "none"))
    seed = int(cfg.seed)
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Dropout(0.2), torch.nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    state = {"model": model, "scheduler": sched}
    if bug != "optimizer":
        state["optimizer"] = opt
    if bug == "scheduler":
        del state["scheduler"]
    data = torch.Generator().manual_seed(seed)  # the "data" mistake: a stream of its own, not checkpointed
    loop = StepLoop(cfg, ctx, Checkpoint(cfg, ctx, state))
    if bug == "rng":
        torch.manual_seed(seed + 1)  # seeded again after the checkpoint restored the RNG states
    for step in loop:
        if bug == "data":
            x = torch.randn(16, 8, generator=data)
        else:
            x = torch.randn(16, 8, generator=torch.Generator().manual_seed(seed * 1000 + step))
        y = x[:, :4].sum(1, keepdim=True) - x[:, 4:].prod(1, keepdim=True)
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        _EMA = loss.item() if _EMA is None else 0.9 * _EMA + 0.1 * loss.item()
        row = {"loss": loss.item(), "lr": sched.get_last_lr()[0]}
        if bug == "global":
            row["loss_ema"] = _EMA
        loop.log(**row)
    return {"final_loss": loop.values("loss")[-1]}
'''

STEPS, AT = 6, 3
BASE = ["recipe._target_=resumebugs.train.main", "cluster.gpus_per_node=1", "train.log_interval=0"]


def project(tmp_path: Path) -> Path:
    proj = tmp_path / "proj"
    (proj / "resumebugs").mkdir(parents=True)
    (proj / "resumebugs" / "__init__.py").write_text("")
    (proj / "resumebugs" / "train.py").write_text(PROGRAM)
    return proj


def verify(args, root: Path, cwd: Path, timeout: float = 240):
    return run_cmd([str(BIN / "launcher"), "verify-resume", *args, "--root", str(root)], root, timeout=timeout,
                   cwd=cwd)


def record(res) -> dict:
    m = re.search(r"\(record: (.*verify_resume\.json)\)", res.stdout)
    assert m, res.stdout[-3000:] + res.stderr[-3000:]
    return json.loads(Path(m.group(1)).read_text())


@pytest.mark.timeout(300)
@pytest.mark.parametrize("bug,component,named", [
    ("optimizer", "optimizer", "the checkpoints hold no optimizer state at all"),
    ("rng", "rng", "an RNG state differs: "),
    ("data", "forward", "the loss (the forward pass) differs: loss"),
    ("scheduler", "scheduler", "the learning rate differs: "),
    ("global", "metric", "a reported number differs: loss_ema"),
])
def test_each_kind_of_wrong_resume_is_named_at_the_first_step_after_the_stop(bug, component, named, tmp_path):
    root = tmp_path / "runs"
    res = verify([*BASE, f"+recipe.params.bug={bug}", f"--steps={STEPS}", f"--at={AT}"], root, project(tmp_path))
    assert res.returncode == 1, res.stdout[-3000:] + res.stderr[-3000:]
    (v,) = record(res)["verdicts"]
    assert v["kind"] == "diverges" and v["first_step"] == AT + 1 and v["component"] == component, v
    assert named in v["detail"], v
    assert f"verify-resume: diverges at step {AT + 1}: " in res.stdout and named in res.stdout, res.stdout[-2000:]
    assert "likely: " in res.stdout


@pytest.mark.timeout(300)
def test_a_program_that_resumes_right_is_bitwise_and_show_says_so(tmp_path):
    root = tmp_path / "runs"
    res = verify([*BASE, f"--steps={STEPS}", f"--at={AT}"], root, project(tmp_path))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rec = record(res)
    (v,) = rec["verdicts"]
    assert v["kind"] == "bitwise" and v["stopped_at"] == [AT], v
    assert "checkpoint files" in v["compared"], v  # the tensors were compared, not only the metrics
    show = run_cmd([str(BIN / "launcher"), "show", rec["runs"][1], "--root", str(root)], root, timeout=60)
    assert show.returncode == 0 and "verify-resume" in show.stdout and "bitwise" in show.stdout, show.stdout


# A script that checkpoints itself (torch.save into LAUNCHER_CHECKPOINT_DIR), handles the time-limit
# signal as a flag (docs/scripts.md) and writes its losses as metrics rows: the launcher sees no tensor
# of it, so the verdict is from the rows, and says so.
SCRIPT = '''
import json, os, signal, sys, time
import torch

stop = []
signal.signal(signal.SIGUSR2, lambda *a: stop.append(1))
ckpt = os.path.join(os.environ["LAUNCHER_CHECKPOINT_DIR"], "state.pt")
torch.manual_seed(0)
model = torch.nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
start = 0
if os.path.exists(ckpt):
    saved = torch.load(ckpt)
    model.load_state_dict(saved["model"]); opt.load_state_dict(saved["opt"]); start = saved["step"]
steps = int(sys.argv[1])
main = os.environ.get("RANK", "0") == "0"  # every rank trains the same; rank 0 alone writes, as scripts do
with open(os.environ["LAUNCHER_METRICS_FILE"] if main else os.devnull, "a") as metrics:
    for step in range(start + 1, steps + 1):
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(step))
        loss = ((model(x) - x.sum(1, keepdim=True)) ** 2).mean()
        opt.zero_grad(); loss.backward(); opt.step()
        if main:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, ckpt + ".tmp")
            os.replace(ckpt + ".tmp", ckpt)
        metrics.write(json.dumps({"step": step, "loss": loss.item()}) + "\\n"); metrics.flush()
        if stop:
            sys.exit(0)
        time.sleep(0.3)
'''


@pytest.mark.timeout(300)
def test_a_script_that_checkpoints_itself_is_compared_by_its_losses(tmp_path):
    root, proj = tmp_path / "runs", tmp_path / "proj"
    proj.mkdir()
    (proj / "train.py").write_text(SCRIPT)
    res = verify(["recipe=script", "recipe.script=train.py", "recipe.args=[12]", "--steps=12", "--at=4"], root, proj)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    (v,) = record(res)["verdicts"]
    assert v["kind"] == "bitwise" and v["stopped_at"][0] >= 4, v
    assert v["compared"].startswith("metrics rows only"), v


# the shipped recipes on the engines, with the shipped defaults (2 local processes): bitwise (the GPT
# recipe's own, on an archived run: the README's `launcher verify-resume RUN`, tests/integration/test_readme.py)
SHIPPED = {
    "lm_ddp": ["recipe=lm", "model=hf_llama_tiny", "parallelism.engine=ddp", "train.log_interval=0"],
    "lm_fsdp2": ["recipe=lm", "model=hf_llama_tiny", "parallelism.engine=fsdp", "train.log_interval=0"],
    "lm_zero2": ["recipe=lm", "model=hf_llama_tiny", "parallelism.engine=deepspeed", "zero=2",
                 "train.log_interval=0"],
    # the GPT recipe on megatron with two data-parallel replicas (dp 2 x tp 2): each stage's shard read
    # once per dp group at resume and broadcast to the other replica (checkpoint.load_on_one_rank)
    "gpt_megatron_dp2_tp2": ["parallelism=tp", "cluster.gpus_per_node=4", "train.log_interval=0"],
}


@pytest.mark.timeout(400)
@pytest.mark.parametrize("case", sorted(SHIPPED))
def test_the_shipped_recipes_on_each_engine_resume_bitwise(case, tmp_path):
    root = tmp_path / "runs"
    res = verify([*SHIPPED[case], "--steps=4", "--at=2"], root, tmp_path, timeout=360)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    (v,) = record(res)["verdicts"]
    assert v["kind"] == "bitwise" and v["stopped_at"] == [2] and "checkpoint files" in v["compared"], v
