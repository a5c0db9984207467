"""A ``<group>.name`` no option provides is refused at launch (issue 21): ``data.name=my_corpus`` used
to pass and train on the synthetic data. The class: every group whose options set ``name``; a user's
own options in a config dir on the search path provide names too; a node with a ``_target_`` takes
any name; the run's ``name`` is no group; a reproduction keeps its archived names. And every option
shipped in conf/ still passes (a dry run of each that the other rules accept)."""
from __future__ import annotations

import io
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig

from launcher.app import CONF_DIR
from launcher.config import group_options, schema
from launcher.run.rundir import SweepDir
from launcher.submit.pipeline import InvalidSweep, Point, launch, validate
from launcher.submit.reproduce import archived_point


def _cfg(overrides, hydra=False):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides), return_hydra_config=hydra)


def _refusal(overrides, **point) -> str:
    with pytest.raises(InvalidSweep) as ei:
        validate([Point(_cfg(overrides), list(overrides), **point)])
    return str(ei.value)


def test_a_data_name_nobody_provides_is_refused_naming_key_options_and_fix():
    text = _refusal(["data.name=my_corpus"])
    assert "nothing was submitted" in text
    assert "data.name: 'my_corpus' names no option of the data group" in text
    assert "its options: synthetic" in text
    assert "data=tokens data.path=DIR" in text


@pytest.mark.parametrize("key,value", [("optim.name", "sgd"), ("parallelism.name", "fsdp9"),
                                       ("cluster.name", "mine"), ("model.name", "gpt_huge")])
def test_every_group_that_names_its_options_is_held_to_them(key, value):
    text = _refusal([f"{key}={value}"])
    group = key.split(".")[0]
    assert f"{key}: {value!r} names no option of the {group} group" in text
    assert f"{group}=<option>" in text and f"{group}/{value}.yaml" in text


def test_every_refused_name_is_listed_at_once():
    text = _refusal(["data.name=a", "optim.name=b"])
    assert "data.name:" in text and "optim.name:" in text


def test_the_names_the_shipped_options_set_are_accepted():
    assert validate([Point(_cfg(["data.name=synthetic", "parallelism.name=dp", "optim.name=adamw"]))])


def test_the_run_name_is_no_group():
    assert validate([Point(_cfg(["name=anything_at_all"]))])


def test_a_node_with_a_target_takes_any_name_as_a_label():
    tree = {"model": {"_target_": "pkg.Net", "name": "my_net"}, "data": {"name": "synthetic"}}
    assert group_options.problems(tree, [str(CONF_DIR)]) == []
    tree["model"].pop("_target_")
    (err,) = group_options.problems(tree, [str(CONF_DIR)])
    assert err.key == "model.name" and "model._target_=pkg.Net" in err.fix


def test_groups_are_found_from_the_options_not_a_list():
    found = group_options.groups([str(CONF_DIR)])
    assert {"data", "parallelism", "optim", "cluster", "model"} <= set(found)
    assert "recipe" not in found  # its options are global (# @package _global_): their name is the run's
    assert "zero" not in found and "precision" not in found  # no option of theirs sets a name


def _user_dir(tmp_path: Path) -> Path:
    d = tmp_path / "myconf"
    (d / "cluster").mkdir(parents=True)
    (d / "cluster" / "mine.yaml").write_text("name: mine\nbackend: local\nnodes: 1\ngpus_per_node: 1\n")
    return d


def test_a_users_own_option_in_a_config_dir_on_the_search_path_provides_its_name(tmp_path):
    d = _user_dir(tmp_path)
    assert validate([Point(_cfg(["cluster.name=mine"]), config_dirs=(str(d),))])  # the sweep plugin's way
    cfg = _cfg([f"hydra.searchpath=[file://{d}]", "cluster=mine"], hydra=True)  # `launch`: Hydra says where
    before = HydraConfig.instance().cfg
    HydraConfig.instance().set_config(cfg)
    try:
        assert str(d) in group_options.search_dirs()
        assert validate([Point(_cfg([f"hydra.searchpath=[file://{d}]", "cluster=mine"]))])
    finally:
        HydraConfig.instance().cfg = before


def test_a_config_dir_off_the_search_path_provides_nothing(tmp_path):
    _user_dir(tmp_path)
    assert "cluster.name: 'mine'" in _refusal(["cluster.name=mine"])


def test_an_option_whose_name_is_an_interpolation_leaves_the_group_open(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "mine.yaml").write_text("name: ${oc.env:CORPUS}\n")
    assert group_options.problems({"data": {"name": "whatever"}}, [str(tmp_path)]) == []


def test_a_reproduction_keeps_its_archived_names_and_checks_a_changed_one(tmp_path):
    rd = SweepDir(tmp_path / "runs" / "S").run(0)
    resolved = validate([Point(_cfg([]))])[0].resolved
    resolved["cluster"]["name"] = "mine"  # launched from a --config-dir this command does not search
    rd.write_config(resolved)
    rd.write_overrides(["cluster=mine"], {"cluster": "mine"})
    assert validate([archived_point(rd.path, [], tmp_path / "runs")])
    with pytest.raises(InvalidSweep, match="data.name: 'my_corpus' names no option"):
        validate([archived_point(rd.path, ["data.name=my_corpus"], tmp_path / "runs")])


def _shipped_options():
    return [(g.name, o.stem) for g in sorted(schema.CONF_DIR.iterdir()) if g.is_dir()
            for o in sorted(g.glob("*.yaml"))]


@pytest.mark.parametrize("group,option", _shipped_options(), ids=[f"{g}={o}" for g, o in _shipped_options()])
def test_every_shipped_option_still_launches(group, option, tmp_path, monkeypatch):
    """Each option shipped in conf/ passes the name check; each the other rules accept for this host
    goes through a dry run (a cluster template of 8 GPUs, a 175B model are refused for other reasons).
    The host's available memory is read once: the check and the launch judge the same number (other
    processes' memory would otherwise move it between the two)."""
    from recipes.gpt.plan import spec

    avail = spec.host_available_bytes()
    monkeypatch.setattr(spec, "host_available_bytes", lambda path="/proc/meminfo": avail)
    overrides = [f"{group}={option}", f"submit.runs_root={tmp_path}", "submit.dry_run=true"]
    resolved = schema.own_config(group_options_tree(overrides), overrides)
    assert group_options.problems(resolved, group_options.search_dirs()) == []
    try:
        validate([Point(_cfg(overrides), overrides)])
    except InvalidSweep as e:
        assert ".name:" not in str(e)
        return
    out = io.StringIO()
    assert launch([Point(_cfg(overrides), overrides)], argv=["launch"], out=out).dry_run
    assert "dry run: nothing submitted" in out.getvalue()


def group_options_tree(overrides):
    from omegaconf import OmegaConf

    return OmegaConf.to_container(_cfg(overrides), resolve=True, enum_to_str=True)


def test_the_sweep_plugin_reads_the_search_path_from_the_hydra_node(tmp_path):
    """What `launch -m --config-dir DIR` hands its points (plugin.py: hydra.runtime.config_sources)."""
    d = _user_dir(tmp_path)
    cfg = _cfg([f"hydra.searchpath=[file://{d}]"], hydra=True)
    dirs = group_options.dirs_of(cfg.hydra.runtime.config_sources)
    assert str(d) in dirs and str(CONF_DIR) in dirs
    assert "mine" in dict(group_options.groups(dirs)["cluster"].names)
