"""The parts of results mode without real runs: which sweeps wait for results, the JobReturns the
plugin builds (objective, failed run, refused point), the objective read from a run's summary, where
a study's results go (scrubbed), and check_each."""
import io
from pathlib import Path
from types import SimpleNamespace

import pytest
from hydra import initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.utils import JobStatus
from hydra.errors import CompactHydraException
from hydra.types import RunMode
from omegaconf import OmegaConf, open_dict, read_write

import launcher.app as app
from hydra_plugins.launcher_plugin.plugin import BASIC_SWEEPER, LauncherPlugin
from launcher.app import CONF_DIR, RunFailed
from launcher.run.status import RunStatus, Status

OPTUNA = "hydra_plugins.hydra_optuna_sweeper.optuna_sweeper.OptunaSweeper"
SECRET = "hf_abcdefgh12345678"


@pytest.fixture(scope="module")
def loader():
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        yield GlobalHydra.instance().config_loader()


def _master(loader, sweeper, *overrides):
    cfg = loader.load_configuration("config", list(overrides), run_mode=RunMode.MULTIRUN)
    with read_write(cfg), open_dict(cfg):
        cfg.hydra.sweeper = OmegaConf.create({"_target_": sweeper})
    return cfg


def _plugin(loader, master, monkeypatch):
    monkeypatch.setattr("atexit.register", lambda f: None)
    plugin = LauncherPlugin()
    plugin.setup(hydra_context=SimpleNamespace(config_loader=loader), task_function=None, config=master)
    return plugin


@pytest.mark.parametrize("sweeper,wait,needs", [
    (BASIC_SWEEPER, None, False), (BASIC_SWEEPER, False, False), (BASIC_SWEEPER, True, True),
    (OPTUNA, None, True), (OPTUNA, False, True), ("hydra_plugins.x.NevergradSweeper", None, True),
])
def test_which_sweeps_wait_for_results(loader, sweeper, wait, needs, monkeypatch):
    master = _master(loader, sweeper, *([] if wait is None else [f"submit.wait={str(wait).lower()}"]))
    assert _plugin(loader, master, monkeypatch).needs_results() is needs


def test_job_returns_of_a_batch(loader, monkeypatch, tmp_path, capsys):
    master = _master(loader, OPTUNA)
    plugin = _plugin(loader, master, monkeypatch)
    private = Path(plugin.sweep_dir)
    assert private.is_dir() and str(master.hydra.sweep.dir) == str(private)
    sweep_dir = tmp_path / "S1"
    sweep_dir.mkdir()
    seen = {}

    def fake_submit(points, *, objective, extra_meta=None, out=None, into=None, indices=None):
        seen.update(n=len(points), objective=objective, meta=extra_meta, into=into, indices=indices)
        result = SimpleNamespace(dry_run=False, sweep_id="S1", sweep_dir=sweep_dir)
        return result, [6.25, RunFailed("run S1-1 failed: RuntimeError: boom")], ["S1-0", "S1-1"]

    monkeypatch.setattr(app, "submit_for_results", fake_submit)
    batch = [["optim.lr=0.001", f"+cluster.env.HF_TOKEN={SECRET}"], ["optim.lr=0.002"],
             ["optim.lr=0.003", "train.steps=4", "train.fail_at_step=9"]]
    rets = plugin.launch(batch, initial_job_idx=4)
    assert not private.exists()  # multirun.yaml's dir: gone before anything was submitted
    assert [r.status for r in rets] == [JobStatus.COMPLETED, JobStatus.FAILED, JobStatus.FAILED]
    assert rets[0].return_value == 6.25
    with pytest.raises(RunFailed, match="boom"):
        _ = rets[1].return_value
    with pytest.raises(RunFailed, match="train.fail_at_step"):  # refused by the checks: a failed trial
        _ = rets[2].return_value
    # the first batch makes the study's sweep; its runs are numbered by trial (refused trial 6: none)
    assert seen["n"] == 2 and seen["objective"] == "final_loss" and seen["into"] is None
    assert seen["indices"] == [4, 5]
    assert seen["meta"]["study"] == {"sweeper": OPTUNA, "objective": "final_loss"}
    assert rets[1].overrides == ["optim.lr=0.002"] and rets[1].hydra_cfg.overrides.task == ["optim.lr=0.002"]
    out = capsys.readouterr()
    assert "trial 4 (optim.lr=0.001 +cluster.env.HF_TOKEN=<redacted>): final_loss = 6.25  (run S1-0)" in out.out
    assert SECRET not in out.out + out.err
    assert ("trial 6 (optim.lr=0.003 train.steps=4 train.fail_at_step=9): failed: refused by the launch checks: "
            "- train.fail_at_step") in out.out
    assert "trial 5 (optim.lr=0.002): failed: run S1-1 failed: RuntimeError: boom" in out.out
    assert "trial 6 refused by the launch checks: - train.fail_at_step" in out.err

    # the sweeper writes its results where hydra.sweep.dir now points: the study's sweep dir, which
    # every later batch joins
    assert str(master.hydra.sweep.dir) == str(sweep_dir)
    plugin.launch([["optim.lr=0.004"], ["optim.lr=0.005"]], initial_job_idx=7)
    assert seen["into"] == sweep_dir and seen["indices"] == [7, 8]
    assert str(master.hydra.sweep.dir) == str(sweep_dir)
    (sweep_dir / "optimization_results.yaml").write_text(f"name: optuna\nbest_params:\n  tok: {SECRET}\n")
    capsys.readouterr()
    plugin._at_exit()
    printed = capsys.readouterr().out
    assert SECRET not in (sweep_dir / "optimization_results.yaml").read_text() and SECRET not in printed
    assert f"results in {sweep_dir}" in printed and "name: optuna" in printed
    assert "study: 2 batch(es) in sweep S1" in printed


