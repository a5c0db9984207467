"""The generic Hydra launcher's pure parts: its registration, the executor parameters it hands the
backends, what it archives of a point's config and of a return value, and where its code snapshot
comes from. (Real sweeps: tests/integration/test_hydra_app.py.)"""
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from hydra_plugins.launcher_plugin import generic
from launcher import backends
from launcher.archive import software

REPO = Path(__file__).resolve().parents[2]


def test_registered_as_hydra_launcher_options():
    from hydra.core.config_store import ConfigStore
    from hydra.core.plugins import Plugins

    Plugins.instance()  # Hydra's plugin scan imports every module of hydra_plugins
    options = ConfigStore.instance().list("hydra/launcher")
    assert {"launcher_slurm.yaml", "launcher_local.yaml"} <= set(options)
    slurm = OmegaConf.structured(generic.SlurmLauncherConf)
    assert slurm._target_ == "hydra_plugins.launcher_plugin.generic.SlurmLauncher"
    # submitit's names, so a hydra-submitit-launcher config carries over
    for key in ("partition", "account", "qos", "timeout_min", "gpus_per_node", "tasks_per_node", "cpus_per_task",
                "mem_gb", "setup", "array_parallelism", "env", "runs_root", "wait", "nodes"):
        assert key in slurm, key
    assert slurm.wait is True
    local = OmegaConf.structured(generic.LocalLauncherConf)
    assert local._target_.endswith("generic.LocalLauncher") and "partition" not in local


def test_slurm_parameters_from_plugin_config():
    params = {"partition": "debug", "account": "acct", "qos": "high", "timeout_min": 15, "nodes": 2,
              "tasks_per_node": 4, "gpus_per_node": 8, "cpus_per_task": 3, "mem_gb": 64, "array_parallelism": 5,
              "setup": ["module load cuda"], "env": {"OMP_NUM_THREADS": "2", "HF_TOKEN": "hf_secret_value"},
              "additional_parameters": {"exclude": "node3"}, "name": "myapp", "signal_delay_s": 30}
    shim = generic.cluster_config("slurm", params)
    p = backends.get("slurm").parameters(shim, Path("/snap"))
    assert p["partition"] == "debug" and p["account"] == "acct" and p["qos"] == "high"
    assert p["time"] == 15 and p["nodes"] == 2 and p["ntasks_per_node"] == 4 and p["cpus_per_task"] == 3
    assert p["mem"] == "64GB" and p["array_parallelism"] == 5 and p["job_name"] == "myapp"
    assert p["signal_delay_s"] == 30
    # GPUs are their own sbatch option: tasks per node stays what the app asked
    assert "gpus_per_node" not in p and p["additional_parameters"]["gpus-per-node"] == "8"
    assert p["additional_parameters"]["exclude"] == "node3" and p["additional_parameters"]["chdir"] == "/snap"
    assert "module load cuda" in p["setup"] and "export OMP_NUM_THREADS=2" in p["setup"]
    assert not any("hf_secret_value" in line for line in p["setup"])  # secrets travel in the environment


def test_local_parameters_from_plugin_config():
    shim = generic.cluster_config("local", {"timeout_min": 7, "tasks_per_node": 2})
    p = backends.get("local").parameters(shim)
    assert p["timeout_min"] == 7 and p["tasks_per_node"] == 2 and p["nodes"] == 1


def test_defaults_give_one_task_without_gpus():
    shim = generic.cluster_config("slurm", dict(OmegaConf.to_container(OmegaConf.structured(
        generic.SlurmLauncherConf(name="app")))))
    p = backends.get("slurm").parameters(shim)
    assert p["ntasks_per_node"] == 1 and p["nodes"] == 1 and p["time"] == 60
    assert "gpus-per-node" not in (p.get("additional_parameters") or {})


