"""Bad input through the real `launch` command: refused before anything is written (not even a
sweep dir), naming the key; warnings pass with submit.force; a clean dry run prints the script. The
pure checks are in tests/unit/test_bad_input.py."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from helpers import REPO, launch
from launcher.app import CONF_DIR

LAUNCH_BAD = [
    (["model=gpt_175b"], "cluster.gpu.memory_gb"),  # cluster=local: this host's memory
    (["parallelism.pp=2", "train.micro_batch_size=8"], "submit.force=true"),  # bubble 33%: a warning stops it
    (["-m", "cluster.gpu.memory_gb=0,0.001"], "1 of 2 point(s) invalid; nothing was submitted"),  # 1 MiB GPUs
    (["cluster.nodes=2"], "set cluster.nodes=1 or use a Slurm cluster"),  # local: ran 2 processes, archived world 4
    (["+train.stepz=5"], "train.stepz"),
    (["optim.lr=nan"], "optim.lr"),
    # Hydra's output dirs mean nothing to launch (runs go to submit.runs_root): refused, not ignored
    (["-m", "seed=1,2", "hydra.sweep.dir=elsewhere"], "hydra.sweep.dir: is not used by launch"),
    (["-m", "seed=1,2", "hydra.job.chdir=true"], "hydra.job.chdir: is not used by launch"),
    (["hydra.run.dir=elsewhere"], "fix: remove it; runs go to submit.runs_root=<dir>"),
    # a runs root that cannot be: under a file, or where no directory can be made (/proc)
    (["submit.runs_root=/proc/version/runs"], "/proc/version is a file, not a directory"),
    (["submit.runs_root=/proc/launcher-runs"], "no directory can be made in /proc"),
    # a million-point grid: refused from the command line in a second, before a point is composed
    (["-m", "seed=range(0,1000)", "optim.lr=range(0,1000)"], "this sweep's grid holds 1,000,000 points"),
]


@pytest.mark.parametrize("overrides,needle", LAUNCH_BAD, ids=[" ".join(o) for o, _ in LAUNCH_BAD])
def test_launch_rejects_and_writes_nothing(overrides, needle, runs_root):
    res = launch(overrides, runs_root, timeout=120)
    assert res.returncode != 0
    assert needle in res.stderr, res.stderr[-2000:]
    assert not runs_root.exists() or not any(runs_root.rglob("run.json"))
    _nothing_written(runs_root)  # not even a sweep dir or a code snapshot


def test_launch_force_turns_warnings_into_stderr(runs_root):
    res = launch(["parallelism.pp=2", "train.micro_batch_size=8", "submit.force=true", "submit.dry_run=true"],
                 runs_root, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "pipeline bubble 33%" in res.stderr and "# dry run: nothing submitted" in res.stdout


SLURM = ["cluster=a100_80g", "train.global_batch_size=32"]  # a valid Slurm config: values reach an sbatch script


EVIL = "x\ntouch pwned #"


NEWLINE_LAUNCHES = [
    ([f"cluster.partition='{EVIL}'"], "cluster.partition"),
    ([f"cluster.account='{EVIL}'"], "cluster.account"),
    ([f"cluster.qos='{EVIL}'"], "cluster.qos"),
    ([f"cluster.constraint='{EVIL}'"], "cluster.constraint"),
    ([f"submit.job_name='{EVIL}'"], "submit.job_name"),
    ([f"name='{EVIL}'"], "name"),
    ([f"model.name='{EVIL}'"], "model.name"),
    ([f"+cluster.sbatch_extra.reservation='{EVIL}'"], "cluster.sbatch_extra.reservation"),
    ([f"cluster.setup=['module load x','{EVIL}']"], "cluster.setup[1]"),
    ([f"+cluster.env.MY_VAR='{EVIL}'"], "cluster.env.MY_VAR"),
    ([f"cluster.env.OMP_NUM_THREADS='{EVIL}'"], "cluster.env.OMP_NUM_THREADS"),
    ([f"submit.runs_root='{EVIL}'"], "submit.runs_root"),
    ([f"cluster.name='{EVIL}'"], "cluster.name"),
    ([f"tags=['{EVIL}']"], "tags[0]"),
]


def _nothing_written(runs_root: Path) -> None:
    assert not runs_root.exists() or not any(runs_root.iterdir())
    assert not list(runs_root.parent.rglob("pwned")) and not (REPO / "pwned").exists()
    assert not [p for p in runs_root.parent.iterdir() if "touch" in p.name]  # a runs_root made of the value


def test_a_clean_dry_run_prints_the_sbatch_script(runs_root):
    """The control: the same launch with clean values reaches the script (so the refusals below are the
    rules' doing)."""
    res = launch([*SLURM, "submit.dry_run=true", "cluster.qos=high", "+cluster.sbatch_extra.reservation=big"],
                 runs_root, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "#SBATCH --qos=high" in res.stdout and "#SBATCH --reservation=big" in res.stdout
    _nothing_written(runs_root)


@pytest.mark.parametrize("overrides,key", NEWLINE_LAUNCHES, ids=[k for _, k in NEWLINE_LAUNCHES])
def test_launch_refuses_control_characters_before_any_script(overrides, key, runs_root):
    res = launch([*SLURM, "submit.dry_run=true", *overrides], runs_root, timeout=120)
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-2000:]
    assert f"- {key}: contains the control character '\\n'" in res.stderr, res.stderr[-2000:]
    assert "#SBATCH" not in res.stdout and "touch pwned" not in res.stdout
    _nothing_written(runs_root)


def test_launch_refuses_control_characters_in_mapping_keys(tmp_path, runs_root):
    """Mapping keys with a newline cannot be typed as overrides, but a cluster file can hold them."""
    conf = tmp_path / "conf"
    shutil.copytree(CONF_DIR, conf)
    (conf / "cluster" / "evil.yaml").write_text(
        (CONF_DIR / "cluster" / "a100_80g.yaml").read_text().replace("name: a100_80g", "name: evil")
        .replace("sbatch_extra: {}", 'sbatch_extra: {"reservation=x\\ntouch pwned #": ""}')
        .replace('  OMP_NUM_THREADS: "8"', '  "X\\ntouch pwned #": "1"'))
    res = launch(["cluster=evil", "train.global_batch_size=32", "submit.dry_run=true"], runs_root, timeout=120,
                 extra_env={"LAUNCHER_CONF_DIR": str(conf)})
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-2000:]
    assert "- cluster.sbatch_extra: has a key that contains the control character" in res.stderr
    assert "- cluster.env: has a key that contains the control character" in res.stderr
    assert "#SBATCH" not in res.stdout
    _nothing_written(runs_root)



