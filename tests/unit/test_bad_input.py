"""Bad input: every invalid configuration is rejected by the full pre-submit check, naming its key,
and nothing is submitted. Config rules (launcher.config.rules) and the planner's checks (recipes.gpt.plan.checks).

Every key of the schema is walked (launcher.config.schema.leaves): each numeric key out of its declared bounds
(and nan / inf for floats), each enum with a bogus value, each string (and list item, mapping key and
value) with a control character; and no control character ever reaches an sbatch script through the
real `launch` command."""
from __future__ import annotations

import copy
import enum
import functools
import math
import re

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf, open_dict

from helpers import REPO
from launcher.app import CONF_DIR, normalize_overrides
from launcher.config import schema
from launcher.submit.pipeline import InvalidSweep, Point, validate as check

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
    (["cluster=local_slurm", "cluster.nodes=2", "cluster.gpus_per_node=2", "parallelism.tp=4"],
     "parallelism.tp"),  # TP across nodes
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
    # --- values that used to pass, be archived and fail at run time
    (["+train.stepz=5"], "train.stepz"),  # '+' adds any key: the rules refuse what the schema lacks
    (["+cluster.gpu.memroy_gb=80"], "cluster.gpu.memroy_gb"),
    (["optim.lr=nan"], "optim.lr"),
    (["optim.lr=inf"], "optim.lr"),
    (["seed=18446744073709551616"], "seed"),  # beyond 64 bits
    (["seed=-1"], "seed"),
    (["data.seed=9223372036854775808"], "data.seed"),
    (["data.branching=0"], "data.branching"),
    (["model.vocab_size=3", "data.branching=4"], "data.branching"),
    (["train.dist_timeout_s=0"], "train.dist_timeout_s"),
    (["precision.initial_scale_power=41"], "precision.initial_scale_power"),
    (["precision.initial_scale_power=-1"], "precision.initial_scale_power"),
    (["precision.loss_scale=-1"], "precision.loss_scale"),  # not "dynamic"
    (["precision.min_loss_scale=0"], "precision.min_loss_scale"),
    (["precision.loss_scale_window=0"], "precision.loss_scale_window"),
    (["precision.hysteresis=0"], "precision.hysteresis"),
    (["cluster.gpu.memory_gb=-1"], "cluster.gpu.memory_gb"),
    (["cluster.gpu.peak_tflops=-1"], "cluster.gpu.peak_tflops"),
    (["cluster.intra_node_bandwidth=-1"], "cluster.intra_node_bandwidth"),
    (["cluster.inter_node_bandwidth=-1"], "cluster.inter_node_bandwidth"),
    (["optim.min_lr_ratio=1.5"], "optim.min_lr_ratio"),
    (["optim.weight_decay=-0.1"], "optim.weight_decay"),
    (["optim.beta1=1.0"], "optim.beta1"),
    (["optim.beta2=-0.5"], "optim.beta2"),
    (["optim.eps=0"], "optim.eps"),
    (["optim.grad_clip=-1"], "optim.grad_clip"),
    (["train.log_interval=-1"], "train.log_interval"),
    (["submit.wait_timeout_s=-1"], "submit.wait_timeout_s"),
    (["train.fail_at_step=0"], "train.fail_at_step"),
    (["train.fail_at_step=61"], "train.fail_at_step"),  # after the last step: never fires
    (["train.faults=[{at_step:61,rank:1}]"], "train.faults[0].at_step"),  # a listed fault: the same
    (["train.faults=[{at_step:2},{at_step:2,rank:2}]"], "train.faults[1].rank"),  # a 2-process job
    (["train.faults=[{at_step:0}]"], "train.faults[0].at_step"),
    (["train.faults=[{at_step:2,attempt:0}]"], "train.faults[0].attempt"),
    (["train.hang_timeout_s=600"], "train.dist_timeout_s"),  # collectives would give up first
    (["train.max_restarts=6"], "train.max_restarts"),  # submitit's local controller stops at 6 starts
    (["recipe._target_=recipes.gpt.train.mian"], "recipe._target_"),
    (["recipe._target_=recipes.gpt.tran.main"], "recipe._target_"),
    (["recipe._target_=surely_no_such_package.train.main"], "recipe._target_"),
    (["cluster.nodes=2"], "cluster.nodes"),  # the local backend runs one node
    (["cluster=a100_80g", "cluster.time_min=0"], "cluster.time_min"),
    (["cluster.time_min=2"], "cluster.signal_delay_s"),  # the 120 s signal would come at the start
    (["cluster=local_slurm", "cluster.time_min=3", "cluster.signal_delay_s=100"], "cluster.signal_delay_s"),
    (["cluster=a100_80g", "cluster.cpus_per_task=0"], "cluster.cpus_per_task"),
    (["cluster=a100_80g", "cluster.mem_gb=-1"], "cluster.mem_gb"),  # (0: all of each node's memory)
    (["cluster=a100_80g", "cluster.array_parallelism=0"], "cluster.array_parallelism"),
    # a recipe's own settings (recipe.params), read by a pure function at launch
    (["recipe=commbench", "recipe.params.max_bytes=-5"], "recipe.params"),
    (["recipe=commbench", "recipe.params.dtype=int8"], "recipe.params"),
    (["recipe=commbench", "recipe.params.factor=1"], "recipe.params"),
    # more CPUs asked per node than the node has (the template says how many)
    ([*A100_1B3, "cluster.cpus_per_task=17", "train.micro_batch_size=1", "train.global_batch_size=64"],
     "cluster.cpus_per_task"),
    (["cluster=a100_80g", "cluster.cpus_per_node=0"], "cluster.cpus_per_node"),
    (["cluster=a100_80g", "+cluster.sbatch_extra.reservation='big\ntouch pwned #'"],
     "cluster.sbatch_extra.reservation"),
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
    assert len(BAD) >= 70 and len({tuple(o) for o, _ in BAD}) == len(BAD)


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
    points = [Point(compose_cfg(o), o) for o in (["optim.lr=1e-3"], ["optim.lr=nan"], ["optim.lr=3e-3"])]
    with pytest.raises(InvalidSweep) as ei:
        check(points)
    assert str(ei.value).startswith("1 of 3 point(s) invalid; nothing was submitted")