def test_runs_root(monkeypatch, tmp_path):
    monkeypatch.setenv("LAUNCHER_RUNS", str(tmp_path / "env_root"))
    assert generic.runs_root_of({}) == tmp_path / "env_root"
    assert generic.runs_root_of({"runs_root": str(tmp_path / "x")}) == tmp_path / "x"
    monkeypatch.delenv("LAUNCHER_RUNS")
    monkeypatch.chdir(tmp_path)
    assert generic.runs_root_of({"runs_root": None}) == tmp_path / "runs"


def test_resolved_app_config_drops_hydra_and_keeps_unresolvable_as_written():
    cfg = OmegaConf.create({"hydra": {"job": {"name": "a"}}, "x": 1, "y": "${x}",
                            "z": "${oc.env:NOT_SET_ANYWHERE_123}"})
    out = generic.resolved_app_config(cfg)
    assert "hydra" not in out and out["x"] == 1 and out["z"] == "${oc.env:NOT_SET_ANYWHERE_123}"
    ok = generic.resolved_app_config(OmegaConf.create({"hydra": {}, "x": 2, "y": "${x}"}))
    assert ok == {"x": 2, "y": 2}


def test_return_values_archived_as_json():
    class Obj:
        def __repr__(self):
            return "Obj()"

    assert generic.plain(1.5) == 1.5 and generic.plain({"a": [1, "b"]}) == {"a": [1, "b"]}
    assert generic.plain(None) is None and generic.plain(OmegaConf.create({"k": 1})) == {"k": 1}
    assert generic.plain(Obj()) == "Obj()"
    np = pytest.importorskip("numpy")
    assert generic.plain(np.float32(2.5)) == 2.5


def test_snapshot_root_is_the_apps_repo(tmp_path):
    from recipes.hydra_example import app

    assert generic.source_root(app.main, tmp_path) == REPO  # the repo holding the task's file
    # outside any repo: the top package holding the task's module, else the launch dir
    pkg = tmp_path / "proj" / "mypkg" / "sub"
    pkg.mkdir(parents=True)
    (tmp_path / "proj" / "mypkg" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "task.py").write_text("def main(cfg):\n    return 1\n")
    sys.path.insert(0, str(tmp_path / "proj"))
    try:
        from mypkg.sub import task  # noqa: E402

        assert generic.source_root(task.main, tmp_path / "elsewhere") == tmp_path / "proj"
    finally:
        sys.path.remove(str(tmp_path / "proj"))
        for m in [m for m in sys.modules if m.startswith("mypkg")]:
            del sys.modules[m]
    assert generic.source_root(len, tmp_path) == tmp_path  # a builtin: no source file


def test_queued_return_holds_the_run_id():
    cfg = OmegaConf.create({"hydra": {"overrides": {"task": ["x=1"]}, "job": {"name": "app"}}, "x": 1})
    ret = generic._queued(cfg, "S-0")
    assert ret.return_value == "S-0" and ret.overrides == ["x=1"] and ret.cfg == {"x": 1}