def test_run_failed_is_compact():
    """Where a sweeper re-raises it (BasicSweeper), Hydra prints the message, not a traceback."""
    assert issubclass(RunFailed, CompactHydraException)


class _Run:
    def __init__(self, index, status, summary=None, error=None):
        self.run_id = f"S-{index}"
        self.rundir = SimpleNamespace(status=lambda: RunStatus(state=Status(status), summary=summary, error=error))


@pytest.mark.parametrize("objective,want", [("final_loss", 5.5), ("mean_tokens_per_s", 1234.0)])
def test_objective_from_the_summary(objective, want, monkeypatch):
    import launcher.run.outcome as outcome
    import launcher.submit.pipeline as pipeline
    import launcher.submit.progress as progress

    runs = [_Run(1, "failed", error="RuntimeError: x"), _Run(0, "completed", {"final_loss": 5.5,
                                                                              "mean_tokens_per_s": 1234}),
            _Run(2, "completed", {"final_loss": "nan?"})]
    result = SimpleNamespace(dry_run=False, runs=runs)
    monkeypatch.setattr(pipeline, "launch", lambda points, **kw: (print("sweep S: 3 run(s) submitted", file=kw["out"]),
                                                                   result)[1])
    monkeypatch.setattr(progress, "wait_and_report", lambda *a, **kw: True)
    monkeypatch.setattr(outcome, "settle", lambda rd, ended=False: rd.status().state)
    monkeypatch.setattr(progress, "log_of_failure", lambda r: Path("/logs/err"))
    points = [SimpleNamespace(cfg=OmegaConf.create({"submit": {"wait_timeout_s": 0}}))] * 3
    out = io.StringIO()
    _, got, ids = app.submit_for_results(points, objective=objective, out=out)
    assert out.getvalue() == "sweep S: 3 run(s) submitted\n"
    assert got[0] == want and isinstance(got[0], float) and ids == ["S-0", "S-1", "S-2"]
    assert isinstance(got[1], RunFailed) and "RuntimeError: x" in str(got[1]) and "/logs/err" in str(got[1])
    assert isinstance(got[2], RunFailed) and f"submit.objective={objective!r}" in str(got[2])


def test_check_each_names_the_refused_points(loader):
    from launcher.submit.pipeline import Point

    master = _master(loader, OPTUNA)
    from launcher.config.compose import SweepComposer

    composer = SweepComposer(loader)
    points = []
    for ov in (["train.steps=4"], ["train.steps=4", "train.fail_at_step=9"], ["optim.lr=0.01"]):
        cfg = composer.compose(master, ov)
        with read_write(cfg), open_dict(cfg):
            cfg.pop("hydra")
        points.append(Point(cfg=cfg, overrides=ov))
    bad = app.check_each(points)
    assert list(bad) == [1] and "train.fail_at_step" in str(bad[1])
