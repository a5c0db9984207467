"""Sweepers that need results, on `launch -m`: a real Optuna study (hydra-optuna-sweeper) over
optim.lr on cluster=local gets each run's objective back, a deliberately failing trial is a failed
trial and the study goes on, and the study's best value is reported and saved in its sweep dir (all
its batches are one sweep); Hydra's BasicSweeper with submit.wait=true waits, returns submit.objective, and exits 1
when a point failed."""
import json
import re
from pathlib import Path

import pytest
import yaml

from helpers import BIN, launch, run_cmd, runs_json

pytestmark = [pytest.mark.timeout(600), pytest.mark.dist]

TINY = ["model=gpt_tiny", "cluster=local", "cluster.gpus_per_node=1", "train.steps=4",
        "train.log_interval=0", "train.max_restarts=0"]  # no restart: a failing point is the outcome

# TPE (seeded: its first trials are random draws) over the learning rate and over which attempt the
# injected fault fires on: attempt 1 fails the run at step 2; attempt 2 never comes (no restarts),
# so those runs complete. With seed 6, trial 2 of 5 draws attempt 1: batches of 2 trials, one failure
# in a batch of 2 is within max_failure_rate=0.5.
STUDY = ["hydra/sweeper=optuna", "hydra.sweeper.n_trials=5", "hydra.sweeper.n_jobs=2",
         "hydra.sweeper.sampler.seed=6", "hydra.sweeper.max_failure_rate=0.5",
         "optim.lr=interval(0.001,0.01)", "train.fail_attempt=choice(1,2)", "train.fail_at_step=2"]


def _trials(stdout: str):
    return re.findall(r"^trial (\d+) \((.*?)\): (.*)$", stdout, re.M)


def test_optuna_study_completes_through_a_failed_trial(tmp_path):
    root = tmp_path / "runs"
    res = launch(["-m", *STUDY, *TINY], root, timeout=560)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]  # the study completed
    trials = _trials(res.stdout)
    assert [int(t[0]) for t in trials] == list(range(5)), res.stdout
    failed = [t for t in trials if t[2].startswith("failed:")]
    assert len(failed) == 1 and "train.fail_attempt=1" in failed[0][1], trials
    assert "injected failure at step 2" in failed[0][2]

    runs = runs_json(root)
    assert len(runs) == 5
    assert sorted(r["status"] for r in runs) == ["completed"] * 4 + ["failed"]
    by_id = {r["run_id"]: r for r in runs}
    values = {}
    for num, _, what in trials:
        m = re.match(r"final_loss = (\S+)  \(run (\S+)\)", what)
        if m:
            run = by_id[m.group(2)]
            assert float(m.group(1)) == pytest.approx(run["final_loss"], rel=1e-5)
            values[int(num)] = run["final_loss"]
    assert len(values) == 4

    # the study is ONE sweep: every batch joins the first one's dir, each run numbered by its trial
    sweeps = {r["sweep_id"] for r in runs}
    assert len(sweeps) == 1, sweeps
    sweep = sweeps.pop()
    assert sorted(int(r["run_id"].rsplit("-", 1)[1]) for r in runs) == list(range(5))
    metas = [json.loads((Path(r["dir"]) / "run.json").read_text())["study"] for r in runs]
    assert all(m["objective"] == "final_loss" and "Optuna" in m["sweeper"] for m in metas)
    sweep_json = json.loads((root / sweep / "sweep.json").read_text())
    assert sweep_json["num_runs"] == 5 and len(sweep_json["job_ids"]) == 3  # one submission per batch
    for num, _, what in trials:  # trial n is run <sweep>-n
        if what.startswith("final_loss"):
            assert what.endswith(f"(run {sweep}-{num})"), what
    assert "study: 3 batch(es) in sweep " + sweep in res.stdout

    # the study's results: printed, and saved in its sweep dir
    results = root / sweep / "optimization_results.yaml"
    assert f"results in {root.resolve() / sweep}" in res.stdout
    best = yaml.safe_load(results.read_text())
    assert best["name"] == "optuna"
    assert best["best_value"] == pytest.approx(min(values.values()), rel=1e-6)
    assert set(best["best_params"]) == {"optim.lr", "train.fail_attempt"}

    # status and results read the whole study
    st = run_cmd([str(BIN / "launcher"), "status", sweep, "--json", "--root", str(root)], root)
    assert st.returncode == 0, st.stderr
    assert json.loads(st.stdout)["counts"] == {"completed": 4, "failed": 1}
    rs = run_cmd([str(BIN / "launcher"), "results", sweep, "--json", "--root", str(root)], root)
    rows = json.loads(rs.stdout)["rows"]
    assert len(rows) == 5 and rows[0]["objective"] == pytest.approx(best["best_value"], rel=1e-6)
    assert "best_value:" in res.stdout
    # Hydra's multirun.yaml (every override, secrets too) is nowhere under runs_root
    assert not list(root.rglob("multirun.yaml"))


