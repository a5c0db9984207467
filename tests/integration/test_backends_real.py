"""The Slurm backend against sbatch and the controller themselves: its sbatch text with hostile values as sbatch
parses it, and the state of a job requeued held then cancelled (the pure parts: tests/unit/test_backends.py)."""
import os
import shlex
import subprocess
import time

import pytest

from launcher.run.status import Status
from unit.test_backends import SLURM, _cfg  # noqa: F401 (fixtures and helpers shared with the pure tests)


def test_hostile_values_stay_text(tmp_path):
    evil = "a;touch pwned$(touch pwned2)`touch pwned3`"
    cfg = _cfg(f"submit.job_name='{evil}'", f"+cluster.env.EVIL='{evil}'")
    text = SLURM.script_text(cfg, tmp_path, 1)
    assert f"#SBATCH --job-name={shlex.quote(evil)}" in text
    assert f"export EVIL={shlex.quote(evil)}" in text
    # run the setup lines through a real shell: the value arrives verbatim and nothing executes
    setup = [line for line in text.splitlines() if line.startswith("export ")]
    out = subprocess.run(["bash", "-c", "\n".join(setup) + '\nprintf %s "$EVIL"'], capture_output=True,
                         text=True, cwd=tmp_path)
    assert out.stdout == evil
    assert not list(tmp_path.glob("pwned*"))


@pytest.mark.slurm
@pytest.mark.timeout(120)
def test_a_job_requeued_held_then_cancelled_has_ended(slurm, tmp_path):
    # an ASHA point pruned while its pause (scontrol requeuehold) is still completing: accounting keeps
    # REQUEUED for it; the controller says CANCELLED, and the backend must say ended (else it is never sealed)
    from launcher.backends.slurm import SlurmBackend

    script = tmp_path / "job.sh"
    # a job that ends only when it is ended (its 2-minute limit bounds it, should the test die first)
    script.write_text("#!/bin/bash\ntrap '' TERM\nsleep infinity\n")
    env = dict(os.environ, **slurm)
    jid = subprocess.run(["sbatch", "--parsable", "-p", "debug", "-t", "2", "-o", "/dev/null", str(script)], env=env,
                         capture_output=True, text=True, check=True, timeout=60).stdout.strip().split(";")[0]
    backend = SlurmBackend()
    deadline = time.time() + 60
    while backend.job_state_now(jid) != "RUNNING":
        assert time.time() < deadline, "the job never started"
        time.sleep(0.5)
    backend.pause(jid)
    backend.drop_paused(jid)
    deadline = time.time() + 60
    while not (state := backend.states([{"job_id": jid}]).get(jid)) or not state.ended:
        assert time.time() < deadline, f"job {jid} never reported ended: {state}"
        time.sleep(1.0)
    assert state.status is Status.cancelled, state


@pytest.mark.slurm
@pytest.mark.timeout(180)
def test_a_held_array_cancelled_from_outside_settles_every_point_cancelled(slurm, runs_root):
    """An array none of whose tasks started is one compressed record for sacct and squeue (A_[0-2]): an
    scancel from outside (an admin's, a dependency never met) must still settle and seal each point."""
    import json

    from helpers import BIN, launch, run_cmd

    env = dict(os.environ, **slurm)
    res = launch(["-m", "cluster=local_slurm", "cluster.nodes=1", "model=gpt_tiny", "train.steps=2",
                  "+cluster.sbatch_extra.hold=true", "seed=1,2,3"], runs_root, extra_env=slurm)
    assert res.returncode == 0, res.stdout + res.stderr
    runs = json.loads(run_cmd([str(BIN / "launcher"), "runs", "--json", "--root", str(runs_root)], runs_root,
                              timeout=120, extra_env=slurm).stdout)
    (array,) = {r["job_id"].partition("_")[0] for r in runs}
    assert len(runs) == 3 and all(r["status"] == "pending" for r in runs), runs
    subprocess.run(["scancel", array], env=env, check=True, timeout=60)
    status = run_cmd([str(BIN / "launcher"), "status", runs[0]["sweep_id"], "--json", "--root", str(runs_root)],
                     runs_root, timeout=120, extra_env=slurm)
    assert status.returncode == 0, status.stdout + status.stderr
    assert json.loads(status.stdout)["counts"] == {"cancelled": 3}, status.stdout
    from launcher.run.rundir import RunDir

    assert all(RunDir(r["dir"]).verify() == [] for r in runs)  # sealed, every file as recorded


