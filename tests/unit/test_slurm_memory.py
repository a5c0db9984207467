"""cluster.mem_gb in the batch script: a figure per node, 0 for all of each node's memory (sbatch --mem=0,
the GPU templates' value: pinned staging copies live in host memory, and a site's small DefMemPerCPU would
have the cgroup kill rank 0 at its first save), null for the partition's default (no --mem at all)."""
from pathlib import Path

from hydra import compose, initialize_config_dir

from launcher.app import CONF_DIR
from launcher.backends import slurm


def sbatch_mem_lines(*overrides):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["cluster=local_slurm", *overrides])
    text = slurm.SlurmBackend().script_text(cfg, Path("/tmp/launcher-x"), 1)
    return [line for line in text.splitlines() if line.startswith("#SBATCH --mem")]


def test_mem_gb_0_asks_all_of_each_nodes_memory_and_null_asks_nothing():
    assert sbatch_mem_lines("cluster.mem_gb=0") == ["#SBATCH --mem=0"]
    assert sbatch_mem_lines("cluster.mem_gb=64") == ["#SBATCH --mem=64GB"]
    assert sbatch_mem_lines() == []  # local_slurm: null, the partition's default


def test_the_gpu_template_asks_all_of_each_nodes_memory():
    assert sbatch_mem_lines("cluster=h100_80g") == ["#SBATCH --mem=0"]
