"""The sbatch text submitit will submit: resources, array, and quoting of every value."""
import shlex
import subprocess

from hydra import compose, initialize_config_dir

from launcher.app import CONF_DIR, normalize_overrides
from launcher.submit import executors


def _cfg(*overrides):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=normalize_overrides(["cluster=local_slurm", *overrides]))


def test_one_task_per_gpu_and_array(tmp_path):
    text = executors.sbatch_text(_cfg("cluster.nodes=2", "cluster.gpus_per_node=4"), tmp_path, 5)
    assert "#SBATCH --nodes=2" in text
    assert "#SBATCH --ntasks-per-node=4" in text
    assert "#SBATCH --array=0-4%5" in text
    assert "#SBATCH --partition=debug" in text
    assert "--kill-on-bad-exit=1" in text


def test_single_point_is_not_an_array(tmp_path):
    assert "--array" not in executors.sbatch_text(_cfg(), tmp_path, 1)


def test_gpus_requested_only_when_cluster_has_them(tmp_path):
    assert "--gpus-per-node" not in executors.sbatch_text(_cfg(), tmp_path, 1)
    text = executors.sbatch_text(_cfg("cluster=a100_80g"), tmp_path, 1)
    assert "#SBATCH --gpus-per-node=8" in text and "#SBATCH --account" not in text


def test_hostile_values_stay_text(tmp_path):
    evil = "a;touch pwned$(touch pwned2)`touch pwned3`"
    cfg = _cfg(f"submit.job_name='{evil}'", f"+cluster.env.EVIL='{evil}'")
    text = executors.sbatch_text(cfg, tmp_path, 1)
    assert f"#SBATCH --job-name={shlex.quote(evil)}" in text
    assert f"export EVIL={shlex.quote(evil)}" in text
    # run the setup lines through a real shell: the value arrives verbatim and nothing executes
    setup = [l for l in text.splitlines() if l.startswith("export ")]
    out = subprocess.run(["bash", "-c", "\n".join(setup) + '\nprintf %s "$EVIL"'], capture_output=True,
                         text=True, cwd=tmp_path)
    assert out.stdout == evil
    assert not list(tmp_path.glob("pwned*"))


def test_points_with_different_resources_are_grouped_apart():
    a, b, c = _cfg("optim.lr=0.1"), _cfg("optim.lr=0.2"), _cfg("cluster.nodes=1")
    assert executors.executor_key(a) == executors.executor_key(b) != executors.executor_key(c)
