"""cluster.pack's pure parts: which points start given the pack's free nodes, CPUs, GPUs and memory
(backfill), the allocation's sizes read from Slurm's variables, the planner's estimate per rank, a
packed point's place and port, and the submission's grouping (one pack per group, bad input named)."""

import pytest
from hydra import compose, initialize_config_dir
from test_bad_input import _refused

from launcher.app import CONF_DIR
from launcher.backends import slurm
from launcher.config import schema
from launcher.features.pack.runner import (
    PROCESS_OVERHEAD_BYTES,
    Need,
    NodeFree,
    gpu_slots,
    host_mem,
    never_fits,
    plan_memory,
    plan_starts,
)
from launcher.run.job_record import JobRecord
from launcher.runtime import env as dist_env
from launcher.submit import submission
from launcher.sweeps import Unschedulable

GB = 1 << 30


def nodes(n, cpus=4, gpus=0, mem=None):
    return [NodeFree(f"node{i + 1}", cpus, gpus, mem) for i in range(n)]


def test_one_cpu_points_fill_every_cpu_of_the_pack_and_spread():
    free = nodes(2)
    got = plan_starts([(i, Need()) for i in range(10)], free)
    assert [k for k, _ in got] == list(range(8))  # 2 nodes x 4 CPUs: 8 at once, the rest wait
    placed = [n[0] for _, n in got]
    assert placed.count("node1") == 4 and placed.count("node2") == 4
    assert placed[:2] == ["node1", "node2"]  # the least busy node first: equal points spread
    assert all(n.cpus == 0 for n in free)
    assert plan_starts([(9, Need())], free) == []  # nothing free: nothing starts


def test_a_point_that_does_not_fit_now_lets_a_later_smaller_one_start():
    free = nodes(2)
    free[0].cpus, free[1].cpus = 1, 2  # other points hold the rest
    wide, small = Need(tasks=1, cpus_per_task=3), Need(tasks=1, cpus_per_task=2)
    got = plan_starts([("wide", wide), ("small", small), ("one", Need())], free)
    assert got == [("small", ["node2"]), ("one", ["node1"])]  # backfill past the wide point
    assert not never_fits(wide, nodes(2))  # it runs once a node is free
    assert never_fits(Need(tasks=1, cpus_per_task=5), nodes(2))


def test_multi_node_points_take_distinct_nodes():
    free = nodes(3)
    got = plan_starts([(k, Need(nodes=2, tasks=2)) for k in "abcd"], free)
    assert [k for k, _ in got] == ["a", "b", "c"] and all(len(set(n)) == 2 for _, n in got)
    assert all(n.cpus == 0 for n in free)  # 3 points x 2 nodes x 2 CPUs: the 3 nodes full, d waits
    free = nodes(3, cpus=2)
    free[2].cpus = 1
    assert plan_starts([("a", Need(nodes=2, tasks=2))], free) == [("a", ["node1", "node2"])]
    assert plan_starts([("b", Need(nodes=2, tasks=2))], free) == []  # one node left with room: not two


def test_the_planners_memory_estimate_bounds_points_per_node():
    free = nodes(1, cpus=64, mem=10 * GB)
    got = plan_starts([(i, Need(mem_per_task=3 * GB)) for i in range(8)], free)
    assert len(got) == 3  # 3 x 3 GB fit in 10 GB; CPUs would allow 64
    # unknown memory (no estimate, or no node memory): not counted, the CPUs decide
    assert len(plan_starts([(i, Need()) for i in range(8)], nodes(1, cpus=64, mem=1))) == 8


def test_gpus_are_shared_only_when_the_estimate_fits_a_gpus_memory():
    assert gpu_slots(8, None, None) == 8  # one rank per GPU without an estimate
    assert gpu_slots(8, 80 * GB, 30 * GB) == 16  # two 30 GB ranks per 80 GB GPU
    assert gpu_slots(8, 80 * GB, 100 * GB) == 8  # larger than a GPU: still one (the planner judged it)
    assert gpu_slots(0, 80 * GB, 1) == 0
    free = nodes(2, cpus=64, gpus=gpu_slots(2, 80 * GB, 30 * GB))
    got = plan_starts([(i, Need(tasks=2, gpus=True, mem_per_task=30 * GB)) for i in range(5)], free)
    assert len(got) == 4  # 2 GPUs x 2 slots per node, 2 ranks a point: 2 points per node
    small_host = nodes(1, cpus=64, gpus=8, mem=1 * GB)  # the GPU estimate never counts against host memory
    assert len(plan_starts([(i, Need(gpus=True, mem_per_task=30 * GB)) for i in range(8)], small_host)) == 8


