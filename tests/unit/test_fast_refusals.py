"""Impossible requests refused before anything is written (issue 27): a world larger than the
cluster (sinfo's node sizes), a job name longer than slurmctld takes, a runs root the file system
cannot hold runs under, a sweep larger than MaxJobCount leaves room for. The case no one listed:
``cluster.mem_gb`` beyond every node's memory (sbatch would queue it pending forever or refuse it).
Pure: sinfo and squeue are faked."""
import io
import time

import pytest
from hydra import compose, initialize_config_dir

from launcher.app import CONF_DIR
from launcher.backends import base, slurm
from launcher.sweeps import MAX_JOB_COUNT, ArrayLimits, TooManyJobs, plan_arrays

# `sinfo -h -N -o "%N|%P|%c|%m|%G"` of the local cluster (4 nodes, 4 CPUs, gres gpu:2)
SINFO = "node1|debug*|4|7900|gpu:2\nnode2|debug*|4|7900|gpu:2\nnode3|debug*|4|7900|gpu:2\nnode4|debug*|4|7900|gpu:2\n"
NODES = slurm.nodes_from_sinfo(SINFO)


def _cfg(*overrides):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=["cluster=local_slurm", *overrides])


def test_sinfo_and_gres_are_read():
    assert [(n.partition, n.cpus, n.mem_mb, n.gpus, n.default) for n in NODES[:1]] == [("debug", 4, 7900, 2, True)]
    assert slurm.gres_gpus("gpu:a100:8(S:0-1)") == 8 and slurm.gres_gpus("gpu:a:4,gpu:b:2") == 6
    assert slurm.gres_gpus("(null)") == 0 and slurm.gres_gpus("craynetwork:4") == 0


def test_a_world_larger_than_the_cluster_names_the_key():
    """The probe's attack: cluster.nodes=10000 cluster.gpus_per_node=10000 on the 4-node cluster."""
    assert slurm.capacity_problems(NODES, "debug", 2, 1, 1, 0, None) == []
    got = slurm.capacity_problems(NODES, None, 10000, 1, 1, 0, None)
    assert got == ["cluster.nodes: asks 10000 nodes; partition debug has 4 that fit one node's share "
                   "(4 nodes in all, sinfo)"]
    got = slurm.capacity_problems(NODES, "debug", 10000, 10000, 1, 0, None)
    assert got == ["cluster.gpus_per_node: 10000 tasks per node x cluster.cpus_per_task=1 ask 10000 CPUs per node; "
                   "the nodes of partition debug have at most 4 (sinfo)",
                   "cluster.nodes: asks 10000 nodes; partition debug has 4 (sinfo)"]
    got = slurm.capacity_problems(NODES, "debug", 1, 10000, 1, 10000, None)
    assert any(g.startswith("cluster.gpus_per_node: asks 10000 GPUs per node; the nodes of partition debug have "
                            "at most 2") for g in got), got


def test_memory_beyond_every_node_names_mem_gb():
    """The case no one listed: sbatch would refuse it at submission ("Requested node configuration is
    not available") after the sweep was archived."""
    got = slurm.capacity_problems(NODES, "debug", 1, 1, 1, 0, 64 * 1024)
    assert got == ["cluster.mem_gb: asks 64 GB per node; the nodes of partition debug have at most 7.7 GB (sinfo)"]
    assert slurm.capacity_problems(NODES, "debug", 1, 1, 1, 0, 4 * 1024) == []


def test_an_unknown_partition_or_no_sinfo_is_left_to_sbatch():
    assert slurm.capacity_problems(NODES, "nonexistent", 10000, 1, 1, 0, None) == []
    assert slurm.capacity_problems([], None, 10000, 1, 1, 0, None) == []


