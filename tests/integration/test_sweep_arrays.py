"""Sweeps on the real local Slurm cluster: arrays split under a configured MaxArraySize and every point
runs; points that differ only in name (or model) are ONE array; `launcher retry SWEEP --failed` reruns
exactly the failed points as one array of new attempts; `status` and `results` show the right rows."""
import json
import struct
from pathlib import Path

import pytest
import yaml

from helpers import BIN, launch, run_cmd, runs_json, wait_final
from launcher.run.rundir import RunDir

pytestmark = [pytest.mark.slurm]

TINY = ["cluster=local_slurm", "cluster.nodes=1", "cluster.gpus_per_node=1", "model=gpt_tiny", "train.steps=3",
        "train.log_interval=0"]


def launcher(args, runs_root, slurm, timeout=300):
    return run_cmd([str(BIN / "launcher"), *args, "--root", str(runs_root)], runs_root, timeout=timeout,
                   extra_env=slurm)


def sweep_json(run: dict) -> dict:
    return json.loads((Path(run["dir"]).parent / "sweep.json").read_text())


@pytest.mark.timeout(420)
def test_a_sweep_larger_than_max_array_size_splits_and_every_point_runs(slurm, runs_root):
    res = launch(["-m", *TINY, "cluster.max_array_size=2", "seed=1,2,3,4,5"], runs_root, extra_env=slurm)
    assert res.returncode == 0, res.stdout + res.stderr
    runs = wait_final(runs_root, 5, timeout=360)
    assert [r["status"] for r in runs] == ["completed"] * 5, runs
    arrays = {r["job_id"].partition("_")[0] for r in runs}
    assert len(arrays) == 3, [r["job_id"] for r in runs]
    assert sorted(sweep_json(runs[0])["job_ids"]) == sorted(arrays)
    by_index = sorted(runs, key=lambda r: r["index"])
    ids = [r["job_id"] for r in by_index]
    a, b, c = (ids[0].split("_")[0], ids[2].split("_")[0], ids[4])
    assert ids == [f"{a}_0", f"{a}_1", f"{b}_0", f"{b}_1", c]  # each run its own <array>_<task> (a lone one: a job)
    for r in by_index:
        job = json.loads((Path(r["dir"]) / "job.json").read_text())
        assert job["job_id"] == r["job_id"]
        script = (Path(r["dir"]) / "sbatch.sh").read_text()
        assert "#SBATCH --job-name=gpt_tiny" in script
        assert ("#SBATCH --array=0-1%" in script) == (r["index"] < 4)
    assert sorted(yaml.safe_load((Path(r["dir"]) / "config.yaml").read_text())["seed"] for r in runs) == [1, 2, 3, 4, 5]

    # without waves, a sweep larger than MaxSubmitJobs allows is refused before anything is submitted
    before = len(runs_json(runs_root))
    res = launch(["-m", *TINY, "cluster.max_submit_jobs=2", "seed=1,2,3",
                  "submit.waves=false"],  # the setting under test: waves are drilled in test_waves.py
                 runs_root, extra_env=slurm)
    assert res.returncode != 0 and "MaxSubmitJobs" in res.stderr + res.stdout, res.stdout + res.stderr
    assert len(runs_json(runs_root)) == before


