"""Layout derivation and the config rules, as pure functions over composed configs."""

import pytest
from hydra import compose, initialize_config_dir

from launcher.app import CONF_DIR, normalize_overrides
from launcher.config import layout, rules
from launcher.config.errors import ConfigErrors
from launcher.config.recipe_target import target_problem
from recipes.gpt.schema import ModelSpec

GPT = "recipes.gpt.train.main"  # the shipped recipe: the launcher's keys and its model group


def cfg_with(*overrides):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=normalize_overrides(list(overrides)))


def keys(cfg):
    return [e.key for e in rules.problems(cfg)]


def test_default_layout_is_valid_and_derived():
    from launcher.host import host_gpus

    lay = rules.resolve(cfg_with())
    # cluster=local: 2 processes on a host without GPUs, else one per GPU, as many as the 4 micro-batches
    # of the default batch split over (the host as tests/unit/conftest.py fixes it)
    gpus = host_gpus()
    dp = 2 if not gpus else max(k for k in (1, 2, 4) if k <= gpus)
    assert (lay.world_size, lay.dp, lay.tp, lay.pp) == (dp, dp, 1, 1)
    # global 16 = dp * micro 4 * accum
    assert lay.grad_accum == 16 // (4 * dp)


@pytest.mark.parametrize(
    "nodes,gpn,mb,gbs,accum",
    [(1, 1, 4, 16, 4), (2, 4, 2, 64, 4), (4, 8, 1, 32, 1), (1, 2, 8, 64, 4)],
)
def test_grad_accum(nodes, gpn, mb, gbs, accum):
    cfg = cfg_with("cluster=local_slurm", f"cluster.nodes={nodes}", f"cluster.gpus_per_node={gpn}",
                   f"train.micro_batch_size={mb}", f"train.global_batch_size={gbs}")
    lay = rules.resolve(cfg)
    assert lay.dp == nodes * gpn and lay.grad_accum == accum
    assert lay.dp * lay.micro_batch_size * lay.grad_accum == gbs


def test_tp_pp_not_dividing_world_names_key_and_fix():
    errs = rules.problems(cfg_with("parallelism.tp=3"))
    assert errs[0].key == "parallelism.tp"
    msg = str(errs[0])
    assert "does not divide the world size" in msg and "fix:" in msg


@pytest.mark.parametrize(
    "overrides,key",
    [
        (["train.global_batch_size=18"], "train.global_batch_size"),
        (["parallelism.dp=3"], "parallelism.dp"),
        (["model.num_heads=5"], "model.num_heads"),
        (["model.num_layers=0"], "model.num_layers"),
        (["cluster.nodes=0"], "cluster.nodes"),
        (["zero.stage=4"], "zero.stage"),
        (["zero=1", "parallelism.engine=ddp"], "zero.stage"),  # ZeRO needs the deepspeed engine
        (["zero.offload_optimizer=true"], "zero.offload_optimizer"),
        (["zero=2", "zero.offload_params=true"], "zero.offload_params"),
        (["parallelism.sequence_parallel=true"], "parallelism.sequence_parallel"),
        (["optim.lr=0"], "optim.lr"),
        (["optim.warmup_steps=1000"], "optim.warmup_steps"),
        (["model.dropout=1.5"], "model.dropout"),
        (["train.fail_at_step=1", "train.fail_rank=5"], "train.fail_rank"),
        (["parallelism.tp=2", "parallelism.engine=ddp"], "parallelism.engine"),
        (["parallelism=3d", "zero=2"], "zero.stage"),
        (["parallelism=pp", "cluster.gpus_per_node=2", "train.global_batch_size=4", "train.micro_batch_size=4"],
         "train.global_batch_size"),
        (["parallelism=tp", "parallelism.sequence_parallel=true", "model.seq_len=63"], "parallelism.sequence_parallel"),
        (["parallelism=zero", "zero=0", "precision=fp16"], "precision.dtype"),
        (["parallelism=tp", "parallelism.engine=deepspeed"], "parallelism.engine"),
    ],
)
def test_bad_values_name_their_key(overrides, key):
    found = keys(cfg_with(*overrides))
    assert key in found, found


def test_resolve_raises_with_every_error():
    with pytest.raises(ConfigErrors) as ei:
        rules.resolve(cfg_with("parallelism.tp=3", "model.num_heads=5"))
    text = str(ei.value)
    assert "parallelism.tp" in text and "model.num_heads" in text


# ---- the rule table: bound rows generated from the schema, and what the search sees ---------------------


def test_every_numeric_key_declares_bounds_and_has_its_row():
    from launcher.config import schema

    numeric = [leaf for leaf in schema.leaves(GPT) if leaf.type in (int, float)]
    assert len(numeric) > 40
    assert not [leaf.key for leaf in numeric if leaf.bounds is None], "declare bounds with schema.num(...)"
    rows = {r.key for r in rules.table(GPT)}
    assert {leaf.key for leaf in numeric} <= rows


def test_size_rows_are_value_rows_and_the_rest_run_rows():
    kinds = {}
    for r in rules.table(GPT):
        kinds.setdefault(r.key, set()).add(r.kind)
    for key in ("cluster.nodes", "cluster.gpus_per_node", "parallelism.tp", "parallelism.pp", "train.micro_batch_size",
                "train.global_batch_size", "model.num_layers", "model.vocab_size", "zero.stage"):
        assert rules.VALUE in kinds[key], key
    for key in ("optim.lr", "optim.beta2", "seed", "precision.loss_scale", "cluster.time_min", "recipe._target_",
                "data.branching"):
        assert kinds[key] == {rules.RUN}, key