def test_points_composed_by_the_sweeper_are_taken_not_composed_again(tmp_path):
    """The generic launcher's composer (launcher.config.compose.SweepComposer, fast=False): an app's point is
    Hydra's own composition (a full config with its hydra node), each group combination composed once,
    the point the sweeper's check composed handed over, and Hydra's own method while the state is
    pickled for the nodes."""
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.types import RunMode

    from launcher.config.compose import SweepComposer

    conf = tmp_path / "conf"
    (conf / "opt").mkdir(parents=True)
    (conf / "app.yaml").write_text("defaults:\n  - opt: sgd\n  - _self_\nlr: 0.1\nname: run-${lr}\n")
    (conf / "opt" / "sgd.yaml").write_text("kind: sgd\nmomentum: 0.9\n")
    (conf / "opt" / "adam.yaml").write_text("kind: adam\nbeta: 0.99\n")
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        loader = GlobalHydra.instance().config_loader()
        master = loader.load_configuration("app", ["opt=sgd,adam", "lr=0.1,0.2"], run_mode=RunMode.MULTIRUN)
        hydra_own = loader.load_sweep_config
        composer = SweepComposer.install(loader, fast=False)
        assert SweepComposer.install(loader, fast=False) is composer  # once per loader
        assert SweepComposer.install(loader).allow_fast and SweepComposer.install(loader, fast=False) is composer
        assert not composer.allow_fast  # the latest caller's need: a launcher taking configs gets configs
        points = [["opt=sgd", "lr=0.1"], ["opt=sgd", "lr=0.2"], ["opt=adam", "lr=0.1"], ["opt=adam", "+extra=1"]]
        validated = [loader.load_sweep_config(master_config=master, sweep_overrides=p) for p in points]
        assert len(composer.bases) == 2  # two group combinations, composed by Hydra once each
        for p, cfg in zip(points, validated):
            assert composer.take(master, p) is cfg  # the sweeper's composition, not composed again
            want = hydra_own(master, p)
            assert OmegaConf.to_container(cfg) == OmegaConf.to_container(want)  # hydra node included
            app = lambda c: {k: OmegaConf.to_container(c[k], resolve=True) if OmegaConf.is_config(c[k])  # noqa: E731
                             else c[k] for k in c if k != "hydra"}
            assert app(cfg) == app(want)
            assert list(cfg.hydra.overrides.task) == p
        assert composer.composed == 4
        with composer.removed():  # Hydra's state, pickled for the nodes, holds the plain loader
            assert "load_sweep_config" not in vars(loader) and not composer.kept
        assert loader.load_sweep_config == composer.load_sweep_config


def test_reproduce_command_of_a_hydra_app_run(tmp_path):
    """What `launcher reproduce` starts for a Hydra app's run: the app from its snapshot (module or
    script), the point's overrides with the user's changes replacing theirs, the launch's Hydra
    overrides minus what belonged to the original multirun; a redacted value must be given again."""
    from launcher.config.errors import ConfigErrors
    from launcher.submit.reproduce import app_command

    meta = {"run_id": "S-3", "app": {"entry": {"script": "apps/train.py"}, "hydra_overrides": [
        "hydra/launcher=launcher_slurm", "hydra.launcher.partition=gpu", "hydra.sweep.dir=/old/out",
        "hydra/sweeper=optuna", "hydra.sweeper.n_trials=20", "hydra.launcher.runs_root=/old/runs"]}}
    snap, root = tmp_path / "code", tmp_path / "runs"
    cmd = app_command(meta, ["lr=0.01", "+depth=3", "seed=7"], ["lr=0.02", "hydra.launcher.partition=cpu"], snap,
                      root, python="py")
    assert cmd == ["py", str(snap / "apps" / "train.py"), "-m", "+depth=3", "seed=7", "lr=0.02",
                   "hydra.launcher.partition=cpu", "hydra/launcher=launcher_slurm", "hydra/sweeper=basic",
                   "hydra.sweeper.params=null", f"hydra.launcher.runs_root='{root}'",
                   "hydra.launcher.reproduces='S-3'", f"hydra.launcher.code_snapshot='{snap}'"]
    meta["app"]["entry"] = {"module": "pkg.app"}
    assert app_command(meta, [], [], snap, root, python="py")[:3] == ["py", "-m", "pkg.app"]
    with pytest.raises(ConfigErrors, match=r"(?s)token: was redacted.*launcher reproduce S-3 \+token=<value>"):
        app_command(meta, ["+token=<redacted>", "lr=1"], [], snap, root)
    assert "+token=abc" in app_command(meta, ["+token=<redacted>"], ["+token=abc"], snap, root)
    meta["app"]["hydra_overrides"].append("hydra.launcher.env.HF_TOKEN=<redacted>")  # a Hydra override too
    with pytest.raises(ConfigErrors, match=r"(?s)launcher reproduce S-3 hydra.launcher.env.HF_TOKEN=<value>"):
        app_command(meta, [], [], snap, root)
    # a path with a comma stays one value (not a sweep of two)
    from hydra.core.override_parser.overrides_parser import OverridesParser

    odd = tmp_path / "a,b=c"
    line = [x for x in app_command(meta, [], ["hydra.launcher.env.HF_TOKEN=x"], odd, root) if "code_snapshot" in x][0]
    (parsed,) = OverridesParser.create().parse_overrides([line])
    assert not parsed.is_sweep_override() and parsed.value() == str(odd)
    with pytest.raises(ConfigErrors, match="does not record how its app was started"):
        app_command({"run_id": "S-0", "app": {}}, [], [], snap, root)


