"""launcher.config.compose.SweepComposer composes a sweep point as Hydra's load_sweep_config does, once per
distinct combination of group choices (value overrides applied onto a copy), and each point once."""
import itertools
import random

import pytest
from hydra import initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.types import RunMode
from omegaconf import OmegaConf, open_dict, read_write
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError

from launcher.app import CONF_DIR
from launcher.config.compose import SweepComposer

# a master config as `launch -m` composes it (sweep overrides on the command line)
SWEEP = ["model=gpt_tiny,gpt_125m", "zero=0,1,2", "cluster=local,local_slurm", "optim.lr=1e-3,3e-3",
         "train.steps=5,7"]
# points as sweepers hand them over: group choices, value overrides, +/++ and dict values mixed
POINTS = [
    *[list(p) for p in itertools.product(["model=gpt_tiny", "model=gpt_125m"], ["zero=0", "zero=2"],
                                         ["cluster=local", "cluster=local_slurm"], ["optim.lr=0.001", "optim.lr=0.003"],
                                         ["train.steps=5", "train.steps=7"])],
    ["zero='1'", "optim.lr=2e-3", "+cluster.env.MY_VAR=abc", "++train.log_interval=2"],
    ["zero=3", "++cluster.env={A: b}", "tags=[x,y]", "precision=bf16", "parallelism=zero"],
    ["zero={stage: 1}", "seed=5"],  # a dict given for a group: a config value (as Hydra decides)
    ["optim.lr=1e-2", "hydra.job.name=renamed", "name=${model.name}-x"],
    ["submit.objective=mean_tokens_per_s", "train.fail_at_step=null"],
    [],
]


@pytest.fixture(scope="module")
def loader():
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        yield GlobalHydra.instance().config_loader()


@pytest.fixture(scope="module")
def master(loader):
    return loader.load_configuration("config", ["hydra.sweeper.max_batch_size=50", *SWEEP], run_mode=RunMode.MULTIRUN)


def _split(cfg):
    cfg = OmegaConf.create(OmegaConf.to_container(cfg))  # a plain copy: compare, don't change
    with read_write(cfg), open_dict(cfg):
        hydra_node = cfg.pop("hydra")
    return cfg, hydra_node


@pytest.mark.parametrize("overrides", random.Random(11).sample(POINTS[:32], 6) + POINTS[32:], ids=" ".join)
def test_same_config_as_hydra(loader, master, overrides):
    composer = SweepComposer(loader)
    fast = composer.compose(master, list(overrides))
    ref = loader.load_sweep_config(master, list(overrides))  # Hydra's own (the composer is not installed)
    fast_app, fast_hydra = _split(fast)
    ref_app, ref_hydra = _split(ref)
    assert OmegaConf.to_yaml(fast_app) == OmegaConf.to_yaml(ref_app)
    with read_write(fast), open_dict(fast):
        fast.pop("hydra")
    with read_write(ref), open_dict(ref):
        ref.pop("hydra")
    assert OmegaConf.to_container(fast, resolve=True) == OmegaConf.to_container(ref, resolve=True)
    # and the hydra node too (overrides.task, runtime.choices, job.override_dirname, ...)
    assert OmegaConf.to_yaml(fast_hydra) == OmegaConf.to_yaml(ref_hydra)
    # typed and closed as Hydra's: a wrong type or an unknown key still fails
    with pytest.raises(ValidationError):
        fast.train.steps = "abc"
    with pytest.raises((ConfigAttributeError, ConfigKeyError)):
        fast.train.no_such_key = 1


def test_each_group_combination_composed_once(loader, master):
    composer = SweepComposer(loader)
    for p in POINTS[:32]:
        composer.compose(master, p)
    assert len(composer.bases) == 8  # 2 models x 2 zero x 2 clusters; the values are merged on
    assert composer.composed == 32


def test_sweeper_check_and_launcher_compose_each_point_once(loader, master):
    composer = SweepComposer(loader)
    check = composer.load_sweep_config  # what the sweeper's validate_batch_is_legal calls
    points = POINTS[:4]
    for p in points:
        check(master, p)
    kept = dict(composer.kept)
    taken = [composer.take(master, p) for p in points]
    assert all(t is kept[tuple(p)] for t, p in zip(taken, points)) and composer.composed == 4
    assert composer.kept == {}  # handed over, not held
    composer.take(master, points[0])  # not checked before: composed now
    assert composer.composed == 5


def test_install_replaces_the_loaders_method_once(loader):
    saved = loader.__dict__.pop("load_sweep_config", None), loader.__dict__.pop("_launcher_composer", None)
    try:
        c1 = SweepComposer.install(loader)
        assert SweepComposer.install(loader) is c1
        assert loader.load_sweep_config == c1.load_sweep_config
    finally:
        loader.__dict__.pop("load_sweep_config", None)
        loader.__dict__.pop("_launcher_composer", None)
        if saved[0] is not None:
            loader.__dict__["load_sweep_config"], loader.__dict__["_launcher_composer"] = saved