@pytest.mark.timeout(600)
def test_names_share_one_array_and_retry_reruns_exactly_the_failed_points(slurm, runs_root, tmp_path):
    # two models differ only in name and hyper-parameters: one array (dry run: nothing to train)
    res = launch(["-m", *TINY, "submit.dry_run=true", "model=gpt_tiny,gpt_125m"], runs_root, extra_env=slurm)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.count("# ---- sbatch script for points") == 1 and "--array=0-1%2" in res.stdout

    # 4 points, two names (job name: the sweep's), the fail_at_step=2 ones fail without restarts
    res = launch(["-m", *TINY, "train.max_restarts=0", "name=alpha,beta", "train.fail_at_step=null,2"],
                 runs_root, extra_env=slurm)
    assert res.returncode == 0, res.stdout + res.stderr
    runs = wait_final(runs_root, 4, timeout=300)
    sweep = runs[0]["sweep_id"]
    (array,) = {r["job_id"].partition("_")[0] for r in runs}
    assert f"#SBATCH --job-name=sweep-{sweep}" in (Path(runs[0]["dir"]) / "sbatch.sh").read_text()
    failing = {r["run_id"] for r in runs if r["config"]["train"]["fail_at_step"] == 2}
    assert {r["run_id"] for r in runs if r["status"] == "failed"} == failing and len(failing) == 2, runs

    st = json.loads(launcher(["status", sweep, "--json"], runs_root, slurm).stdout)
    assert st["counts"] == {"completed": 2, "failed": 2}
    assert st["swept"] == ["name", "train.fail_at_step"]

    res = launcher(["retry", sweep, "--failed", "train.fail_at_step=null"], runs_root, slurm)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "2 run(s) retried" in res.stdout
    runs = wait_final(runs_root, 4, timeout=300)
    by_id = {r["run_id"]: r for r in runs}
    retried = {r["run_id"] for r in runs if r["job_id"].partition("_")[0] != array}
    assert retried == failing
    (new_array,) = {by_id[i]["job_id"].partition("_")[0] for i in failing}  # ONE new array for both
    for rid, r in by_id.items():
        rdir = Path(r["dir"])
        restarts = [json.loads(line) for line in (rdir / "restarts.jsonl").read_text().splitlines()] \
            if (rdir / "restarts.jsonl").exists() else []
        if rid not in failing:
            assert restarts == [] and r["status"] == "completed"
            continue
        (row,) = restarts
        assert row["reason"] == "retry" and row["attempt"] == 2 and row["changes"] == {"train.fail_at_step": None}
        assert "train.fail_at_step 2 -> None" in row["detail"]
        assert (rdir / "attempts" / "1" / "manifest.json").exists()  # the first attempt's seal, kept
        job = json.loads((rdir / "job.json").read_text())
        assert job["array_job_id"] == new_array and array in job["earlier_job_ids"][0]
        assert r["status"] == "completed", r
        assert yaml.safe_load((rdir / "config.yaml").read_text())["train"]["fail_at_step"] is None

    st = json.loads(launcher(["status", sweep, "--json"], runs_root, slurm).stdout)
    assert st["counts"] == {"completed": 4}
    assert {r["run_id"]: (r["attempt"], r["restarts"], r["step"]) for r in st["runs"]} == {
        rid: ((2, 1, 3) if rid in failing else (1, 0, 3)) for rid in by_id}

    res = launcher(["results", sweep, "--csv"], runs_root, slurm)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0] == "rank,run_id,name,train.fail_at_step,status,final_loss,tokens_per_s,steps,objective"
    assert len(lines) == 5 and all(",completed," in line for line in lines[1:])
    losses = [float(line.split(",")[-1]) for line in lines[1:]]
    assert losses == sorted(losses)  # best (lowest final loss) first

    png = tmp_path / "sweep.png"
    res = launcher(["results", sweep, "--plot", str(png)], runs_root, slurm)
    assert res.returncode == 0, res.stderr
    head = png.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", head[16:24])[0] > 500

    # nothing left to retry
    res = launcher(["retry", sweep, "--failed"], runs_root, slurm)
    assert res.returncode == 0 and "no failed" in res.stdout


@pytest.mark.timeout(420)
def test_batches_of_one_multirun_are_one_sweep(slurm, runs_root):
    """Hydra's BasicSweeper in batches (hydra.sweeper.max_batch_size): every batch joins the sweep the
    first one made, run index = Hydra's job number, one array per batch, one code snapshot."""
    res = launch(["-m", *TINY, "hydra.sweeper.max_batch_size=2", "seed=1,2,3"], runs_root, extra_env=slurm)
    assert res.returncode == 0, res.stdout + res.stderr
    runs = wait_final(runs_root, 3, timeout=360)
    assert [r["status"] for r in runs] == ["completed"] * 3, runs
    assert len({r["sweep_id"] for r in runs}) == 1, runs
    by_index = sorted(runs, key=lambda r: r["index"])
    assert [r["index"] for r in by_index] == [0, 1, 2]
    assert [yaml.safe_load((Path(r["dir"]) / "config.yaml").read_text())["seed"] for r in by_index] == [1, 2, 3]
    sweep = sweep_json(runs[0])
    assert sweep["num_runs"] == 3 and len(sweep["job_ids"]) == 2  # batches of 2, 1
    assert len({RunDir(r["dir"]).snapshot()["path"] for r in runs}) == 1  # one code snapshot, taken once
    st = launcher(["status", runs[0]["sweep_id"], "--json"], runs_root, slurm)
    assert json.loads(st.stdout)["counts"] == {"completed": 3}


@pytest.mark.timeout(300)
def test_a_refused_sbatch_is_recorded_not_submitted(slurm, runs_root):
    """docs/sweeps.md: an array sbatch refuses (a partition the cluster does not have: the config rules
    cannot know it) leaves its points failed ("submission failed"), the later arrays' points failed
    "not submitted" without trying them, and the launch exits 1."""
    res = launch(["-m", "cluster=local_slurm", "cluster.nodes=1", "cluster.partition=nonexistent",
                  "cluster.max_array_size=2", "train.steps=2", "seed=0,1,2,3"],
                 runs_root, extra_env=slurm, timeout=240)
    assert res.returncode == 1, res.stdout[-2000:] + res.stderr[-2000:]
    assert "invalid partition" in res.stderr.lower(), res.stderr[-2000:]
    runs = runs_json(runs_root)
    assert [r["status"] for r in runs] == ["failed"] * 4, runs
    first, later = runs[:2], runs[2:]
    assert all(r["error"].startswith("submission failed: sbatch: error: invalid partition") for r in first), first
    assert all(r["error"].startswith("not submitted: an earlier array of the sweep was refused") for r in later), later
    assert not any(r.get("job_id") for r in runs), runs  # no job exists for any of them