@pytest.mark.parametrize("argv", [["show", "X"], ["logs", "X"], ["cancel", "X"], ["status", "X"], ["diff", "X", "X"],
                                  ["resume", "X"], ["doctor", "X"], ["report", "X"]], ids=lambda a: a[0])
def test_an_id_too_long_for_any_file_is_refused_naming_its_argument(argv, runs_root):
    """A 5,000-character id (ENAMETOOLONG at the first lookup) is refused before any file is read, naming
    the argument, with no traceback."""
    from helpers import BIN, run_cmd

    long_id = "x" * 5000
    res = run_cmd([str(BIN / "launcher"), *[long_id if a == "X" else a for a in argv], "--root", str(runs_root)],
                  runs_root, timeout=60)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "5,000 characters" in res.stderr and "name no run, sweep or path" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr


def test_a_long_override_is_checked_in_time_linear_in_its_length(runs_root):
    """A 120 KB tag (as long as one argument may be) is checked, scanned for secrets and dry-run in a few
    seconds: every check is linear in its input (a URL-password search tried from every letter took 27 s)."""
    from helpers import launch as launch_cmd

    res = launch_cmd(["cluster=local", "submit.dry_run=true", f"tags=[{'a' * 120_000}]"], runs_root, timeout=20)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "# dry run: nothing submitted" in res.stdout