@pytest.mark.parametrize("overrides,needle", [
    (["model.hiden_size=10"], "hiden_size"),
    (["train.steps=abc"], "train.steps=abc"),
    (["zero=7"], "zero/7"),
    (["+train.steps=3"], "Could not append"),
])
def test_errors_as_hydra_reports_them(loader, master, overrides, needle):
    composer = SweepComposer(loader)
    with pytest.raises(Exception) as fast_err:
        composer.compose(master, overrides)
    with pytest.raises(Exception) as ref_err:
        loader.load_sweep_config(master, overrides)
    assert type(fast_err.value) is type(ref_err.value)
    text = str(fast_err.value) + str(fast_err.value.__cause__)
    assert needle in text, text


# ---- the fast path: points that differ only in plain values ---------------------------------------

FAST = [
    ["seed=7"],
    ["optim.lr=3e-4", "train.steps=9"],
    ["model.name=renamed"],  # `name: ${model.name}` and `submit.job_name: ${name}` follow it
    ["model=gpt_125m", "seed=3", "train.log_interval=2"],
    ["cluster=local_slurm", "cluster.nodes=2", "cluster.partition=other"],
    ["precision.dtype=bf16"],  # an enum: archived as its name
    ["zero=2", "zero.offload_optimizer=true", "name=custom"],
    ["+cluster.env.MY_VAR=abc", "seed=11"],  # `+key`: composed into the base once, the value put in
    ["train.fail_at_step=null", "submit.objective=mean_tokens_per_s"],
]


def _hydra_resolved(loader, master, overrides):
    ref = loader.load_sweep_config(master, list(overrides))
    with read_write(ref), open_dict(ref):
        hydra_node = ref.pop("hydra")
    return OmegaConf.to_container(ref, resolve=True, enum_to_str=True), hydra_node


@pytest.mark.parametrize("overrides", FAST, ids=" ".join)
def test_fast_point_is_hydras_resolution(loader, master, overrides):
    from launcher.config.compose import FastPoint

    composer = SweepComposer(loader)
    got = composer.point(master, list(overrides))
    assert isinstance(got, FastPoint), "expected the fast path"
    ref, hydra_node = _hydra_resolved(loader, master, overrides)
    assert got.resolved == ref
    assert list(got.resolved) == list(ref)  # the config's own key order (config.yaml reads the same)
    assert got.overrides == list(hydra_node.overrides.task)
    assert got.choices == OmegaConf.to_container(hydra_node.runtime.choices)


def test_fast_points_do_not_leak_into_each_other(loader, master):
    """The scratch config gets its old values back: a later point without an override sees the base."""
    composer = SweepComposer(loader)
    a = composer.point(master, ["model.name=first", "seed=1"])
    b = composer.point(master, ["seed=2"])
    ref, _ = _hydra_resolved(loader, master, ["seed=2"])
    assert b.resolved == ref and a.resolved["name"] == "first" and b.resolved["name"] != "first"
    a.resolved["train"]["steps"] = -1  # each point owns its dicts
    assert composer.point(master, ["seed=3"]).resolved["train"]["steps"] != -1


@pytest.mark.parametrize("overrides", [["train.steps=abc"], ["model.hiden_size=10"], ["seed=${train.steps}"],
                                       ["~train.fail_at_step"], ["tags=[a,b]", "seed=4"], ["seed=4", "+seed=5"]],
                         ids=" ".join)
def test_other_values_as_hydra_composes_them(loader, master, overrides):
    """A bad value, an unknown key (Hydra's errors, from the full path), an interpolation, a deletion, a
    list (composed into the base), an override of the same key twice (the full path, in order)."""
    from launcher.config.compose import FastPoint

    composer = SweepComposer(loader)
    try:
        got = composer.point(master, list(overrides))
    except Exception as e:
        with pytest.raises(type(e)):
            loader.load_sweep_config(master, list(overrides))
        return
    ref, _ = _hydra_resolved(loader, master, overrides)
    if not isinstance(got, FastPoint):
        with read_write(got), open_dict(got):
            got.pop("hydra")
        got = FastPoint(OmegaConf.to_container(got, resolve=True, enum_to_str=True), None, None, None)
    assert got.resolved == ref


@pytest.mark.parametrize("line", ["seed=0", "seed=17", "seed=-3", "seed=+4", "optim.lr=0.0003", "optim.lr=3e-4",
                                  "optim.lr=3E+4", "a.b=1.", "a.b=.5", "x=-0.0", "x=1e5", "x=-.5", "zero=2",
                                  "x=00", "x=01", "x=1_000", "x=inf", "x=nan", "x=0.1.2", "a-b=1", "x=true",
                                  "+seed=3", "++optim.lr=1e-3", "+a.b=-2", "+++x=1", "~x=1", "+a@b=1", "+ x=1"])
def test_plain_number_lines_parse_as_hydra_parses_them(line):
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from launcher.config.compose import plain_number_override

    mine = plain_number_override(line)
    try:
        ref = OverridesParser.create().parse_overrides([line])[0]
    except Exception:  # Hydra refuses it: so must we (its parser reports it)
        assert mine is None, line
        return
    if mine is None:  # left to Hydra's parser
        assert not line.startswith(("seed", "optim", "+seed", "++optim")), line
        return
    assert mine == ref and type(mine.value()) is type(ref.value())
