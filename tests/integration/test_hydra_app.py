"""Any Hydra app on this project's Hydra launcher (hydra/launcher=launcher_local | launcher_slurm):
the example app recipes/hydra_example swept for real, its return values (and a failing point's
exception) back in Hydra's JobReturns, its runs archived and listed by `launcher runs`, Hydra's
output dirs as Hydra's own launchers leave them. (Hydra's own launcher test suites:
test_hydra_suites.py; signals and requeues: test_hydra_requeue.py.)"""
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import List

import pytest
import yaml

from helpers import REPO, run_cmd, runs_json, wait_final
from launcher.run.rundir import RunDir

pytestmark = [pytest.mark.timeout(420)]

APP = ["-m", "recipes.hydra_example.app"]


def quadratic(x: float, y: float) -> float:
    return (x - 1.0) ** 2 + (y + 2.0) ** 2


def run_app(args: List[str], runs_root: Path, cwd: Path, extra_env=None, timeout: float = 360):
    return run_cmd([sys.executable, *APP, *args], runs_root, timeout=timeout, extra_env=extra_env, cwd=cwd)


def check_archived(run: dict, sweep_out: Path, point: dict) -> RunDir:
    """The run dir a generic app's point gets, and Hydra's own output dir of that point."""
    rd = RunDir(run["dir"])
    meta = rd.run()
    assert meta["kind"] == "hydra_app" and meta["app"]["task_function"].endswith("main")
    cfg = rd.config()
    assert "hydra" not in cfg and {k: cfg[k] for k in point} == point
    assert rd.seeds()["seed"] == cfg["seed"]
    over = rd.overrides()["overrides"]
    assert all(f"{k}={v}" in over for k, v in point.items()), over
    snap = Path(rd.snapshot()["path"])
    assert (snap / "recipes" / "hydra_example" / "app.py").is_file()
    assert rd.software()["python"] and rd.job().job_id == run["job_id"]
    assert rd.ranks() and rd.ranks()[0]["rank"] == 0 and rd.topology()
    assert rd.runtime()["python"]
    assert rd.is_sealed() and rd.verify() == []
    for name in (RunDir.SEEDS, RunDir.OVERRIDES, RunDir.GIT, RunDir.PIP_FREEZE):  # the run's own, from the sweep's
        assert (rd.path / name).is_file(), name
    st = rd.status()
    out = Path(st.output_dir)
    assert out.parent == sweep_out.resolve()
    for name in ("config.yaml", "overrides.yaml", "hydra.yaml"):
        assert (out / ".hydra" / name).is_file(), name
    assert yaml.safe_load((out / ".hydra" / "config.yaml").read_text())["x"] == point["x"]
    return rd


# ---- the example app from the command line ------------------------------------------------------