def test_reproduce_command_runs_a_working_copy(tmp_path):
    """Given a working copy, the app starts from it and its jobs run it (hydra.launcher.work_dir);
    the runs still record the archived snapshot; an archived work_dir is never carried over."""
    from launcher.submit.reproduce import app_command

    meta = {"run_id": "S-3", "app": {"entry": {"script": "apps/train.py"}, "hydra_overrides": [
        "hydra/launcher=launcher_local", "hydra.launcher.work_dir=/old/copy"]}}
    snap, root, work = tmp_path / "code", tmp_path / "runs", tmp_path / "runs" / ".reproductions" / "S-3.x"
    cmd = app_command(meta, ["x=1"], [], snap, root, python="py", work_dir=work)
    assert cmd[:2] == ["py", str(work / "apps" / "train.py")]
    assert cmd[-2:] == [f"hydra.launcher.code_snapshot='{snap}'", f"hydra.launcher.work_dir='{work}'"]
    assert "hydra.launcher.work_dir=/old/copy" not in cmd


# ---- hydra-submitit-launcher's options, with their meaning ------------------------------------------

# a value other than the default for every option of hydra-submitit-launcher's SlurmQueueConf (one
# that fits: signal_delay_s below timeout_min)
SUBMITIT_SAMPLES = {
    "timeout_min": 30, "cpus_per_task": 3, "gpus_per_node": 2, "tasks_per_node": 2, "mem_gb": 64, "nodes": 2,
    "name": "sweepy", "stderr_to_stdout": True, "partition": "debug", "qos": "high", "comment": "a comment",
    "constraint": "v100", "exclude": "node4", "gres": "gpu:2", "cpus_per_gpu": 4, "gpus_per_task": 1,
    "mem_per_gpu": "10G", "mem_per_cpu": "2G", "account": "acct", "signal_delay_s": 45, "max_num_timeout": 2,
    "additional_parameters": {"hold": True, "mail-type": "END", "begin": "now+1hour"}, "array_parallelism": 3,
    "setup": ["echo set up"],
}
NOT_SBATCH = {"_target_", "submitit_folder"}  # the class to instantiate; the folder (same in both scripts)


def _submitit_script(params, folder, points):
    """The sbatch script hydra-submitit-launcher has submitit write for these options (its launch():
    an AutoExecutor, max_num_timeout to the executor, the other options slurm_-prefixed)."""
    import submitit
    from submitit.slurm.slurm import _make_sbatch_string

    from hydra_plugins.hydra_submitit_launcher import config as sub

    ex = submitit.AutoExecutor(cluster="slurm", folder=folder, slurm_max_num_timeout=params["max_num_timeout"])
    base = set(OmegaConf.structured(sub.BaseQueueConf).keys())
    ex.update_parameters(**{k if k in base else f"slurm_{k}": v for k, v in params.items()
                            if k not in NOT_SBATCH | {"max_num_timeout"}})
    return _make_sbatch_string(command="CMD", folder=folder, map_count=points, **ex._executor.parameters)


def _our_script(params, folder, points):
    return backends.get("slurm").script_text(generic.cluster_config("slurm", params), folder, points)


def _lines(script):
    """The #SBATCH and setup lines (the srun line and the command are each launcher's own)."""
    return {ln for ln in script.splitlines() if ln.strip() and not ln.startswith("srun") and "CMD" not in ln}