# ---- through the real `launch` command: non-zero exit, nothing written ----------------------------------


# ---- every key of the schema ---------------------------------------------------------------------------

LEAVES = schema.leaves("recipes.gpt.train.main")  # the launcher's keys and the shipped recipe's model group
SLURM = ["cluster=a100_80g", "train.global_batch_size=32"]  # a valid Slurm config: values reach an sbatch script


def _literal(v) -> str:
    if isinstance(v, float):
        return {math.inf: "inf", -math.inf: "-inf"}.get(v, "nan" if v != v else repr(v))
    return str(v)


def out_of_bounds(leaf: schema.Leaf):
    """Values just outside the bounds the schema declares for ``leaf`` (and nan/inf for floats, 2**63
    for an int without an upper bound)."""
    b = leaf.bounds
    one = 1.0 if leaf.type is float else 1
    out = []
    if b.ge is not None:
        out.append(leaf.type(b.ge) - one)
    if b.gt is not None:
        out.append(leaf.type(b.gt))
    if b.le is not None:
        out.append(leaf.type(b.le) + one)
    if b.lt is not None:
        out.append(leaf.type(b.lt))
    if leaf.type is float:
        out += [math.nan, math.inf, -math.inf]
    elif b.le is None and b.lt is None:
        out.append(2**63)
    return out


NUMERIC = [(leaf.key, v) for leaf in LEAVES if leaf.type in (int, float) for v in out_of_bounds(leaf)]
ENUMS = [leaf.key for leaf in LEAVES if isinstance(leaf.type, type) and issubclass(leaf.type, enum.Enum)]
STRINGS = [leaf for leaf in LEAVES if leaf.type is str or (leaf.type in (list, dict) and leaf.item is str)]


