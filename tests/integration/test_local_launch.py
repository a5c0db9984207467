"""cluster=local end to end: real processes, real gloo training, a complete first archive."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from helpers import launch, read_metrics, runs_json

pytestmark = [pytest.mark.timeout(300), pytest.mark.dist]


def test_local_run_trains_and_archives(runs_root):
    res = launch(["train.steps=20", "optim.lr=2e-3", "seed=7"], runs_root)
    assert res.returncode == 0, res.stdout + res.stderr
    (run,) = runs_json(runs_root)
    assert run["status"] == "completed" and run["exit_code"] == 0
    rdir = Path(run["dir"])
    assert "archived in" in res.stdout and str(rdir) in res.stdout

    rows = read_metrics(rdir)
    assert [r["step"] for r in rows] == list(range(1, 21))
    for key in ("loss", "tokens_per_s", "step_time_s"):
        assert all(isinstance(r[key], float) for r in rows), key
    first, last = sum(r["loss"] for r in rows[:5]) / 5, sum(r["loss"] for r in rows[-5:]) / 5
    assert last < first - 0.1, (first, last)

    cfg = yaml.safe_load((rdir / "config.yaml").read_text())
    assert "${" not in (rdir / "config.yaml").read_text()  # resolved
    assert cfg["name"] == "gpt_tiny" and cfg["seed"] == 7 and cfg["optim"]["lr"] == 2e-3
    ov = yaml.safe_load((rdir / "overrides.yaml").read_text())
    assert "seed=7" in ov["overrides"] and ov["choices"]["model"] == "gpt_tiny"
    meta = json.loads((rdir / "run.json").read_text())
    assert meta["seed"] == 7 and meta["layout"]["dp"] == 2
    git = json.loads((rdir / "code" / "git.json").read_text())
    assert git["commit"] and len(git["commit"]) == 40
    assert (rdir / "code" / "patch.diff").exists()
    # every installed distribution, as pip itself lists them (read from their metadata, no pip process)
    pip = subprocess.run([sys.executable, "-m", "pip", "freeze", "--all"], capture_output=True, text=True, check=True)
    freeze = (rdir / "env" / "pip-freeze.txt").read_text()
    assert "torch==" in freeze and freeze.splitlines() == [x for x in pip.stdout.splitlines() if not x.startswith("#")]
    ranks = [json.loads((rdir / "ranks" / f"rank_{r}.json").read_text()) for r in range(2)]
    assert {r["rank"] for r in ranks} == {0, 1} and all(r["hostname"] for r in ranks)
    assert ranks[0]["master_port"] == ranks[1]["master_port"] != 29500
    status = json.loads((rdir / "status.json").read_text())
    assert status["status"] == "completed" and status["exit_code"] == 0
    # rank 0 also logged to wandb, offline, inside the run dir (wandb has no reader: check the names)
    (wandb_file,) = list((rdir / "wandb").glob("offline-run-*/run-*.wandb"))
    data = wandb_file.read_bytes()
    assert all(name in data for name in (b"loss", b"tokens_per_s", b"step_time_s", b"samples_per_s", b"tflops"))


def test_local_failure_is_failed_with_traceback(runs_root):
    # the default restart budget (3): the same exception in the same step of attempt 2 ends the run there,
    # the run resuming exactly (no checkpoint: attempt 2 trains steps 1-2 again into the same failure)
    res = launch(["train.steps=10", "train.fail_at_step=3", "train.fail_rank=1"], runs_root)
    assert res.returncode != 0
    (run,) = runs_json(runs_root)
    assert run["status"] == "failed"
    assert "injected failure at step 3 on rank 1" in run["error"]
    status = json.loads((Path(run["dir"]) / "status.json").read_text())
    assert status["attempt"] == 2 and status["no_restart"]["kind"] == "repeated", status
    assert "in the same step (3)" in status["no_restart"]["why"], status["no_restart"]
    log = launch_log(run, rank=1)
    assert "Traceback" in log and "RuntimeError: injected failure" in log


def launch_log(run, rank):
    from helpers import BIN, run_cmd

    res = run_cmd([str(BIN / "launcher"), "logs", run["run_id"], "--rank", str(rank), "--err",
                   "--root", str(Path(run["dir"]).parent.parent)], Path(run["dir"]).parent.parent)
    assert res.returncode == 0, res.stderr
    return res.stdout


@pytest.mark.parametrize(
    "override,key",
    [
        ("model.hiden_size=8", "model.hiden_size"),
        ("train.steps=many", "train.steps"),
        ("parallelism.tp=3", "parallelism.tp"),
        ("precision.dtype=fp8", "precision.dtype"),
        ("train.global_batch_size=10", "train.global_batch_size"),
    ],
)
def test_bad_input_is_rejected_before_anything_is_written(runs_root, override, key):
    res = launch([override], runs_root, timeout=120)
    assert res.returncode != 0
    assert key in res.stderr + res.stdout
    assert not runs_root.exists() or not list(runs_root.glob("*/*/run.json"))
    assert not runs_root.exists() or not any(runs_root.iterdir())  # nothing at all: no sweep dir, no snapshot


def test_sweep_with_one_bad_point_launches_nothing(runs_root):
    res = launch(["-m", "cluster.gpus_per_node=1,3", "parallelism.tp=1", "train.global_batch_size=16"], runs_root,
                 timeout=120)
    assert res.returncode != 0
    assert "1 of 2 point(s) invalid; nothing was submitted" in res.stderr
    assert "train.global_batch_size" in res.stderr
    assert not runs_root.exists() or not list(runs_root.glob("*/*/run.json"))
    assert not runs_root.exists() or not any(runs_root.iterdir())  # nothing at all: no sweep dir, no snapshot


def test_dry_run_prints_config_and_sbatch_and_submits_nothing(runs_root):
    res = launch(["-m", "submit.dry_run=true", "cluster=local_slurm", "optim.lr=1e-3,2e-3"], runs_root, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.count("# ---- point") == 2
    assert "#SBATCH --array=0-1%2" in res.stdout and "submitit.core._submit" in res.stdout
    assert "lr: 0.002" in res.stdout
    assert not runs_root.exists() or not list(runs_root.glob("*/*/run.json"))


@pytest.mark.timeout(300)
def test_each_run_writes_relative_paths_into_its_own_work_dir(tmp_path):
    """A user's recipe (a package outside the project) that writes to a relative path: every point of
    a sweep writes into its own run's work/ dir, never into the sweep's shared code snapshot."""
    pkg = tmp_path / "userproj" / "relpkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "train.py").write_text(
        "import os\n\n\ndef main(cfg, ctx):\n"
        "    with open('out.txt', 'w') as f:\n"
        "        f.write(str(cfg.seed))\n"
        "    return {'cwd': os.getcwd()}\n")
    runs_root = tmp_path / "runs"
    res = launch(["-m", "seed=1,2", "recipe._target_=relpkg.train.main", "cluster=local"],
                 runs_root, timeout=240, cwd=pkg.parent)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    runs = runs_json(runs_root)
    assert sorted(r["status"] for r in runs) == ["completed", "completed"], runs
    for r in runs:
        work = Path(r["dir"]) / "work"
        summary = json.loads((Path(r["dir"]) / "status.json").read_text())["summary"]
        assert Path(summary["cwd"]) == work
    assert sorted((Path(r["dir"]) / "work" / "out.txt").read_text() for r in runs) == ["1", "2"]
    snapshot = Path(runs[0]["dir"]).parent / "code"
    assert not list(snapshot.rglob("out.txt")), "a run wrote into the shared code snapshot"