def test_every_submitit_launcher_option_taken_with_its_type():
    from dataclasses import fields

    from hydra_plugins.hydra_submitit_launcher import config as sub

    pairs = ((sub.SlurmQueueConf, generic.SlurmLauncherConf), (sub.LocalQueueConf, generic.LocalLauncherConf))
    for theirs, ours in pairs:
        mine = {f.name: f for f in fields(ours)}
        for f in fields(theirs):
            assert f.name in mine, f"{ours.__name__} lacks hydra-submitit-launcher's {f.name}"
            assert mine[f.name].type == f.type, (f.name, mine[f.name].type, f.type)
        # their defaults (setup: null included) are accepted as they are
        defaults = {k: v for k, v in OmegaConf.to_container(OmegaConf.structured(theirs)).items()
                    if k not in NOT_SBATCH}
        OmegaConf.merge(OmegaConf.structured(ours), defaults)
    walked = {f.name for f in fields(sub.SlurmQueueConf)} - NOT_SBATCH
    assert walked == set(SUBMITIT_SAMPLES), walked ^ set(SUBMITIT_SAMPLES)  # a new option needs a sample


@pytest.mark.parametrize("option", sorted(SUBMITIT_SAMPLES))
def test_each_submitit_option_lands_in_the_sbatch_script_as_submitit_writes_it(option, tmp_path):
    """Each option of hydra-submitit-launcher's SlurmQueueConf changes our sbatch script as it changes
    the one submitit writes for hydra-submitit-launcher: the lines submitit adds are in ours, the
    lines it drops are not."""
    from hydra_plugins.hydra_submitit_launcher import config as sub

    theirs = {k: v for k, v in OmegaConf.to_container(OmegaConf.structured(sub.SlurmQueueConf)).items()
              if k not in NOT_SBATCH}
    theirs["name"] = "app"
    ours = dict(OmegaConf.to_container(OmegaConf.structured(generic.SlurmLauncherConf(name="app"))))
    ours.update({k: v for k, v in theirs.items() if k != "max_num_timeout"})
    folder, points = tmp_path / "sub" / "%j", 4
    base = _lines(_submitit_script(theirs, folder, points))
    changed = _lines(_submitit_script({**theirs, option: SUBMITIT_SAMPLES[option]}, folder, points))
    mine_text = _our_script({**ours, option: SUBMITIT_SAMPLES[option]}, folder, points)
    mine = _lines(mine_text)
    assert changed - base <= mine, sorted((changed - base) - mine)
    assert not (base - changed) & mine, sorted((base - changed) & mine)
    if option == "stderr_to_stdout":  # srun's own --error flag goes too
        assert "--error" not in mine_text
    if option == "additional_parameters":
        assert "#SBATCH --hold" in mine  # a bare flag, as submitit writes true (sbatch refuses --hold=True)


def test_local_launcher_options_reach_the_local_executor():
    shim = generic.cluster_config("local", {"timeout_min": 7, "tasks_per_node": 2, "stderr_to_stdout": True})
    p = backends.get("local").parameters(shim)
    assert p["stderr_to_stdout"] is True and p["timeout_min"] == 7 and p["tasks_per_node"] == 2
    assert "stderr_to_stdout" not in backends.get("local").parameters(generic.cluster_config("local", {}))


@pytest.mark.parametrize("backend", ["slurm", "local"])
def test_a_signal_delay_that_does_not_fit_the_time_limit_is_cut(backend, caplog):
    """hydra-submitit-launcher's own tests run timeout_min=2 with signal_delay_s=120: the signal would be
    due at the start (submitit's local controller signals at step 0, before the task can run)."""
    fits = generic.cluster_config(backend, {"timeout_min": 3, "signal_delay_s": 120})
    assert fits.cluster.signal_delay_s == 120
    with caplog.at_level("WARNING"):
        cut = generic.cluster_config(backend, {"timeout_min": 2, "signal_delay_s": 120})
    assert cut.cluster.signal_delay_s == 60
    assert "hydra.launcher.signal_delay_s=120 does not fit hydra.launcher.timeout_min=2" in caplog.text
    assert backends.get(backend).parameters(cut)["signal_delay_s"] == 60
    assert generic.cluster_config(backend, {"timeout_min": 1, "signal_delay_s": 90}).cluster.signal_delay_s == 30


# ---- on the node: signals, outcomes -----------------------------------------------------------------


