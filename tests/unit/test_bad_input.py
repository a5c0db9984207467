"""Bad input: every invalid configuration is rejected by the full pre-submit check, naming its key,
and nothing is submitted. Config rules (launcher.layout) and the planner's checks (launcher.plan.checks)."""
from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir

from helpers import launch
from launcher.app import CONF_DIR, normalize_overrides
from launcher.submit.pipeline import InvalidSweep, Point, check

A100_1B3 = ["model=gpt_1b3", "cluster=a100_80g", "precision=bf16"]

BAD = [
    # --- sizes and divisibility
    (["cluster.nodes=0"], "cluster.nodes"),
    (["cluster.gpus_per_node=0"], "cluster.gpus_per_node"),
    (["train.micro_batch_size=0"], "train.micro_batch_size"),
    (["train.global_batch_size=0"], "train.global_batch_size"),
    (["train.global_batch_size=18"], "train.global_batch_size"),
    (["model.num_layers=0"], "model.num_layers"),
    (["model.hidden_size=0"], "model.hidden_size"),
    (["model.seq_len=0"], "model.seq_len"),
    (["model.num_heads=5"], "model.num_heads"),
    (["parallelism.tp=3"], "parallelism.tp"),
    (["parallelism.dp=3"], "parallelism.dp"),
    (["cluster.nodes=2", "cluster.gpus_per_node=2", "parallelism.tp=4"], "parallelism.tp"),  # TP across nodes
    (["cluster.gpus_per_node=4", "parallelism.tp=4", "model.ffn_hidden_size=250"], "model.ffn_hidden_size"),
    (["cluster.gpus_per_node=4", "parallelism.tp=4", "model.vocab_size=510"], "model.vocab_size"),
    (["parallelism.pp=2", "model.num_layers=3"], "model.num_layers"),
    # --- ZeRO, offload, sequence parallelism, engines
    (["zero.stage=4"], "zero.stage"),
    (["zero.offload_optimizer=true"], "zero.offload_optimizer"),
    (["zero=2", "zero.offload_params=true"], "zero.offload_params"),
    (["parallelism.sequence_parallel=true"], "parallelism.sequence_parallel"),
    (["parallelism.engine=ddp", "parallelism.tp=2"], "parallelism.engine"),
    (["parallelism.engine=ddp", "zero=1"], "zero.stage"),
    (["parallelism.engine=deepspeed", "parallelism.pp=2"], "parallelism.engine"),
    (["parallelism.engine=megatron", "parallelism.tp=2", "zero=2"], "zero.stage"),
    (["parallelism.tp=2", "zero=1", "zero.offload_optimizer=true"], "zero.offload_optimizer"),
    # --- optimiser, model, fault injection
    (["optim.lr=0"], "optim.lr"),
    (["optim.warmup_steps=1000"], "optim.warmup_steps"),
    (["optim.warmup_steps=-1"], "optim.warmup_steps"),
    (["model.dropout=1.5"], "model.dropout"),
    (["train.fail_at_step=1", "train.fail_rank=5"], "train.fail_rank"),
    (["submit.job_name=${oc.env:LAUNCHER_SURELY_UNSET_VARIABLE}"], "submit.job_name"),
    # --- the planner: does not fit (errors name the memory key and the fix key)
    (["model=gpt_175b", "cluster=a100_80g", "train.micro_batch_size=1", "train.global_batch_size=64"],
     "cluster.gpu.memory_gb"),
    ([*A100_1B3, "cluster.gpu.memory_gb=16", "train.micro_batch_size=8", "train.global_batch_size=64"],
     "parallelism.tp=8"),
    (["model=llama_7b", "cluster=h100_80g", "precision=bf16", "parallelism.engine=ddp", "train.micro_batch_size=2",
      "train.global_batch_size=64"], "zero.stage=3"),
    (["model=gpt_175b", "cluster=local"], "cluster.gpu.memory_gb"),  # this host's memory
    (["model=llama_7b", "cluster=a100_80g", "precision=bf16", "zero=3", "zero.offload_optimizer=true",
      "zero.offload_params=true", "cluster.mem_gb=64", "train.micro_batch_size=1", "train.global_batch_size=64"],
     "cluster.mem_gb"),
    # --- the planner: warnings (stop the launch unless submit.force=true)
    ([*A100_1B3, "parallelism.pp=4", "train.micro_batch_size=4", "train.global_batch_size=32"], "parallelism.pp"),
    ([*A100_1B3, "cluster.nodes=4", "zero=3", "train.micro_batch_size=1", "train.global_batch_size=64"], "zero.stage"),
]


def compose_cfg(overrides):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=normalize_overrides(list(overrides)))


def test_the_set_is_large_enough():
    assert len(BAD) >= 25 and len({tuple(o) for o, _ in BAD}) == len(BAD)


@pytest.mark.parametrize("overrides,key", BAD, ids=[" ".join(o) for o, _ in BAD])
def test_rejected_with_the_key_named(overrides, key):
    with pytest.raises(InvalidSweep) as ei:
        check([Point(compose_cfg(overrides), list(overrides))])
    text = str(ei.value)
    assert "nothing was submitted" in text and key in text, text
    if "cluster.gpu.memory_gb" not in key and "GiB per GPU" in text:
        assert "cluster.gpu.memory_gb" in text  # a memory error names the capacity it exceeded as well


@pytest.mark.parametrize("overrides,key", [b for b in BAD if b[1] in ("parallelism.pp", "zero.stage")][-2:])
def test_warnings_pass_when_forced(overrides, key, capsys):
    assert len(check([Point(compose_cfg([*overrides, "submit.force=true"]))])) == 1
    assert key in capsys.readouterr().err


def test_one_bad_point_rejects_the_whole_sweep():
    points = [Point(compose_cfg(o), o) for o in (["optim.lr=1e-3"], BAD[30][0], ["optim.lr=3e-3"])]
    with pytest.raises(InvalidSweep) as ei:
        check(points)
    assert str(ei.value).startswith("1 of 3 point(s) invalid; nothing was submitted")


# ---- through the real `launch` command: non-zero exit, nothing written ----------------------------------

LAUNCH_BAD = [
    (["model=gpt_175b"], "cluster.gpu.memory_gb"),  # cluster=local: this host's memory
    (["parallelism.pp=2", "train.micro_batch_size=8"], "submit.force=true"),  # bubble 33%: a warning stops it
    (["-m", "cluster.gpu.memory_gb=0,0.001"], "1 of 2 point(s) invalid; nothing was submitted"),  # 1 MiB GPUs
]


@pytest.mark.parametrize("overrides,needle", LAUNCH_BAD, ids=[" ".join(o) for o, _ in LAUNCH_BAD])
def test_launch_rejects_and_writes_nothing(overrides, needle, runs_root):
    res = launch(overrides, runs_root, timeout=120)
    assert res.returncode != 0
    assert needle in res.stderr, res.stderr[-2000:]
    assert not runs_root.exists() or not any(runs_root.rglob("run.json"))


def test_launch_force_turns_warnings_into_stderr(runs_root):
    res = launch(["parallelism.pp=2", "train.micro_batch_size=8", "submit.force=true", "submit.dry_run=true"],
                 runs_root, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "pipeline bubble 33%" in res.stderr and "# dry run: nothing submitted" in res.stdout
