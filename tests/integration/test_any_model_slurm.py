"""Any model on every engine, on 2 real Slurm nodes (recipe=lm, docs/models.md): a user's nn.Module from a
package written outside the tree, trained by FSDP2, ZeRO-2 and ZeRO-3 with one rank per node (fp32,
dropout 0), and hf_llama_tiny (transformers' LlamaForCausalLM from its config) on FSDP2, all with the
shipped defaults (wandb on: one wandb run across the requeue, every step in its offline files).
(hf_llama_tiny on every engine with a bitwise resume: test_engines_any_model.py, on one host.)

Per model one Slurm array holds every engine's uninterrupted run (2 nodes each), and a second the run
preempted mid-step: ZeRO-3 for the user's module (the most sharded state: parameters, gradients and
optimizer; ZeRO-2's and FSDP2's resumes are bitwise in test_engines_any_model.py, and FSDP2's across
Slurm nodes below, with hf_llama_tiny), FSDP2 for hf_llama_tiny. The preempted run is held at step 5 on attempt 1
(train.fail_mode=sleep on the second node's rank: a step that never ends, so the drill's moment is exact
whatever the machine's load),
then `scontrol requeue`d: Slurm kills it mid-step and starts it again, and it resumes from the
checkpoint after step 3 (train.checkpoint.every=3), redoing steps 4 and 5. Then

- every run's loss curve (8 steps) equals the single-process curve (one process, the same 16 samples
  a step in 8 micro batches) within fp32 rounding: the bound of the GPT's layout-equivalence tests
  (tests/integration/test_engine_deepspeed.py, FP32_LOSS_RTOL = 1e-6);
- the preempted run ends bitwise equal to the uninterrupted run of its engine: every step's loss, and
  every tensor of the final checkpoint (weights, optimizer state, RNG states, every rank's shard).

The preempted run doubles as the layout run (its losses are compared with the single-process curve too).
"""
import json
import os
import subprocess
from pathlib import Path
from typing import Dict, List

import pytest
from test_fault_tolerance import assert_identical, last_step, restarts, status, wait_for

from helpers import FINAL, assert_one_wandb_run, launch, read_metrics, runs_json

FP32_LOSS_RTOL = 1e-6  # tests/integration/test_engine_deepspeed.py: ~2 float32 ulp of the loss
STEPS, EVERY, HELD_AT = 8, 3, 5
BASE = ["recipe=lm", "precision=fp32", f"train.steps={STEPS}", "train.global_batch_size=16",
        "train.micro_batch_size=2", "optim.lr=3e-3", "optim.warmup_steps=2", "seed=11", "lm.seq_len=32",
        f"train.checkpoint.every={EVERY}", "train.log_interval=0"]
# the drill, on attempt 1 only; `train.fail_at_step=5` turns it on
DRILL = ["train.fail_mode=sleep", "train.fail_rank=1", "train.fail_attempt=1"]
# one point per engine: options of a config group the test adds (`--config-dir`), so that one array
# holds them all (fsdp takes no ZeRO stage, so `parallelism=... zero=...` cannot be swept as a product)
ENGINES = {
    "fsdp": "parallelism:\n  engine: fsdp\n",
    "zero2": "parallelism:\n  engine: deepspeed\nzero:\n  stage: 2\n",
    "zero3": "parallelism:\n  engine: deepspeed\nzero:\n  stage: 3\n",
}

USER_NET = '''"""My own language model: embedding, a ModuleList of residual MLP blocks, a head."""
import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.up, self.down = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self, vocab, hidden=32, layers=2):
        super().__init__()
        self.emb = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(Block(hidden) for _ in range(layers))
        self.head = nn.Linear(hidden, vocab)

    def forward(self, tokens):
        x = self.emb(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)
'''

# hf_llama_tiny on every engine, its resume bitwise: tests/integration/test_engines_any_model.py (one host)
MODELS = {
    "user_module": ["model._target_=anymodel_user.net.Net", "+model.vocab=${lm.vocab_size}", "+model.hidden=32",
                    "lm.vocab_size=128"],
    # a Hugging Face model (transformers.LlamaForCausalLM from its config) preempted on FSDP2 across nodes
    "hf_llama_tiny": ["model=hf_llama_tiny", "lm.vocab_size=128"],
}
# DDP on 2 Slurm nodes preempted twice: test_user_recipe.py (a user's DDP loop on the public step loop);
# here the engines whose state is sharded
ENGINES_OF = {"user_module": list(ENGINES), "hf_llama_tiny": ["fsdp"]}
PREEMPTED_OF = {"user_module": ["zero3"], "hf_llama_tiny": ["fsdp"]}