def test_slurm_cpu_counts_and_the_plan_estimate_are_read():
    assert slurm.cpus_per_node("4(x2),2", 3) == [4, 4, 2]
    assert slurm.cpus_per_node("8", 2) == [8, 8] and slurm.cpus_per_node("", 2) == [1, 1]
    held = slurm.SlurmBackend().allocation({"SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": "node[1-3]",
                                            "SLURM_JOB_CPUS_PER_NODE": "4(x2),2", "SLURM_GPUS_ON_NODE": "8",
                                            "SLURM_MEM_PER_NODE": "1024"})
    assert (held.job_id, held.hosts, held.cpus, held.gpus, held.mem_bytes) == (
        "77", ["node1", "node2", "node3"], [4, 4, 2], 8, 1 << 30)
    # a point's step starts without the pack job's own sizes (srun would take them as its defaults)
    env = slurm.SlurmBackend().step_environment({"SLURM_MEM_PER_NODE": "1024", "SLURM_NTASKS": "1",
                                                 "SLURM_JOB_ID": "77"})
    assert env == {"SLURM_JOB_ID": "77"}
    plan = {"layouts": [{"memory_bytes": {"total": 5_476_352}}]}
    assert plan_memory(plan) == 5_476_352 + PROCESS_OVERHEAD_BYTES
    assert plan_memory(None) is None and plan_memory({"layouts": []}) is None


def step_command(python, pkl, need, nodes, out, err, name, shared_gpu=False):
    """The Slurm backend's command for one point's step, as the pack's runner asks it."""
    command = [python, "-u", "-m", "launcher.features.pack.runner", str(pkl)]
    return slurm.SlurmBackend().step_command(command, need, nodes,
                                             out, err, name, host_mem(need), shared_gpu)


def test_a_steps_srun_line_asks_exactly_its_share():
    cmd = step_command("/py", "/f/1_pack3.pkl", Need(nodes=1, tasks=2, cpus_per_task=3, gpus=True,
                                                     mem_per_task=GB), ["node2"], "o", "e", "run-3")
    assert cmd[:2] == ["srun", "--exact"]
    for flag in ("--nodes=1", "--ntasks=2", "--ntasks-per-node=2", "--cpus-per-task=3", "--nodelist=node2",
                 "--gres=gpu:2", "--kill-on-bad-exit=1"):
        assert flag in cmd, flag
    assert cmd[-4:] == ["-u", "-m", "launcher.features.pack.runner", "/f/1_pack3.pkl"] and "--overlap" not in cmd
    assert not any(c.startswith("--mem") for c in cmd)  # a GPU point's estimate is its GPU's, not the host's
    cpu = step_command("/py", "p", Need(tasks=2, mem_per_task=GB), ["node1"], "o", "e", "n")
    assert "--mem=2048M" in cpu and not any(c.startswith("--gres") for c in cpu)
    assert "--overlap" in step_command("/py", "p", Need(gpus=True), ["node1"], "o", "e", "n", shared_gpu=True)


def test_a_packed_points_place_is_its_steps_and_its_port_differs_per_step():
    environ = {"SLURM_JOB_ID": "420", "SLURM_STEP_ID": "3", slurm.PACK_STEP_ENV: "5", "SLURM_PROCID": "1",
               "SLURM_STEP_NUM_TASKS": "2", "SLURM_LOCALID": "0", "SLURM_NODEID": "3", "SLURMD_NODENAME": "node4",
               "SLURM_JOB_NODELIST": "node[1-4]", "SLURM_STEP_NODELIST": "node[2,4]", "SLURM_STEP_NUM_NODES": "2",
               "SLURM_JOB_NUM_NODES": "4"}
    p = slurm.SlurmBackend().place(environ)
    assert (p.job_id, p.raw_job_id, p.world_size, p.num_nodes, p.node_rank, p.hostnames) == (
        "420.3", "420.3", 2, 2, 1, ("node2", "node4"))
    ports = {dist_env.port_for_job(f"420.{s}") for s in range(64)}
    assert len(ports) == 64 and dist_env.port_for_job("420") not in ports
    assert all(p not in dist_env.RESERVED for p in ports)
    without = {k: v for k, v in environ.items() if k != slurm.PACK_STEP_ENV}
    assert slurm.SlurmBackend().place(without).job_id == "420"  # an ordinary job's task: unchanged


def test_a_packed_points_requeue_is_left_to_its_runner(monkeypatch):
    monkeypatch.setenv(slurm.PACK_STEP_ENV, "0")
    slurm.SlurmBackend().request_requeue("420")  # no scontrol: would raise without Slurm
    assert slurm.SlurmBackend().requeued_since_start("420") is False