def test_basic_sweeper_waits_and_returns_the_objective(tmp_path):
    """submit.wait=true with Hydra's BasicSweeper: every point runs, each trial line shows
    submit.objective (any summary key), and one failed point makes the sweep exit 1 (BasicSweeper
    raises the first failed JobReturn, as with Hydra's own launchers), naming the run."""
    root = tmp_path / "runs"
    res = launch(["-m", "submit.wait=true", "submit.objective=mean_tokens_per_s", "train.fail_at_step=2",
                  "train.fail_attempt=1,2", *TINY], root, timeout=560)
    assert res.returncode == 1, res.stdout[-4000:] + res.stderr[-4000:]
    trials = dict((int(n), what) for n, _, what in _trials(res.stdout))
    assert set(trials) == {0, 1}, res.stdout
    assert trials[0].startswith("failed: run ") and "injected failure" in trials[0]
    m = re.match(r"mean_tokens_per_s = (\S+)  \(run (\S+)\)", trials[1])
    assert m, trials[1]
    runs = {r["run_id"]: r for r in runs_json(root)}
    assert runs[m.group(2)]["status"] == "completed"
    summary = json.loads((Path(runs[m.group(2)]["dir"]) / "status.json").read_text())["summary"]
    assert float(m.group(1)) == pytest.approx(summary["mean_tokens_per_s"], rel=1e-5)
    assert "injected failure at step 2" in res.stderr and "Traceback" not in res.stderr


@pytest.mark.slurm
def test_optuna_on_slurm_over_a_numeric_group(slurm, tmp_path):
    """An Optuna study on the local Slurm cluster: each batch is one array, the study waits for it,
    and Optuna's categorical over the numeric group `zero` composes (zero=1: DeepSpeed ZeRO-1)."""
    root = tmp_path / "runs"
    res = launch(["-m", "hydra/sweeper=optuna", "hydra.sweeper.n_trials=3", "hydra.sweeper.n_jobs=2",
                  "hydra.sweeper.sampler.seed=6", "optim.lr=interval(0.001,0.01)", "zero=choice(0,1)",
                  "cluster=local_slurm", "cluster.nodes=1", "cluster.gpus_per_node=1", "train.steps=4",
                  "train.log_interval=0"], root, timeout=560)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    trials = _trials(res.stdout)
    assert len(trials) == 3 and all(t[2].startswith("final_loss = ") for t in trials), res.stdout
    assert re.search(r"^sweep \S+: 2 run\(s\) submitted \(slurm\), array job \d+$", res.stdout, re.M)
    runs = runs_json(root)
    assert len(runs) == 3 and all(r["status"] == "completed" for r in runs)
    stages = {t[1].split("zero=")[1].split()[0] for t in trials}
    for r in runs:
        cfg = yaml.safe_load((Path(r["dir"]) / "config.yaml").read_text())
        assert str(cfg["zero"]["stage"]) in stages
        assert cfg["parallelism"]["engine"] == ("deepspeed" if cfg["zero"]["stage"] else "ddp")
    assert yaml.safe_load(next(root.glob("*/optimization_results.yaml")).read_text())["name"] == "optuna"