def test_job_names_and_runs_roots_are_bounded():
    got = slurm.SlurmBackend().request_problems(_cfg("submit.job_name=" + "x" * 5000))
    assert any(g.startswith("submit.job_name: is 5000 bytes; the scheduler accepts at most 1024") for g in got), got
    assert not base.request_limits(_cfg("submit.job_name=" + "x" * 1024), job_name_max=1024)
    got = base.request_limits(_cfg("submit.runs_root=/tmp/" + "d" * 300), job_name_max=None)
    assert got and got[0].startswith("submit.runs_root: a path component is 300 bytes"), got
    got = base.request_limits(_cfg("submit.runs_root=/tmp/" + "/".join(["d" * 200] * 20)), job_name_max=None)
    assert got and "4096 is the most a path may be" in got[0], got


def test_the_launch_refuses_them_before_writing_anything(tmp_path, monkeypatch):
    from launcher.submit import pipeline

    monkeypatch.setattr(slurm, "cluster_nodes", lambda: NODES)
    monkeypatch.setattr(slurm.SlurmBackend, "array_limits", lambda self, cfg=None: ArrayLimits())
    monkeypatch.setattr(slurm.SlurmBackend, "runs_root_problem", lambda self, root, cfg=None: None)
    runs = tmp_path / "runs"
    attacks = {"cluster.nodes": ["cluster.nodes=10000", "cluster.gpus_per_node=10000",
                                 "train.global_batch_size=400000000", "train.micro_batch_size=4"],
               "submit.job_name": ["submit.job_name=" + "n" * 5000],
               "cluster.mem_gb": ["cluster.mem_gb=4096"]}
    for key, overrides in attacks.items():
        cfg = _cfg("model=gpt_tiny", "train.steps=2", "optim.warmup_steps=0", "wandb.enabled=false",
                   f"submit.runs_root={runs}", *overrides)
        t0 = time.time()
        with pytest.raises(pipeline.InvalidSweep, match=key.replace(".", r"\.")) as got:
            pipeline.launch([pipeline.Point(cfg, overrides)], argv=["launch"], out=io.StringIO())
        assert time.time() - t0 < 20, key  # not O(world): seeds of 1e8 ranks are never planned
        assert "nothing was submitted" in str(got.value), got.value
        assert not runs.exists() or not any(runs.iterdir()), list(runs.iterdir())


def test_a_sweep_larger_than_max_job_count_is_refused():
    """The probe's 10,000-point sweep on MaxJobCount=10000: accepted before (10000 <= 10000, the
    user's own queue empty), it queued arrays until slurmctld said EAGAIN after minutes of sbatch retries."""
    lim = ArrayLimits(1001, 10000, 0, bound=MAX_JOB_COUNT)
    with pytest.raises(TooManyJobs, match=r"MaxJobCount.*9999 can be submitted now"):
        plan_arrays([10000], lim, [1])
    assert len(plan_arrays([9999], lim, [1])) == 10
    with pytest.raises(TooManyJobs, match="holds 5000 now"):  # every user's jobs count, ended ones too
        plan_arrays([5000], ArrayLimits(1001, 10000, 5000, bound=MAX_JOB_COUNT), [1])


def test_max_job_count_counts_every_users_jobs(monkeypatch):
    calls = []

    def fake(cmd):
        calls.append(cmd)
        if cmd[:2] == ["scontrol", "show"]:
            return "MaxArraySize = 1001\nMaxJobCount = 10000\nMaxSubmitJobs = 20000\nAccountingStorageEnforce = none\n"
        if "-t" in cmd:  # every user's, any state
            return "\n".join(str(i) for i in range(9000))
        return "1\n2\n"  # this user's queue

    monkeypatch.setattr(slurm, "_run", fake)
    lim = slurm.SlurmBackend().array_limits(None)
    assert (lim.max_array_size, lim.max_submit_jobs, lim.queued, lim.bound) == (1001, 10000, 9000, MAX_JOB_COUNT)
    assert lim.room == 999
    assert ["squeue", "-h", "-r", "-t", "all", "-o", "%i"] in calls
