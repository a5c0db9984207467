"""The login-node path never imports torch or deepspeed (each costs seconds per command)."""
import subprocess
import sys

import pytest


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
    ],
)
def test_no_torch_import(argv, tmp_path):
    res = subprocess.run([sys.executable, "-X", "importtime", *argv], capture_output=True, text=True,
                         timeout=120, cwd=tmp_path, env={"LAUNCHER_RUNS": str(tmp_path / "runs"), "PATH": "/usr/bin:/bin"})
    assert res.returncode == 0, res.stderr[-2000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in res.stderr.splitlines() if "|" in line}
    assert "torch" not in imported and "deepspeed" not in imported
    assert "hydra" in imported or "launcher.archive.registry" in imported