def _refused(overrides, key, base=(), cfg=None):
    """The check's refusal of ``overrides`` (on ``base``), naming ``key``; ``cfg``: the config they
    compose to, where the caller made it."""
    with pytest.raises(InvalidSweep) as ei:
        check([Point(compose_cfg([*base, *overrides]) if cfg is None else cfg, list(overrides))])
    text = str(ei.value)
    assert "nothing was submitted" in text and re.search(rf"- {re.escape(key)}:", text), text
    return text


def test_the_walk_covers_the_schema():
    assert len(NUMERIC) >= 120 and len(ENUMS) >= 4 and len(STRINGS) >= 15
    assert {"wandb.mode", "precision.dtype", "parallelism.engine", "train.recompute"} <= set(ENUMS)
    # every numeric key declares its bounds in the schema (a new one is checked by declaring them)
    assert not [leaf.key for leaf in LEAVES if leaf.type in (int, float) and leaf.bounds is None]


@pytest.mark.parametrize("key,value", NUMERIC, ids=[f"{k}={_literal(v)}" for k, v in NUMERIC])
def test_every_numeric_key_out_of_bounds_is_refused(key, value):
    # the value set on a composed base (one Hydra compose per base, not one per case: ~0.2 s each, 179
    # cases); the same typed node takes it as a command-line override would (those go through Hydra in
    # test_rejected_with_the_key_named)
    base = SLURM if key.startswith("cluster.") else []
    cfg = copy.deepcopy(_composed(tuple(base)))
    OmegaConf.update(cfg, key, value, merge=False)
    text = _refused([f"{key}={_literal(value)}"], key, base, cfg=cfg)
    assert "fix:" in text


@functools.cache
def _composed(base):
    return compose_cfg(list(base))


@pytest.mark.parametrize("key", ENUMS)
def test_every_enum_refuses_a_bogus_value_at_composition(key):
    with pytest.raises(ConfigCompositionException) as ei:
        compose_cfg([f"{key}=surely_bogus"])
    assert f"full_key: {key}" in str(ei.value.__cause__) and "expected one of" in str(ei.value.__cause__)


def test_a_bogus_backend_is_refused():
    _refused(["cluster.backend=pbs"], "cluster.backend")


def _newline_overrides(leaf: schema.Leaf):
    """(override, key the error must name) putting a newline into ``leaf``."""
    if leaf.type is list:
        return [f"{leaf.key}=['fine','x\ntouch pwned #']"], f"{leaf.key}[1]"
    if leaf.type is dict:
        return [f"+{leaf.key}.NAME='x\ntouch pwned #'"], f"{leaf.key}.NAME"
    return [f"{leaf.key}='x\ntouch pwned #'"], leaf.key


@pytest.mark.parametrize("leaf", STRINGS, ids=[leaf.key for leaf in STRINGS])
def test_every_string_with_a_control_character_is_refused(leaf):
    overrides, key = _newline_overrides(leaf)
    _refused(overrides, key, SLURM)


@pytest.mark.parametrize("char", ["\r", "\t", "\x00", "\x1b", "\x7f"])
def test_every_control_character_is_refused(char):
    cfg = compose_cfg(SLURM)
    cfg.cluster.partition = f"gpu{char}x"
    with pytest.raises(InvalidSweep, match=r"- cluster\.partition: contains the control character"):
        check([Point(cfg)])


@pytest.mark.parametrize("mapping", ["cluster.sbatch_extra", "cluster.env"])
def test_mapping_keys_with_control_characters_are_refused(mapping):
    cfg = compose_cfg(SLURM)
    node = cfg.cluster[mapping.split(".")[1]]
    with open_dict(node):
        node["x\ntouch pwned #"] = "1"
    with pytest.raises(InvalidSweep) as ei:
        check([Point(cfg)])
    assert re.search(rf"- {re.escape(mapping)}: has a key that contains the control character", str(ei.value))


@pytest.mark.parametrize("mapping,name", [("cluster.sbatch_extra", "reser vation"), ("cluster.sbatch_extra", "--x"),
                                          ("cluster.env", "1BAD"), ("cluster.env", "A-B")])