@pytest.mark.slurm
@pytest.mark.timeout(240)
def test_cancelling_a_held_sweep_is_one_scancel_and_every_point_sealed(slurm, runs_root, monkeypatch):
    """`launcher cancel SWEEP` (progress.cancel_runs): every outcome recorded, ONE scancel for all the
    sweep's jobs, one state query a second until they ended, then every run sealed."""
    import json

    from helpers import BIN, launch, run_cmd
    from launcher.backends.slurm import jobs as slurm_jobs
    from launcher.run.rundir import RunDir
    from launcher.submit.progress import cancel_runs

    res = launch(["-m", "cluster=local_slurm", "cluster.nodes=1", "model=gpt_tiny", "train.steps=2",
                  "+cluster.sbatch_extra.hold=true", "seed=range(1,21)"], runs_root, extra_env=slurm)
    assert res.returncode == 0, res.stdout + res.stderr
    runs = json.loads(run_cmd([str(BIN / "launcher"), "runs", "--json", "--root", str(runs_root)], runs_root,
                              timeout=120, extra_env=slurm).stdout)
    assert len(runs) == 20 and all(r["status"] == "pending" for r in runs), runs
    for k, v in slurm.items():
        monkeypatch.setenv(k, v)
    scancels = []
    real_run = slurm_jobs.subprocess.run

    def counted(argv, *a, **kw):
        if argv and argv[0] == "scancel":
            scancels.append(list(argv))
        return real_run(argv, *a, **kw)

    monkeypatch.setattr(slurm_jobs.subprocess, "run", counted)
    assert cancel_runs([RunDir(r["dir"]) for r in runs], "cancelled by user") == 20
    assert len(scancels) == 1 and len(scancels[0]) == 21, scancels  # scancel and the 20 task ids
    for r in runs:
        rd = RunDir(r["dir"])
        assert rd.status().state == "cancelled" and rd.verify() == [], r["dir"]
    (array,) = {r["job_id"].partition("_")[0] for r in runs}
    out = subprocess.run(["squeue", "-h", "-o", "%i", "-j", array], env=dict(os.environ, **slurm), capture_output=True,
                         text=True, timeout=60).stdout  # this sweep's jobs only: other drills share the cluster
    assert not out.strip(), out


@pytest.mark.slurm
@pytest.mark.timeout(180)
def test_cancel_leaves_a_job_that_is_not_the_runs_own(slurm, runs_root):
    """A job id recorded in job.json may since name another job (ids are reused): cancel checks the job is
    this run's (this user's, its batch script in the run's submitit folder) and says so when it is not."""
    import json

    from helpers import BIN, launch, run_cmd
    from launcher.run.rundir import RunDir

    env = dict(os.environ, **slurm)
    res = launch(["cluster=local_slurm", "cluster.nodes=1", "model=gpt_tiny", "train.steps=2",
                  "+cluster.sbatch_extra.hold=true"], runs_root, extra_env=slurm)
    assert res.returncode == 0, res.stdout + res.stderr
    (run,) = json.loads(run_cmd([str(BIN / "launcher"), "runs", "--json", "--root", str(runs_root)], runs_root,
                                timeout=120, extra_env=slurm).stdout)
    script = runs_root.parent / "other.sh"
    script.write_text("#!/bin/bash\nsleep 1\n")
    other = subprocess.run(["sbatch", "--parsable", "--hold", "-p", "debug", "-t", "2", "-o", "/dev/null", str(script)],
                           env=env, capture_output=True, text=True, check=True, timeout=60).stdout.strip().split(";")[0]
    own = ""
    try:
        job_file = RunDir(run["dir"]).path / "job.json"
        job = json.loads(job_file.read_text())
        own, job["job_id"] = job["job_id"], other  # the record now names a job that is not the run's
        job_file.write_text(json.dumps(job))
        res = run_cmd([str(BIN / "launcher"), "cancel", run["run_id"], "--root", str(runs_root)], runs_root,
                      timeout=180, extra_env=slurm)
        assert res.returncode == 0, res.stdout + res.stderr
        assert f"job {other} is not this run's" in res.stderr and "not cancelled" in res.stderr, res.stderr
        queued = subprocess.run(["squeue", "-h", "-o", "%i|%T", "-j", other], env=env, capture_output=True, text=True,
                                timeout=60).stdout
        assert queued.strip() == f"{other}|PENDING", queued
    finally:
        subprocess.run(["scancel", *[j for j in (other, own) if j]], env=env, timeout=60)


def test_a_failing_sacct_is_named_not_silent(tmp_path, monkeypatch, capsys):
    """sacct failing (slurmdbd down, a broken config: here a config that does not exist) leaves the states
    unknown, and says so once, naming the command and its error, instead of a table that silently shows
    what was last recorded."""
    from launcher.backends.slurm import SlurmBackend, limits

    conf = tmp_path / "slurm.conf"  # a cluster whose controller and slurmdbd listen nowhere (port 1)
    conf.write_text("ClusterName=nowhere\nSlurmctldHost=localhost\nSlurmctldPort=1\nMessageTimeout=1\n"
                    "SlurmctldTimeout=1\nAccountingStorageType=accounting_storage/slurmdbd\n"
                    "AccountingStorageHost=localhost\nAccountingStoragePort=1\nNodeName=n1 CPUs=1\n"
                    "PartitionName=p Nodes=n1\n")
    monkeypatch.setenv("SLURM_CONF", str(conf))
    monkeypatch.setattr(limits, "_said_failed", set())
    assert SlurmBackend().states([{"job_id": "12345"}]) == {}
    err = capsys.readouterr().err
    assert "launcher: warning: sacct failed (" in err and "job states shown as last recorded" in err, err
    assert err.count("sacct failed") == 1