def test_facts_without_a_config_pass_the_run_rows():
    """The planner's search builds Facts without a config: no row that reads config values fires."""
    model = ModelSpec(name="m", num_layers=2, hidden_size=8, num_heads=2, ffn_hidden_size=8, vocab_size=8,
                             seq_len=4)
    f = layout.Facts(nodes=1, gpus_per_node=2, tp=1, pp=1, micro_batch_size=1, global_batch_size=2, model=model,
                     backend="slurm")
    assert rules.violations(f) == [] and rules.ok(f)
    assert rules.ok(f, (rules.VALUE, rules.SHAPE, rules.LAYOUT))
    bad = f.with_(micro_batch_size=0)
    assert not rules.ok(bad) and [e.key for e in rules.violations(bad)] == ["train.micro_batch_size"]
    nan = f.with_(lr=float("nan"))
    assert not rules.ok(nan) and rules.ok(nan, (rules.VALUE, rules.SHAPE, rules.LAYOUT))  # a RUN row


def test_facts_from_cfg_reads_values_lazily():
    f = layout.Facts.from_cfg(cfg_with())
    assert "tree" not in vars(f.values)  # nothing flattened until a RUN rule asks
    assert rules.violations(f) == []
    assert f.values.get("optim.beta2") == 0.95 and f.values.get("cluster.env.OMP_NUM_THREADS") == "1"
    assert f.with_(tp=1).values is f.values  # the planner's copies share what was found


@pytest.mark.parametrize(
    "overrides,key",
    [
        (["+train.stepz=5"], "train.stepz"),
        (["+stepz=5"], "stepz"),
        (["+recipe.lr=1"], "recipe.lr"),
        (["optim.lr=nan"], "optim.lr"),
        (["optim.lr=inf"], "optim.lr"),
        (["seed=9223372036854775808"], "seed"),
        (["seed=-1"], "seed"),
        (["data.branching=0"], "data.branching"),
        (["model.vocab_size=2", "data.branching=4"], "data.branching"),
        (["train.fail_at_step=0"], "train.fail_at_step"),
        (["train.fail_at_step=61"], "train.fail_at_step"),
        (["precision.loss_scale=-1"], "precision.loss_scale"),
        (["recipe._target_=recipes.gpt.train.mian"], "recipe._target_"),
        (["cluster.nodes=2"], "cluster.nodes"),  # the local backend runs one node
        (["cluster.partition='gpu\ntouch pwned #'"], "cluster.partition"),
        (["+cluster.sbatch_extra.reservation='a\nb'"], "cluster.sbatch_extra.reservation"),
    ],
)
def test_new_rules_name_their_key(overrides, key):
    assert key in keys(cfg_with(*overrides))


def test_unknown_key_suggests_the_known_one():
    (err,) = rules.problems(cfg_with("+train.stepz=5"))
    assert err.key == "train.stepz" and "did you mean train.steps" in err.problem


def test_added_mapping_entries_are_known_keys():
    assert keys(cfg_with("+cluster.sbatch_extra.reservation=big", "+cluster.env.FOO=1")) == []


def test_local_backend_runs_one_node():
    (err,) = rules.problems(cfg_with("cluster=local", "cluster.nodes=2", "cluster.gpus_per_node=1"))
    assert err.key == "cluster.nodes" and err.fix.startswith("set cluster.nodes=1 or use a Slurm cluster")
    assert keys(cfg_with("cluster=local_slurm", "cluster.nodes=2")) == []


@pytest.mark.parametrize("flags,refused", [(frozenset(), True), (frozenset({"avx512_fp16"}), False),
                                           (frozenset({"amx_fp16", "avx512f"}), False), (None, False)])
def test_fp16_on_deepspeed_needs_the_local_cpus_fp16_kernels(monkeypatch, flags, refused):
    from launcher.backends.local import LocalBackend

    monkeypatch.setattr(LocalBackend, "host_cpu_flags", lambda self: flags)
    found = keys(cfg_with("zero=1", "precision=fp16"))
    assert ("precision.dtype" in found) is refused
    assert keys(cfg_with("precision=fp16")) == []  # the ddp engine's fp16 autocast runs on any CPU
    assert keys(cfg_with("zero=1", "precision=bf16")) == []
    assert keys(cfg_with("cluster=local_slurm", "zero=1", "precision=fp16")) == []  # other hosts: unknown here


def test_cpu_flags_read_from_cpuinfo(tmp_path):
    from launcher.backends.local import cpu_flags

    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse avx512f amx_fp16\n\nprocessor\t: 1\nflags\t\t: fpu\n")
    assert cpu_flags(str(info)) == {"fpu", "sse", "avx512f", "amx_fp16"}
    assert cpu_flags(str(tmp_path / "missing")) == frozenset()


@pytest.mark.parametrize(
    "target,fine",
    [("recipes.gpt.train.main", True), ("recipes.gpt.train.mian", False), ("recipes.gpt.trian.main", False),
     ("nosuchpackage.main", False), ("main", False), ("recipes.gpt.train", False), ("os.path.join", True),
     ("json.dump", True)],
)
def test_recipe_target_found_without_importing_it(target, fine):
    assert (target_problem(target) is None) is fine, target_problem(target)