def test_time_limit_signal_told_from_a_preemption():
    from hydra_plugins.launcher_plugin.requeue import timed_out

    assert not timed_out(8, timeout_min=10, signal_delay_s=120)  # scancel --signal=USR2 early on
    assert timed_out(480, timeout_min=10, signal_delay_s=120)  # when Slurm's signal is due
    assert timed_out(60, timeout_min=2, signal_delay_s=60)


def test_stop_signals_held_before_the_task_raised_in_it_ignored_after():
    import os
    import signal

    from hydra_plugins.launcher_plugin.requeue import Stopped, StopSignals

    saved = {s: signal.getsignal(s) for s in (signal.SIGUSR2, signal.SIGTERM)}
    try:
        sig = StopSignals(timeout_min=60, signal_delay_s=120).install()
        os.kill(os.getpid(), signal.SIGUSR2)  # before the task: held
        assert sig.pending is not None and sig.pending.reason == "preempted" and sig.pending.requeues
        with pytest.raises(Stopped):
            with sig.running():
                pytest.fail("a held signal stops the task before it starts")
        sig = StopSignals(timeout_min=60, signal_delay_s=120).install()
        with pytest.raises(Stopped) as got:
            with sig.running():
                try:
                    os.kill(os.getpid(), signal.SIGTERM)
                    for _ in range(100):
                        __import__("time").sleep(0.01)
                except Exception:  # the task's own `except Exception` does not swallow the stop
                    pytest.fail("Stopped is not an Exception")
        assert not got.value.requeues and "SIGTERM" in str(got.value)
        os.kill(os.getpid(), signal.SIGUSR2)  # the task returned: nothing happens
        other = StopSignals(timeout_min=60, signal_delay_s=120, stops=False).install()
        with other.running():
            os.kill(os.getpid(), signal.SIGUSR2)  # not rank 0 on Slurm: the requeue ends this process
    finally:
        for s, h in saved.items():
            signal.signal(s, h)


def _point_cfg():
    return OmegaConf.create({"hydra": {"overrides": {"task": ["+x=2", "+mode=gen"]}, "job": {"name": "app", "num": 1},
                                       "runtime": {"output_dir": "/out/1"}}, "x": 2})


def test_failed_return_names_its_point(capsys):
    ret = generic._failed_return(_point_cfg(), SystemExit(3))
    with pytest.raises(SystemExit):
        _ = ret.return_value
    assert "Error executing job with overrides: ['+x=2', '+mode=gen']" in capsys.readouterr().err
    assert ret.cfg == {"x": 2} and ret.hydra_cfg.hydra.job.num == 1


def test_result_written_before_the_outcome_and_unpicklable_values_fail(tmp_path, monkeypatch):
    """The JobReturn is pickled and kept beside submitit's result file (not in it: that file tells the
    launch the job is done) before the run's outcome is recorded; a return value that cannot be
    pickled (a generator) makes a FAILED JobReturn naming the point instead."""
    import pickle
    import types

    import submitit
    from hydra.core.utils import JobReturn, JobStatus

    paths = types.SimpleNamespace(result_pickle=tmp_path / "1_0_result.pkl")
    monkeypatch.setattr(submitit, "JobEnvironment", lambda: types.SimpleNamespace(paths=paths))
    ok = JobReturn(overrides=["+x=2"], status=JobStatus.COMPLETED, _return_value=[1, 2])
    assert generic._HydraJob._write_result(ok, _point_cfg()) is ok
    kept = tmp_path / "1_0_result.pkl.kept"
    assert pickle.loads(kept.read_bytes())[1].return_value == [1, 2] and not paths.result_pickle.exists()
    gen = JobReturn(overrides=["+x=2"], status=JobStatus.COMPLETED, _return_value=(i for i in range(3)))
    ret = generic._HydraJob._write_result(gen, _point_cfg())
    assert ret.status == JobStatus.FAILED and ret.overrides == ["+x=2", "+mode=gen"]
    assert "point #1 ['+x=2', '+mode=gen']: its return value cannot be pickled" in str(ret._return_value)
    assert pickle.loads(kept.read_bytes())[1].status == JobStatus.FAILED