def test_job_json_keeps_the_pack_index_and_its_own_logs():
    rec = JobRecord(backend="slurm", job_id="420", submitit_folder="/s/.submitit", pack_index=3)
    assert JobRecord.from_json(rec.to_json()) == rec
    assert "pack_index" not in JobRecord(backend="slurm", job_id="1").to_json()
    assert str(slurm.SlurmBackend().log_path(rec, 0)) == "/s/.submitit/420_pack3_0_log.out"
    assert str(slurm.SlurmBackend().log_path(rec, 1, err=True)) == "/s/.submitit/420_pack3_1_log.err"


def _cfg(*overrides):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=["cluster=local_slurm", "cluster.nodes=1", *overrides])


@pytest.fixture
def sinfo(monkeypatch):
    monkeypatch.setattr(slurm.limits, "cluster_nodes", lambda: slurm.nodes_from_sinfo(
        "".join(f"node{i}|debug*|4|7900|gpu:2\n" for i in range(1, 5))))


def test_a_pack_group_is_one_submission_of_its_nodes(sinfo):
    packed = [_cfg("cluster.pack=true", f"seed={i}") for i in range(32)]
    (arr,) = submission.arrays(packed, cfg=lambda c: c)
    assert len(arr.points) == 32 and arr.pack_nodes == 4  # no more than the partition's 4 nodes (sinfo)
    assert schema.pack_nodes(packed[0].cluster, 32) == schema.PACK_NODES_DEFAULT  # the cap without a partition
    (arr,) = submission.arrays(packed[:3], cfg=lambda c: c)
    assert arr.pack_nodes == 3  # never more nodes than the points can use at once
    given = [_cfg("cluster.pack=true", "cluster.pack_nodes=4", f"seed={i}") for i in range(6)]
    (arr,) = submission.arrays(given, cfg=lambda c: c)
    assert arr.pack_nodes == 4


def test_packed_and_plain_points_never_share_a_submission(sinfo):
    a, b = _cfg("cluster.pack=true"), _cfg()
    assert slurm.SlurmBackend().group_key(a) != slurm.SlurmBackend().group_key(b)
    c = _cfg("cluster.pack=true", "cluster.pack_nodes=2")
    assert slurm.SlurmBackend().group_key(a) != slurm.SlurmBackend().group_key(c)


def test_a_point_wider_than_the_pack_is_refused_naming_the_key(sinfo):
    with pytest.raises(Unschedulable, match=r"cluster.pack_nodes: is 1; a point asks cluster.nodes=2"):
        submission.arrays([_cfg("cluster.pack=true", "cluster.pack_nodes=1", "cluster.nodes=2")], cfg=lambda c: c)


def test_a_pack_wider_than_the_partition_is_refused_naming_the_key(sinfo):
    with pytest.raises(Unschedulable, match=r"cluster.pack_nodes: asks 5 whole nodes; the partition has 4"):
        submission.arrays([_cfg("cluster.pack=true", "cluster.pack_nodes=5")], cfg=lambda c: c)


@pytest.mark.usefixtures("cpu_host")  # its premise: local processes on the CPU
def test_cluster_local_refuses_a_pack_naming_the_key():
    text = _refused(["cluster=local", "cluster.pack=true"], "cluster.pack")
    assert "the local backend cannot do this: it needs job steps inside one allocation" in text
    assert "fix: set cluster.pack=false" in text


def test_the_pack_job_asks_whole_nodes_and_runs_one_process(sinfo):
    params = slurm.SlurmBackend().pack_parameters(_cfg("cluster.pack=true"), None, "sweep-x", 4, "/f")
    assert (params["nodes"], params["ntasks_per_node"], params["exclusive"], params["use_srun"]) == (4, 1, True, False)
    assert params["teardown"] == [] and "srun_args" not in params and "array_parallelism" not in params
    assert params["job_name"] == "sweep-x"
    gpu = slurm.SlurmBackend().pack_parameters(_cfg("cluster.pack=true", "cluster.use_gpus=true"), None, None, 2, "/f")
    assert gpu["gpus_per_node"] == 2  # every GPU of the partition's nodes (sinfo)


def test_cancelling_a_packed_point_ends_its_step_alone(monkeypatch):
    listed = {"n": 0}

    def fake_run(cmd):
        assert cmd[:4] == ["squeue", "-h", "-s", "-j"] and cmd[4] == "420"
        listed["n"] += 1
        return "420.3|pack2-S-2\n420.4|pack12-S-12\n420.5|pack1-S-1\n" if listed["n"] == 1 else ""

    cancelled = []
    monkeypatch.setattr(slurm.limits, "run", fake_run)
    monkeypatch.setattr(slurm.jobs.subprocess, "run", lambda cmd, **kw: cancelled.append(cmd))
    slurm.SlurmBackend().cancel(JobRecord(backend="slurm", job_id="420", pack_index=1), wait_s=5)
    assert cancelled == [["scancel", "420.5"]]  # not pack12's step, not the pack
