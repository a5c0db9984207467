"""The login-node path never imports torch or deepspeed (each costs seconds per command), and its
commands import numpy only where a dataset is written (launcher data prepare): ~0.2 s a command."""
import os
import subprocess
import sys

import pytest

# the code under test: a checkout on PYTHONPATH (a worktree, a mutation copy), not the venv's install
_CODE = {k: os.environ[k] for k in ("PYTHONPATH",) if k in os.environ}


@pytest.mark.parametrize(
    "argv",
    [
        ["-m", "launcher", "--cfg", "job"],
        ["-m", "launcher", "submit.dry_run=true", "cluster=local_slurm"],
        ["-m", "launcher", "-m", "submit.dry_run=true", "cluster=local_slurm", "optim.lr=1e-3,2e-3"],
        ["-m", "launcher.cli.main", "runs", "--json"],
        ["-m", "launcher.cli.main", "plan", "--json", "model=gpt_1b3", "cluster=a100_80g", "zero=2",
         "train.micro_batch_size=2"],
        ["-m", "launcher.cli.main", "plan", "--search", "--json", "model=gpt_175b", "cluster=a100_80g",
         "cluster.nodes=16", "train.global_batch_size=512"],
        ["-m", "launcher.cli.main", "report", "--help"],  # pages of real dirs: tests/unit/test_report.py
    ],
)
def test_no_torch_import(argv, tmp_path):
    res = subprocess.run([sys.executable, "-X", "importtime", *argv], capture_output=True, text=True,
                         timeout=120, cwd=tmp_path,
                         env={"LAUNCHER_RUNS": str(tmp_path / "runs"), "PATH": "/usr/bin:/bin", **_CODE})
    assert res.returncode == 0, res.stderr[-2000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in res.stderr.splitlines() if "|" in line}
    assert "torch" not in imported and "deepspeed" not in imported
    assert "numpy" not in imported
    assert "hydra" in imported or "launcher.archive.registry" in imported


def _imported(stderr: str) -> set:
    return {line.rsplit("|", 1)[-1].strip() for line in stderr.splitlines() if "|" in line}


@pytest.mark.timeout(300)
def test_real_local_submission_imports_no_torch(tmp_path):
    """The whole launch of a local run: check, stage, submit, wait for the job, report. The job's
    processes import torch; the launching process does not."""
    res = subprocess.run([sys.executable, "-X", "importtime", "-m", "launcher", "train.steps=4",
                          "optim.warmup_steps=0", "cluster.gpus_per_node=1"],
                         capture_output=True, text=True, timeout=280, cwd=tmp_path,
                         env={"LAUNCHER_RUNS": str(tmp_path / "runs"), "PATH": "/usr/bin:/bin", **_CODE})
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert "completed" in res.stdout
    imported = _imported(res.stderr)
    assert "launcher.submit.pipeline" in imported and "submitit" in imported
    assert "torch" not in imported and "deepspeed" not in imported


@pytest.mark.timeout(300)
def test_real_slurm_submission_imports_no_torch(tmp_path, slurm):
    res = subprocess.run([sys.executable, "-X", "importtime", "-m", "launcher", "-m", "cluster=local_slurm",
                          "train.steps=6", "optim.lr=1e-3,2e-3"],
                         capture_output=True, text=True, timeout=280, cwd=tmp_path,
                         env={"LAUNCHER_RUNS": str(tmp_path / "runs"), "PATH": "/usr/bin:/bin", **_CODE, **slurm})
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert "2 run(s) submitted (slurm), array job" in res.stdout
    imported = _imported(res.stderr)
    assert "launcher.submit.pipeline" in imported and "submitit.slurm.slurm" in imported
    assert "torch" not in imported and "deepspeed" not in imported
    job_id = res.stdout.split("array job ")[1].split()[0]
    subprocess.run(["scancel", job_id], env={"PATH": "/usr/bin:/bin", **slurm}, timeout=60)


@pytest.mark.timeout(300)
def test_real_slurm_pack_submission_imports_no_torch(tmp_path, slurm):
    """cluster.pack=true: the pack's runner (launcher.features.pack.runner) is pickled on the login node; torch
    stays for its steps."""
    res = subprocess.run([sys.executable, "-X", "importtime", "-m", "launcher", "-m", "cluster=local_slurm",
                          "cluster.nodes=1", "cluster.pack=true", "cluster.pack_nodes=1", "train.steps=6",
                          "optim.lr=1e-3,2e-3"],
                         capture_output=True, text=True, timeout=280, cwd=tmp_path,
                         env={"LAUNCHER_RUNS": str(tmp_path / "runs"), "PATH": "/usr/bin:/bin", **_CODE, **slurm})
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert "2 run(s) submitted (slurm), pack job" in res.stdout
    imported = _imported(res.stderr)
    assert "launcher.features.pack.runner" in imported and "submitit.slurm.slurm" in imported
    assert "torch" not in imported and "deepspeed" not in imported
    job_id = res.stdout.split("pack job ")[1].split()[0]
    subprocess.run(["scancel", job_id], env={"PATH": "/usr/bin:/bin", **slurm}, timeout=60)