# ---- issue 27 for a user's Hydra app: overrides as typed, hydra.launcher.setup lifted, the journal ----


def test_overrides_read_as_typed_never_resolved():
    """An override's text holds what Hydra's grammar took as typed (``name=x${nope}``): the plugin's
    JobReturns and messages show it as typed instead of resolving it (which fails)."""
    cfg = OmegaConf.create({"hydra": {"overrides": {"task": ["name=x${nope}"]}, "job": {"name": "app", "num": 3}},
                            "x": 1})
    assert generic._queued(cfg, "S-0").overrides == ["name=x${nope}"]
    assert generic._point(cfg) == "#3 ['name=x${nope}']"
    assert generic._failed_return(cfg, ValueError("no")).overrides == ["name=x${nope}"]


SETUP_SECRET = "hf_setupSecret0123456789"


def test_launcher_setup_secret_lifted_as_cluster_setup_is():
    """``export HF_TOKEN=...`` in hydra.launcher.setup: the line reads the LAUNCHER_SECRET_ variable
    the sbatch script's line reads too (same name), the value travels in it, and the Hydra override
    that gave it is archived as the lifted lines (Hydra's grammar reads them back)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from launcher.backends.slurm import setup_lines

    lines = [f"export HF_TOKEN={SETUP_SECRET}", "echo it's set"]
    given = ["hydra/launcher=launcher_slurm",
             f"hydra.launcher.setup=['export HF_TOKEN={SETUP_SECRET}',\"echo it's set\"]"]
    setup, values, overrides = generic.lifted_setup({"setup": lines}, given)
    var = "LAUNCHER_SECRET_CLUSTER_SETUP_HF_TOKEN"
    assert setup == [f'export HF_TOKEN="${var}"', "echo it's set"] == setup_lines(lines)
    assert values == {var: SETUP_SECRET}
    assert overrides[0] == given[0] and SETUP_SECRET not in " ".join(overrides)
    (parsed,) = OverridesParser.create().parse_overrides([overrides[1]])
    assert parsed.get_key_element() == "hydra.launcher.setup" and parsed.value() == setup
    assert generic.lifted_setup({"setup": ["echo hi"]}, given[:1]) == (["echo hi"], {}, given[:1])


def _task_for_submit(cfg):
    return cfg.x


def _hydra_point(tmp_path, i):
    return OmegaConf.create({
        "x": i, "seed": i,
        "hydra": {"job": {"name": "app", "num": i, "config_name": "config", "id": f"app_{i}"},
                  "overrides": {"task": [f"x={i}"],
                                "hydra": [f"hydra.launcher.setup=['export HF_TOKEN={SETUP_SECRET}']"]},
                  "runtime": {"choices": {}}, "sweep": {"dir": str(tmp_path / "out"), "subdir": str(i)},
                  "launcher": {"setup": [f"export HF_TOKEN={SETUP_SECRET}"]}}})


@pytest.mark.usefixtures("cpu_host")  # its premise: local processes on the CPU
def test_a_hydra_apps_launch_keeps_the_journal_and_stops_on_sigterm_as_on_ctrl_c(tmp_path, monkeypatch):
    """The plugin's submission keeps ``.launch.json`` as ``launch`` does (`launcher runs` repairs a
    killed one at once); SIGTERM during it: what was queued is published, the journal removed, the
    app's own handler (here the default) back and the signal sent again; the setup line's secret is
    in the environment the jobs inherit only while they are submitted, and in no staged file."""
    import os
    import shutil
    import signal

    from launcher.archive import atomic, registry
    from launcher.run.job_record import JobRecord
    from launcher.run.rundir import SweepDir
    from launcher.submit import interrupted, signals, submission

    saw = {}

    def fake_submit_array(arr, known, job_name, queued):
        sd = SweepDir(arr.points[0].rundir.path.parent)
        saw["journal"] = atomic.read_json(sd.path / interrupted.JOURNAL)
        saw["env"] = os.environ.get("LAUNCHER_SECRET_CLUSTER_SETUP_HF_TOKEN")
        saw["leaks"] = [str(p) for p in sd.path.rglob("*") if p.is_file() and SETUP_SECRET.encode() in p.read_bytes()]
        os.kill(os.getpid(), signal.SIGTERM)  # arrives while sbatch runs: held until it is recorded
        queued("100", arr.points)
        rec = JobRecord(backend="local", job_id="100")
        for r in arr.points:
            r.staged.write_job(rec)
        shutil.copytree(sd.path, tmp_path / "killed" / sd.path.name)  # what a SIGKILL now would leave
        return [submission.SubmittedRun(r.run_id, r.rundir, "100", record=rec) for r in arr.points]

    monkeypatch.setattr(submission, "_submit_array", fake_submit_array)
    monkeypatch.setattr(software, "versions", lambda: {"python": "3"})  # the launcher's git: a process
    monkeypatch.setattr(software, "pip_freeze", lambda: "")
    (tmp_path / "code").mkdir()
    params = {"runs_root": str(tmp_path / "runs"), "submitit_folder": str(tmp_path / "sub"),
              "code_snapshot": str(tmp_path / "code"), "setup": [f"export HF_TOKEN={SETUP_SECRET}"]}
    configs = [_hydra_point(tmp_path, i) for i in range(2)]
    saved = {s: signal.getsignal(s) for s in signals.HANDLED}
    sent = []
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # as an app's process has it
        with pytest.raises(signals.Terminated):
            with signals.handled(resend=lambda pid, sig: sent.append((pid, sig))):
                generic.submit("local", params, _task_for_submit, None, configs, {}, argv=["app.py", "-m"])
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # the app's own, back
    finally:
        for s, h in saved.items():
            signal.signal(s, h)
    assert sent == [(os.getpid(), signal.SIGTERM)]
    j = saw["journal"]
    assert j["pid"] == os.getpid() and j["indices"] == [0, 1] and j["arrays"] == []
    assert saw["env"] == SETUP_SECRET and "LAUNCHER_SECRET_CLUSTER_SETUP_HF_TOKEN" not in os.environ
    assert saw["leaks"] == []
    (sweep,) = [p for p in (tmp_path / "runs").iterdir() if p.is_dir() and not p.name.startswith(".")]
    sd = SweepDir(sweep)
    assert not (sd.path / interrupted.JOURNAL).exists()
    assert [sd.run(i).job().job_id for i in range(2)] == ["100", "100"]  # published, its job recorded
    run = sd.run(0).run()
    assert run["app"]["hydra_overrides"] == [
        "hydra.launcher.setup=['export HF_TOKEN=\"$LAUNCHER_SECRET_CLUSTER_SETUP_HF_TOKEN\"']"]
    assert list(configs[0].hydra.launcher.setup) == ['export HF_TOKEN="$LAUNCHER_SECRET_CLUSTER_SETUP_HF_TOKEN"']
    leaked = [str(p) for p in (tmp_path / "runs").rglob("*") if p.is_file() and SETUP_SECRET.encode() in p.read_bytes()]
    assert not leaked, leaked

    # killed (SIGKILL) right after the sbatch: the next `launcher runs` publishes it at once, by the journal
    killed = SweepDir(tmp_path / "killed" / sd.path.name)
    journal = atomic.read_json(killed.path / interrupted.JOURNAL)
    assert journal["arrays"] == [{"job_id": "100", "runs": [0, 1]}]
    atomic.write_json(killed.path / interrupted.JOURNAL, {**journal, "pid": 2 ** 22 + 12345})  # its launch gone
    monkeypatch.setattr(registry, "job_states", lambda jobs: {})
    assert interrupted.repair(killed.path.parent) == [
        f"sweep {killed.sweep_id}: repaired an interrupted launch: published 2 run(s) whose job is recorded"]
    assert [rd.path.name for rd in killed.runs()] == ["0", "1"] and not (killed.path / interrupted.JOURNAL).exists()