def test_mapping_keys_must_be_names(mapping, name):
    cfg = compose_cfg(SLURM)
    node = cfg.cluster[mapping.split(".")[1]]
    with open_dict(node):
        node[name] = "1"
    with pytest.raises(InvalidSweep) as ei:
        check([Point(cfg)])
    assert f"- {mapping}.{name}:" in str(ei.value)


def test_good_strings_and_mappings_pass():
    ok = ["cluster.partition=gpu", "cluster.qos=high", "+cluster.sbatch_extra.reservation=big",
          "+cluster.sbatch_extra.exclusive=''", "+cluster.env.MY_VAR='a b; $(c)'", "cluster.setup=['module load x']",
          "tags=[a,b]"]
    assert len(check([Point(compose_cfg([*SLURM, *ok]))])) == 1


# ---- no control character reaches an sbatch script: the real `launch`, a dry run --------------------------


# ---- the README's examples still pass -----------------------------------------------------------------


def _readme_launches():
    """The `launch` lines of README.md's usage block, as overrides (a sweep's first value of each list)."""
    out = []
    for line in (REPO / "README.md").read_text().splitlines():
        words = line.split("#")[0].split()
        if words[:1] != ["launch"] or any(w.startswith("--") for w in words):
            continue
        out.append([w.split(",")[0] for w in words[1:] if w != "-m"])
    return out


README = _readme_launches()


def test_the_readme_shows_launches():
    assert [] in README and len(README) >= 5


@pytest.mark.parametrize("overrides", README, ids=[" ".join(o) or "(default)" for o in README])
def test_readme_examples_pass_the_check(overrides, tmp_path, monkeypatch):
    # a launch on the dataset the README's `launcher data prepare` line makes (relative to the launch
    # dir): a small one written there, with a validation split
    monkeypatch.chdir(tmp_path)
    for w in overrides:
        if w.startswith("data.path="):
            from launcher.data.manifest import write_dataset

            docs = {"train": [list(range(1, 300))] * 4, "val": [list(range(1, 200))]}
            write_dataset(tmp_path / w.split("=", 1)[1], docs, vocab_size=512, eos_id=0)
    from launcher.host import host_gpus

    asked = [int(w.split("=", 1)[1]) for w in overrides if w.startswith("cluster.gpus_per_node=")]
    local = not any(w.startswith("cluster=") and w != "cluster=local" for w in overrides)
    if local and asked and 0 < host_gpus() < asked[0]:
        # more processes than this host's GPUs (the host as tests/unit/conftest.py fixes it): refused, with the fix
        n = host_gpus()
        with pytest.raises(InvalidSweep, match=rf"cluster.gpus_per_node={asked[0]} processes, but this host has "
                                               rf"{n} GPU\(s\)[\s\S]*fix: set cluster.gpus_per_node={n}"):
            check([Point(compose_cfg(overrides), overrides)])
        return
    assert len(check([Point(compose_cfg(overrides), overrides)])) == 1


def test_a_refused_value_is_not_echoed():
    """A secret read with its trailing newline ($(cat token)) is refused without printing it."""
    text = _refused(["+cluster.env.API_TOKEN='s3cr3t-value\n'"], "cluster.env.API_TOKEN")
    assert "s3cr3t" not in text


@pytest.mark.parametrize("line,key", [("hydra.sweep.dir=x", "hydra.sweep.dir"),
                                      ("+hydra.job.chdir=true", "hydra.job.chdir"),
                                      ("hydra.sweep.subdir=${hydra.job.num}", "hydra.sweep.subdir"),
                                      ("hydra.output_subdir=.h", "hydra.output_subdir"),
                                      ("hydra.run.dir=x", "hydra.run.dir")])
def test_hydra_output_keys_are_named(line, key):
    from launcher.app import hydra_output_problems

    (err,) = hydra_output_problems(["hydra/launcher=launcher", line, "hydra.verbose=true"])
    assert err.key == key and "fix: remove it" in str(err)
    assert hydra_output_problems(["hydra.job.name=x", "hydra/sweeper=optuna", "hydra.sweeper.n_trials=3"]) == []