def project(where: Path) -> Path:
    """The user's project dir (not a git repo, outside the launcher's tree) holding anymodel_user/, and
    the config group of the engines under test (conf/lm_engine/)."""
    pkg = where / "anymodel_user"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "net.py").write_text(USER_NET)
    group = where / "conf" / "lm_engine"
    group.mkdir(parents=True)
    for name, body in ENGINES.items():
        (group / f"{name}.yaml").write_text("# @package _global_\n" + body)
    return where


def point(run_dir: Path) -> tuple:
    """(engine, preempted) of a run, from its archived config."""
    import yaml

    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    engine = cfg["parallelism"]["engine"]
    name = f"zero{cfg['zero']['stage']}" if engine == "deepspeed" else engine
    return name, cfg["train"]["fail_at_step"] is not None


def losses(run_dir: Path) -> List[float]:
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1)), run_dir
    return [r["loss"] for r in rows]


def held(run: Path) -> bool:
    """The run is in the step it is held in, its checkpoint after step EVERY committed."""
    latest = run / "checkpoints" / "latest"
    return last_step(run) >= HELD_AT - 1 and latest.exists() and latest.read_text().strip().endswith(f"{EVERY:08d}")


def max_rel(xs: List[float], ref: List[float]) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(xs, ref))


@pytest.mark.slurm
@pytest.mark.timeout(600)
@pytest.mark.parametrize("model", list(MODELS))
def test_every_engine_on_two_nodes_matches_one_process_and_survives_preemption(slurm, tmp_path, model):
    pytest.importorskip("transformers")  # the hf extra (scripts/setup.sh installs it)
    env = {**os.environ, **slurm}
    proj = project(tmp_path / "project")
    sweep_root, single_root = tmp_path / "slurm", tmp_path / "single"
    common = ["--config-dir", str(proj / "conf"), *BASE, *MODELS[model], *DRILL, "cluster=local_slurm",
              "cluster.nodes=2", "cluster.gpus_per_node=1"]
    # the preempted run queued first: it holds 2 nodes longest (held, then requeued)
    for engines, held_at in ((PREEMPTED_OF[model], str(HELD_AT)), (ENGINES_OF[model], "null")):
        res = launch(["-m", *common, f"+lm_engine={','.join(engines)}", f"train.fail_at_step={held_at}"],
                     sweep_root, extra_env=slurm, cwd=proj)
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    # the single-process curve, made while the array runs
    res = launch([*BASE, *MODELS[model], "cluster=local", "cluster.gpus_per_node=1", "parallelism.engine=ddp"],
                 single_root, cwd=proj, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    (single,) = runs_json(single_root)
    assert single["status"] == "completed", single
    reference = losses(Path(single["dir"]))

    runs: Dict[tuple, Path] = {point(Path(r["dir"])): Path(r["dir"]) for r in runs_json(sweep_root)}
    assert sorted(runs) == sorted([(e, False) for e in ENGINES_OF[model]] + [(e, True) for e in PREEMPTED_OF[model]])
    for engine in PREEMPTED_OF[model]:  # each preempted run: held in step 5, its checkpoint after step 3 committed
        run = runs[engine, True]
        wait_for(f"{engine} held in step {HELD_AT}", lambda run=run: held(run), 240)
        job_id = json.loads((run / "job.json").read_text())["job_id"]
        subprocess.run(["scontrol", "requeue", job_id], check=True, env=env)
    # read in this process (`launcher runs` once a second would take a core from the jobs)
    wait_for("every run's end", lambda: all(status(r).get("status") in FINAL for r in runs.values()), 300, poll=1)
    assert all(status(r)["status"] == "completed" for r in runs.values()), {k: status(r) for k, r in runs.items()}

    deviation = {}
    for engine in ENGINES_OF[model]:
        ref = runs[engine, False]
        assert status(ref).get("attempt", 1) == 1 and not restarts(ref)
        deviation[engine] = max_rel(losses(ref), reference)
        assert_one_wandb_run(ref, STEPS)  # wandb on (the default)
    for engine in PREEMPTED_OF[model]:
        run, ref = runs[engine, True], runs[engine, False]
        assert [(r["attempt"], r["from_step"]) for r in restarts(run)] == [(2, EVERY)], restarts(run)
        assert restarts(run)[0]["reason"] in ("preempted", "scheduler"), restarts(run)
        deviation[engine] = max(deviation[engine], max_rel(losses(run), reference))
        assert_identical(run, ref)  # every step's loss and every tensor of the final checkpoint, bitwise
        assert_one_wandb_run(run, STEPS)  # one wandb run across the requeue
    print(f"{model}: max |loss - single| / single over {STEPS} steps: "
          + ", ".join(f"{e} {d:.1e}" for e, d in deviation.items()))
    assert all(d <= FP32_LOSS_RTOL for d in deviation.values()), deviation
    assert reference[-1] < reference[0] - 0.1, reference  # it trains