def test_example_app_local(runs_root, tmp_path):
    out = tmp_path / "sweep"
    res = run_app(["-m", "x=1,2", "y=0,1", "hydra/launcher=launcher_local", f"hydra.sweep.dir={out}",
                   "hydra.job.chdir=true"], runs_root, cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "4 run(s) submitted (local)" in res.stdout
    # blocking by default: every run has ended; sealed (the job's end seals it, after the app returns)
    runs = wait_final(runs_root, 4, timeout=180)
    assert [r["status"] for r in runs] == ["completed"] * 4, runs
    assert [r["index"] for r in runs] == [0, 1, 2, 3]
    for i, (r, (x, y)) in enumerate(zip(runs, [(1, 0), (1, 1), (2, 0), (2, 1)])):
        rd = check_archived(r, out, {"x": x, "y": y})
        st = rd.status()
        assert st.summary["return_value"] == quadratic(x, y)
        assert Path(st.output_dir) == out / str(i)
        # job.chdir=true: the task ran in its output dir, and wrote its own file there
        assert Path(st.working_dir).resolve() == (out / str(i)).resolve()
        assert float((out / str(i) / "value.txt").read_text()) == quadratic(x, y)
        assert (out / str(i) / "app.log").is_file()  # Hydra's job log
    assert (out / "multirun.yaml").is_file()


def reproduce(args: List[str], runs_root: Path, cwd: Path):
    return run_cmd([sys.executable, "-m", "launcher.cli.main", "reproduce", *args, "--root", str(runs_root)],
                   runs_root, timeout=300, cwd=cwd)


def test_reproduce_a_hydra_app_run(runs_root, tmp_path):
    """`launcher reproduce` of an app's run starts the app again from its code snapshot with the point's
    overrides on the same launcher: the same config and seed give the same value, bitwise; a change
    replaces its key; a secret the archive redacted must be given again."""
    out = tmp_path / "sweep"
    res = run_app(["-m", "x=1,2", "noise=0.5", "seed=3,4", "+api_key=sk-repro-0123456789abcd",
                   "hydra/launcher=launcher_local", f"hydra.sweep.dir={out}"], runs_root, cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    runs = runs_json(runs_root)
    orig = next(r for r in runs if r["index"] == 2)  # x=2 seed=3
    assert RunDir(orig["dir"]).run()["app"]["entry"] == {"module": "recipes.hydra_example.app"}  # started with -m
    want = RunDir(orig["dir"]).status().summary["return_value"]
    assert want != quadratic(2, 0)  # the seeded noise is in it

    refused = reproduce([orig["run_id"]], runs_root, tmp_path)
    assert refused.returncode == 2 and "api_key: was redacted in the archive" in refused.stderr, refused.stderr
    assert f"launcher reproduce {orig['run_id']} +api_key=<value>" in refused.stderr

    again = reproduce([orig["run_id"], "+api_key=sk-other-0123456789abcd"], runs_root, tmp_path)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    new = [r for r in runs_json(runs_root) if r["run_id"] not in {x["run_id"] for x in runs}]
    assert len(new) == 1 and new[0]["status"] == "completed" and new[0]["reproduces"] == orig["run_id"], new
    rd = RunDir(new[0]["dir"])
    assert rd.status().summary["return_value"] == want  # bitwise: same code, config and seed
    cfg, was = rd.config(), RunDir(orig["dir"]).config()
    assert {k: cfg[k] for k in ("x", "y", "seed", "noise")} == {k: was[k] for k in ("x", "y", "seed", "noise")}
    assert rd.snapshot()["path"] == RunDir(orig["dir"]).snapshot()["path"]  # it ran the archived code

    changed = reproduce([orig["run_id"], "+api_key=sk-other-0123456789abcd", "noise=0", "y=1"], runs_root, tmp_path)
    assert changed.returncode == 0, changed.stderr[-3000:]
    latest = max((r for r in runs_json(runs_root) if r.get("reproduces") == orig["run_id"]), key=lambda r: r["created"])
    assert RunDir(latest["dir"]).status().summary["return_value"] == quadratic(2, 1)


# an app that puts its outputs next to its own code, as rootutils.setup_root(__file__) does (the
# lightning-hydra-template): the task writes a checkpoint under ROOT, Hydra's sweep dir is under ROOT
FILE_ROOTED_APP = """import os
from pathlib import Path

import hydra

ROOT = Path(__file__).resolve().parent
os.environ["APP_ROOT"] = str(ROOT)


@hydra.main(version_base=None, config_path="conf", config_name="config")
def main(cfg):
    out = ROOT / "logs" / "checkpoints"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"x{cfg.x}.ckpt").write_text(str(cfg.x))
    return cfg.x * 10


if __name__ == "__main__":
    main()
"""
FILE_ROOTED_CONFIG = "x: 1\nhydra:\n  sweep:\n    dir: ${oc.env:APP_ROOT}/logs/multiruns/${now:%H-%M-%S-%f}\n"


def test_reproduce_writes_outside_the_archive(runs_root, tmp_path):
    """An app outside git whose output root derives from `__file__`, with Hydra output dirs of an
    earlier sweep in its tree: its snapshot leaves those out and says it has no git repo; reproduced,
    the app runs from a copy of the snapshot in the reproduction's own dir, so its logs and checkpoints
    land there, and the original run still matches its seal (`launcher show` of it reports no change)."""
    app = tmp_path / "app"
    (app / "conf").mkdir(parents=True)
    (app / "app.py").write_text(FILE_ROOTED_APP)
    (app / "conf" / "config.yaml").write_text(FILE_ROOTED_CONFIG)
    earlier = run_cmd([sys.executable, "app.py", "-m", "x=7", "hydra.sweep.dir=sweeps/a"], runs_root, cwd=app)
    assert earlier.returncode == 0 and (app / "sweeps" / "a" / "0" / ".hydra").is_dir(), earlier.stderr[-3000:]

    res = run_cmd([sys.executable, "app.py", "-m", "x=1,2", "hydra/launcher=launcher_local"], runs_root, cwd=app,
                  timeout=360)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    runs = runs_json(runs_root)
    assert [r["status"] for r in runs] == ["completed"] * 2, runs
    orig = RunDir(next(r for r in runs if r["index"] == 1)["dir"])
    snap = Path(orig.snapshot()["path"])
    held = sorted(str(p.relative_to(snap)) for p in snap.rglob("*")
                  if p.is_file() and not p.name.startswith(".") and "__pycache__" not in p.parts)
    assert held == ["app.py", "conf/config.yaml"], held  # no sweeps/a/**/.hydra, no logs/ of the earlier run
    assert orig.git()["repo"] is None and orig.git()["note"] == "not a git repo", orig.git()
    assert all(not p.stat().st_mode & 0o222 for p in [snap, *snap.rglob("*")]), "a writable snapshot entry"
    assert (app / "logs" / "checkpoints" / "x2.ckpt").is_file()  # the original run wrote next to its code

    again = reproduce([orig.run()["run_id"]], runs_root, tmp_path)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    (new,) = [r for r in runs_json(runs_root) if r["run_id"] not in {x["run_id"] for x in runs}]
    rd = RunDir(new["dir"])
    assert new["status"] == "completed" and rd.status().summary["return_value"] == 20
    assert orig.verify() == [] and not (snap / "logs").exists()  # nothing was written into the archive
    show = run_cmd([sys.executable, "-m", "launcher.cli.main", "show", str(orig.path)], runs_root, timeout=120)
    assert show.returncode == 0 and "SEAL" not in show.stdout + show.stderr, show.stdout + show.stderr
    # the reproduction's outputs are in its own dir: the copy of the snapshot it ran
    work = Path(rd.run()["work_dir"])
    assert work.parent == runs_root / ".reproductions" and (work / "logs" / "checkpoints" / "x2.ckpt").is_file()
    assert Path(rd.status().output_dir).is_relative_to(work / "logs" / "multiruns")
    assert rd.snapshot()["path"] == str(snap) and rd.verify() == []  # it records (and sealed) the archived code


def test_secrets_stay_out_of_the_archive_and_tasks_share_a_job(runs_root, tmp_path):
    """A secret given on the command line reaches the task but nothing under runs_root; two tasks
    per job both run the task function, rank 0 records the outcome."""
    secret = "sk-hydra-app-0123456789"
    out = tmp_path / "sweep"
    res = run_app(["-m", "x=1,2", f"+api_key={secret}", "hydra/launcher=launcher_local",
                   "hydra.launcher.tasks_per_node=2", f"hydra.sweep.dir={out}"], runs_root, cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert secret not in res.stdout
    runs = runs_json(runs_root)
    assert [r["status"] for r in runs] == ["completed"] * 2, runs
    for r in runs:
        rd = RunDir(r["dir"])
        assert rd.config()["api_key"] == "<redacted>"
        assert [k["rank"] for k in rd.ranks()] == [0, 1] and rd.status().world_size == 2
        assert yaml.safe_load((Path(rd.status().output_dir) / ".hydra" / "config.yaml").read_text())[
            "api_key"] == secret  # Hydra's own output dir: the task's config as the task saw it
    leaked = [str(p) for p in runs_root.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]
    assert not leaked, leaked


@pytest.mark.slurm
def test_example_app_slurm_one_array_and_a_failing_point(slurm, runs_root, tmp_path):
    out = tmp_path / "sweep"
    res = run_app(["-m", "x=1,2", "fail=false,true", "hydra/launcher=launcher_slurm",
                   "hydra.launcher.partition=debug", "hydra.launcher.timeout_min=10", f"hydra.sweep.dir={out}"],
                  runs_root, cwd=tmp_path, extra_env=slurm)
    # Hydra's basic sweeper re-raises the failed point's exception once every job has ended
    assert res.returncode == 1, res.stdout[-3000:] + res.stderr[-3000:]
    assert "ValueError: asked to fail (x=1, y=0.0)" in res.stderr, res.stderr[-3000:]
    assert "4 run(s) submitted (slurm)" in res.stdout
    runs = wait_final(runs_root, 4, timeout=180)  # sealed: each job's end seals it, after the app returns
    assert [r["status"] for r in runs] == ["completed", "failed", "completed", "failed"], runs
    arrays = {r["job_id"].split("_")[0] for r in runs}
    assert len(arrays) == 1, arrays  # ONE array job for the sweep
    (array,) = arrays
    assert [r["job_id"] for r in runs] == [f"{array}_{i}" for i in range(4)]
    for r, (x, fail) in zip(runs, [(1, False), (1, True), (2, False), (2, True)]):
        rd = check_archived(r, out, {"x": x, "fail": fail})
        assert "#SBATCH --array=0-3" in rd.script()
        assert rd.ranks()[0]["slurmd_nodename"].startswith("node")
        st = rd.status()
        if fail:
            assert st.error.startswith("ValueError: asked to fail") and rd.rank_errors()
            assert not (Path(st.output_dir) / "value.txt").exists()
        else:
            assert st.summary["return_value"] == quadratic(x, 0.0)
            # job.chdir=false (Hydra 1.3's default): the task ran in the launch directory
            assert Path(st.working_dir).resolve() == tmp_path.resolve()
            assert float((Path(st.output_dir) / "value.txt").read_text()) == quadratic(x, 0.0)
    show = run_cmd([sys.executable, "-m", "launcher.cli.main", "show", runs[0]["run_id"], "--root", str(runs_root)],
                   runs_root, timeout=120)
    assert show.returncode == 0, show.stdout + show.stderr
    assert "returned" in show.stdout and repr(quadratic(1, 0.0)) in show.stdout, show.stdout
    listed = run_cmd([sys.executable, "-m", "launcher.cli.main", "runs", "--json", "--root", str(runs_root)],
                     runs_root, timeout=120)
    assert [r["return_value"] for r in json.loads(listed.stdout)] == [quadratic(1, 0), None, quadratic(2, 0), None]
    diff = run_cmd([sys.executable, "-m", "launcher.cli.main", "diff", runs[0]["run_id"], runs[2]["run_id"],
                    "--root", str(runs_root)], runs_root, timeout=120)
    assert diff.returncode == 0 and "x: 1 -> 2" in diff.stdout, diff.stdout + diff.stderr


@pytest.mark.slurm
def test_sweep_larger_than_max_array_size_splits(slurm, runs_root, tmp_path):
    """5 points, at most 2 tasks per array: 3 arrays, every point runs, results in job order."""
    res = run_app(["-m", "x=1,2,3,4,5", "hydra/launcher=launcher_slurm", "hydra.launcher.partition=debug",
                   "hydra.launcher.max_array_size=2", "hydra.launcher.array_parallelism=3",
                   f"hydra.sweep.dir={tmp_path / 'sweep'}"], runs_root, cwd=tmp_path, extra_env=slurm)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    runs = runs_json(runs_root)
    arrays = [r["job_id"].split("_")[0] for r in runs]
    assert len(set(arrays)) == 3 and arrays[0] == arrays[1] != arrays[2] == arrays[3] != arrays[4], arrays
    assert [r["status"] for r in runs] == ["completed"] * 5
    assert [r["return_value"] for r in runs] == [quadratic(x, 0) for x in range(1, 6)]
    scripts = [RunDir(r["dir"]).script() for r in runs]
    # the throttle (3 at once) shared out between the 3 arrays: 1 each
    assert "#SBATCH --array=0-1%1" in scripts[0] and "#SBATCH --array=0-1%1" in scripts[2], scripts[0]
    assert "--array" not in scripts[4] and "_" not in runs[4]["job_id"]  # a lone point is a plain job


@pytest.mark.slurm
def test_wait_false_returns_once_queued(slurm, runs_root, tmp_path):
    """...and a secret exported in hydra.launcher.setup reaches the job (its setup line reads it from the
    LAUNCHER_SECRET_ variable the job inherits) and no file of the archive."""
    secret = "hf_hydraSetup0123456789"
    seen = tmp_path / "seen"
    setup = f"hydra.launcher.setup=['export HF_TOKEN={secret}','printf %s \"$HF_TOKEN\" > {seen}']"
    res = run_app(["-m", "x=3,4", "sleep_s=2", "hydra/launcher=launcher_slurm", "hydra.launcher.partition=debug",
                   "hydra.launcher.wait=false", f"hydra.sweep.dir={tmp_path / 'sweep'}", setup],
                  runs_root, cwd=tmp_path, extra_env=slurm)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    runs = wait_final(runs_root, 2, timeout=300)
    assert [RunDir(r["dir"]).status().summary["return_value"] for r in runs] == [quadratic(3, 0), quadratic(4, 0)]
    assert seen.read_text() == secret  # the job's setup line had the value
    assert secret not in res.stdout + res.stderr
    script = RunDir(runs[0]["dir"]).script()
    assert 'export HF_TOKEN="$LAUNCHER_SECRET_CLUSTER_SETUP_HF_TOKEN"' in script and secret not in script
    leaked = [str(p) for p in runs_root.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]
    assert not leaked, leaked


def test_optuna_sweeper_gets_the_return_values(runs_root, tmp_path):
    """A sweeper that needs results (hydra-optuna-sweeper) on our launcher: every trial's value comes
    back, each batch of trials is one submission into the study's one sweep, and the best value is the
    smallest return value."""
    out = tmp_path / "sweep"
    res = run_app(["-m", "hydra/sweeper=optuna", "hydra.sweeper.n_trials=4", "hydra.sweeper.n_jobs=2",
                   "x=interval(-2,3)", "y=interval(-3,0)", "hydra/launcher=launcher_local", f"hydra.sweep.dir={out}"],
                  runs_root, cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    runs = runs_json(runs_root)
    # 2 batches of 2 trials, one sweep: run index = Hydra's job number, one submission per batch
    assert len(runs) == 4 and len({r["sweep_id"] for r in runs}) == 1, runs
    assert sorted(r["run_id"].rsplit("-", 1)[1] for r in runs) == ["0", "1", "2", "3"]
    assert all(RunDir(r["dir"]).run()["hydra"]["job_num"] == RunDir(r["dir"]).run()["index"] for r in runs)
    sweep = json.loads((runs_root / runs[0]["sweep_id"] / "sweep.json").read_text())
    assert sweep["num_runs"] == 4 and sweep["runs"] == [f"{runs[0]['sweep_id']}-{i}" for i in range(4)]
    values = [RunDir(r["dir"]).status().summary["return_value"] for r in runs]
    for r, v in zip(runs, values):
        cfg = RunDir(r["dir"]).config()
        assert v == pytest.approx(quadratic(cfg["x"], cfg["y"]))
    best = yaml.safe_load((out / "optimization_results.yaml").read_text())
    assert best["best_value"] == pytest.approx(min(values))


EXITING_APP = """
import sys, hydra

@hydra.main(version_base="1.3", config_path=None, config_name=None)
def main(cfg):
    if cfg.mode == "exit" and cfg.x == 2:
        sys.exit(3)
    if cfg.mode == "gen":
        return (i for i in range(3))
    return cfg.x

if __name__ == "__main__":
    main()
"""


@pytest.mark.parametrize("mode", ["exit", "gen"])
def test_a_task_that_exits_or_returns_what_cannot_be_pickled(mode, runs_root, tmp_path):
    """sys.exit(3) in one point: the others complete, the launch exits 3, Hydra's message names the
    point. A generator returned (it cannot go back to the launcher): every point FAILED, archived
    failed (not completed), the message naming the point and why."""
    app = tmp_path / "app"
    app.mkdir()
    (app / "app.py").write_text(EXITING_APP)
    res = run_cmd([sys.executable, "app.py", "-m", "+x=1,2,3", f"+mode={mode}", "hydra/launcher=launcher_local",
                   f"hydra.sweep.dir={tmp_path / 'sweep'}"], runs_root, timeout=360, cwd=app)
    runs = runs_json(runs_root)
    if mode == "exit":
        assert res.returncode == 3, res.stdout[-3000:] + res.stderr[-3000:]
        assert "Error executing job with overrides: ['+x=2', '+mode=exit']" in res.stderr, res.stderr[-3000:]
        assert [r["status"] for r in runs] == ["completed", "failed", "completed"], runs
        assert [r["return_value"] for r in runs] == [1, None, 3]
        assert RunDir(runs[1]["dir"]).status().error == "SystemExit: 3"
    else:
        assert res.returncode == 1, res.stdout[-3000:] + res.stderr[-3000:]
        assert "Error executing job with overrides: ['+x=1', '+mode=gen']" in res.stderr, res.stderr[-3000:]
        assert "its return value cannot be pickled back to the launcher" in res.stderr, res.stderr[-3000:]
        assert [r["status"] for r in runs] == ["failed"] * 3, runs
        assert all("cannot be pickled" in RunDir(r["dir"]).status().error for r in runs)


# ---- JobReturns, through a tiny wrapper: the app's task function on our launcher, in process -------


def launch_points(launcher_name: str, points: List[List[str]], overrides: List[str], tmp_path: Path):
    """What Hydra's sweeper does with a batch: compose, instantiate the launcher, launch; the JobReturns."""
    from hydra._internal.callbacks import Callbacks
    from hydra._internal.hydra import Hydra
    from hydra._internal.utils import create_config_search_path
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.plugins import Plugins
    from hydra.types import HydraContext, RunMode

    from recipes.hydra_example import app

    GlobalHydra.instance().clear()
    hydra_ = Hydra.create_main_hydra2(task_name="app", config_search_path=create_config_search_path(
        str(REPO / "recipes" / "hydra_example" / "conf")))
    try:
        cfg = hydra_.compose_config("config", overrides=[f"hydra/launcher={launcher_name}",
                                                         f"hydra.sweep.dir={tmp_path / 'sweep'}", *overrides],
                                    run_mode=RunMode.MULTIRUN)
        ctx = HydraContext(config_loader=hydra_.config_loader, callbacks=Callbacks(cfg))
        launcher = Plugins.instance().instantiate_launcher(hydra_context=ctx, task_function=app.main.__wrapped__,
                                                           config=cfg)
        return launcher.launch(points, initial_job_idx=0)
    finally:
        GlobalHydra.instance().clear()


@pytest.mark.usefixtures("hydra_restore_singletons")
def test_job_returns_in_order_with_a_failed_point(runs_root, tmp_path, monkeypatch):
    from hydra.core.utils import JobStatus

    monkeypatch.setenv("LAUNCHER_RUNS", str(runs_root))
    monkeypatch.chdir(tmp_path)
    points = [["x=3"], ["x=1", "fail=true"], ["x=0", "y=1"]]
    rets = launch_points("launcher_local", points, [], tmp_path)
    assert [r.status for r in rets] == [JobStatus.COMPLETED, JobStatus.FAILED, JobStatus.COMPLETED]
    assert rets[0].return_value == quadratic(3, 0) and rets[2].return_value == quadratic(0, 1)
    with pytest.raises(ValueError, match="asked to fail"):
        _ = rets[1].return_value
    assert [r.overrides for r in rets] == points
    assert [r.hydra_cfg.hydra.job.num for r in rets] == [0, 1, 2]
    assert all(r.hydra_cfg.hydra.job.id for r in rets)
    runs = runs_json(runs_root)
    assert [r["status"] for r in runs] == ["completed", "failed", "completed"]


@pytest.mark.usefixtures("hydra_restore_singletons")
def test_wait_false_job_returns_hold_run_ids(runs_root, tmp_path, monkeypatch):
    monkeypatch.setenv("LAUNCHER_RUNS", str(runs_root))
    monkeypatch.chdir(tmp_path)
    rets = launch_points("launcher_local", [["x=5"], ["x=6"]], ["hydra.launcher.wait=false"], tmp_path)
    ids = [r.return_value for r in rets]
    runs = wait_final(runs_root, 2, timeout=300)
    assert ids == [r["run_id"] for r in runs]
    assert [RunDir(r["dir"]).status().summary["return_value"] for r in runs] == [quadratic(5, 0), quadratic(6, 0)]


def test_registered_for_an_app_that_never_imports_the_project(tmp_path):
    """`--info plugins` of a bare Hydra app lists our launchers (Hydra's plugin scan registers them)."""
    (tmp_path / "bare.py").write_text(
        "import hydra\n\n@hydra.main(version_base=None, config_path=None)\ndef f(cfg):\n    pass\n\n"
        "if __name__ == '__main__':\n    f()\n")
    res = subprocess.run([sys.executable, "bare.py", "--info", "defaults", "hydra/launcher=launcher_slurm"],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": ""})
    assert res.returncode == 0, res.stderr
    assert "hydra/launcher/launcher_slurm" in res.stdout