@pytest.mark.timeout(240)
def test_a_launch_is_queued_whole_or_not_at_all(slurm, runs_root):
    """The scheduler refuses the 2nd array after the 1st was queued (its partition does not exist:
    one array per partition): the 1st is cancelled in the real queue and its runs recorded cancelled;
    the refusal is one line, not a traceback, and the launch exits 1. Jobs are held (nothing runs)."""
    import os
    import subprocess

    res = launch(["-m", "cluster=local_slurm", "cluster.nodes=1", "cluster.partition=debug,nonexistent",
                  "+cluster.sbatch_extra.begin=now+10hours", "train.steps=2", "seed=0,1"],
                 runs_root, extra_env=slurm, timeout=200)
    assert res.returncode == 1, res.stdout[-2000:] + res.stderr[-2000:]
    assert "Traceback" not in res.stderr and "were cancelled" in res.stderr, res.stderr[-2000:]
    runs = sorted(runs_json(runs_root), key=lambda r: r["index"])  # partition x seed: 2 arrays of 2
    assert len(runs) == 4, runs
    queued, refused = runs[:2], runs[2:]
    assert all(r["status"] == "cancelled" and "a sweep is queued whole or not at all" in r["error"]
               for r in queued), queued
    assert all(r["status"] == "failed" and "invalid partition" in r["error"].lower() for r in refused), refused
    (job,) = {r["job_id"].split("_")[0] for r in queued}
    out = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, **slurm)).stdout.split()
    assert not any(s in ("PENDING", "RUNNING") for s in out), out  # cancelled in the queue, not only on disk


@pytest.mark.timeout(600)
def test_retried_and_resumed_runs_archive_their_new_script_and_scrub_submitits_folder(slurm, runs_root):
    """A retry and a resume go out as a launch does (launcher.submit.submission): each run holds the
    script its NEW job was submitted with (a lone job now: no --array line, unlike the first
    attempt's array of two), and a secret in a changed setup line is scrubbed everywhere, submitit's
    folder included."""
    import secrets

    secret = "v-" + secrets.token_hex(12)  # made at test time (a literal would sit in the code snapshot)
    env = dict(slurm, MY_SERVICE_SECRET=secret)
    # no restart: the failed point is the outcome
    res = launch(["-m", *TINY, "train.max_restarts=0", "train.fail_at_step=null,2"], runs_root, extra_env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    runs = wait_final(runs_root, 2, timeout=300)
    (failed,) = [r for r in runs if r["status"] == "failed"]
    (done,) = [r for r in runs if r["status"] == "completed"]
    assert all("#SBATCH --array=0-1%" in (Path(r["dir"]) / "sbatch.sh").read_text() for r in runs)

    res = launcher(["retry", failed["sweep_id"], "--failed", "train.fail_at_step=null",
                    f"cluster.setup=['export X={secret}']"], runs_root, env)
    assert res.returncode == 0, res.stdout + res.stderr
    res = launcher(["resume", done["run_id"], "--steps", "4"], runs_root, env)
    assert res.returncode == 0, res.stdout + res.stderr
    runs = wait_final(runs_root, 2, timeout=300)
    assert [r["status"] for r in runs] == ["completed"] * 2, runs

    folder = Path(runs[0]["dir"]).parent / ".submitit"
    for r in runs:
        rdir = Path(r["dir"])
        job = json.loads((rdir / "job.json").read_text())
        assert job["earlier_job_ids"] and "_" not in job["job_id"]  # the new attempt's job, a lone one
        script = (rdir / "sbatch.sh").read_text()
        assert "--array" not in script
        assert script == (folder / f"{job['job_id']}_submission.sh").read_text()  # as submitted (scrubbed)
    retried = (Path(failed["dir"]) / "sbatch.sh").read_text()
    assert "export X=<redacted>" in retried
    leaks = [str(p) for p in runs_root.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]
    assert not leaks, leaks


@pytest.mark.timeout(120)
def test_the_users_submit_limits_are_read_from_the_real_sacctmgr(slurm, tmp_path, monkeypatch):
    """Read only: the local cluster's slurmdbd has no MaxSubmitJobs / MaxSubmitJobsPerUser set for the
    user's default association, so a sweep goes on, held only to MaxJobCount. AccountingStorageEnforce
    lists ``limits`` there (as most sites do), so the launch's own path asks sacctmgr."""
    import getpass

    from launcher.backends import slurm as backend
    from launcher.sweeps import MAX_JOB_COUNT, plan_arrays

    for k, v in slurm.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    got = backend.accounting_limits(getpass.getuser())
    assert got is not None, "sacctmgr show user ... withassoc listed no association"
    assocs, qos = got
    assert backend.association_of(assocs, None, None) is not None, assocs
    assert "normal" in qos, qos
    assert backend.submit_bounds(assocs, qos, []) == []  # nothing set: nothing refused
    assert list(tmp_path.glob("launcher/slurm-accounting-*.json"))  # cached for the next launch
    monkeypatch.setattr(backend, "enforces_limits", lambda text: True)
    lim = backend.SlurmBackend().array_limits(None)
    assert lim.bound == MAX_JOB_COUNT and lim.max_array_size == 1001, lim
    assert len(plan_arrays([3], lim, [1])) == 1
