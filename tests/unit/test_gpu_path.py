"""The GPU path, tested on CPU with the environment a GPU node gives: which device a rank binds to
under both Slurm binding styles, the refusal to fall back to CPU, the GPUs the local executor hands
out, srun's CPU binding and --exclusive in the generated sbatch, the templates against their nodes,
rendezvous ports and the watchdog's read rate."""
import os
from pathlib import Path

import pytest
import yaml

from launcher import backends
from launcher.backends.local import VISIBLE_KEY, gpu_parameters
from launcher.features.preflight.climb import compose_point
from launcher.runtime import env as dist_env
from launcher.runtime.watchdog import fs_poll_interval

CONF = Path(__file__).resolve().parents[2] / "conf" / "cluster"


# ---- device binding ------------------------------------------------------------------------------

@pytest.mark.parametrize("local_rank", range(8))
def test_every_rank_sees_the_nodes_gpus_and_takes_its_local_rank(local_rank):
    # sbatch --gpus-per-node=8 (or the local executor): CUDA_VISIBLE_DEVICES=0,...,7 in every task
    assert dist_env.device_index(local_rank, 8, 8, "0,1,2,3,4,5,6,7") == local_rank


@pytest.mark.parametrize("local_rank", range(8))
def test_one_gpu_per_task_is_device_0_whatever_the_local_rank(local_rank):
    # --gpus-per-task=1 / --gpu-bind=single:1: task k sees only its GPU (CUDA_VISIBLE_DEVICES=k)
    assert dist_env.device_index(local_rank, 8, 1, str(local_rank)) == 0


def test_more_ranks_than_gpus_is_refused_naming_the_key():
    with pytest.raises(dist_env.DeviceError, match="cluster.gpus_per_node=4") as e:
        dist_env.device_index(5, 8, 4, "0,1,2,3")
    assert "Duplicate GPU" in str(e.value)
    # one physical GPU, two ranks, nothing bound per task: they would share it
    with pytest.raises(dist_env.DeviceError, match="share a GPU"):
        dist_env.device_index(1, 2, 1, None)
    with pytest.raises(dist_env.DeviceError, match="no CUDA device"):
        dist_env.device_index(0, 1, 0, None)


def test_a_job_promised_gpus_never_falls_back_to_cpu():
    why = "cluster.use_gpus=true"
    assert dist_env.cuda_problem(False, False, None, None, why) is None  # a CPU cluster: fine
    assert dist_env.cuda_problem(True, True, "12.4", "0", why) is None
    assert "CPU build" in dist_env.cuda_problem(True, False, None, None, why)
    assert "hides every GPU" in dist_env.cuda_problem(True, False, "12.4", "", why)
    assert "driver" in dist_env.cuda_problem(True, False, "12.4", "0,1", why)


# ---- the local executor's GPUs ---------------------------------------------------------------------

def test_the_local_executor_is_asked_for_one_gpu_per_process_on_a_gpu_host():
    assert gpu_parameters(4, host_has_gpus=False, visible_env=None) == {}  # CPU host: nothing asked
    assert gpu_parameters(4, True, None) == {"gpus_per_node": 4}
    # the GPUs this process may use are the ones handed out
    assert gpu_parameters(2, True, "2,3") == {"gpus_per_node": 2, "visible_gpus": [2, 3]}


def test_gpus_named_by_uuid_are_kept_as_written():
    """A MIG slice or a container's GPU named by UUID: submitit's visible_gpus takes integers only;
    renumbered 0..n-1 the ranks would use GPUs they were not given (or, under MIG, cannot use)."""
    mig = "MIG-4f2a6c1e-8b7d-5e3a-9c2f-1d0e6b7a8c9d"
    assert gpu_parameters(1, True, mig) == {"gpus_per_node": 1, VISIBLE_KEY: mig}
    a, b = "GPU-aaaa1111-2222-3333-4444-555566667777", "GPU-bbbb1111-2222-3333-4444-555566667777"
    assert gpu_parameters(2, True, f"{a}, {b},GPU-c") == {"gpus_per_node": 2, VISIBLE_KEY: f"{a},{b}"}


def test_the_local_executor_hands_the_ranks_the_uuids(tmp_path, monkeypatch):
    """The executor built from those parameters starts the job's controller (whose environment the
    ranks inherit) with CUDA_VISIBLE_DEVICES as written; integer ids go through submitit's
    visible_gpus as before."""
    import subprocess

    from launcher.backends.local import _executor_class

    started = []

    class Proc:
        pid = 4242

        def __init__(self, args, env=None, **_):
            started.append(env["CUDA_VISIBLE_DEVICES"])

    monkeypatch.setattr(subprocess, "Popen", Proc)
    monkeypatch.setenv("LAUNCHER_LOCAL_FORK", "0")  # the controller as a new interpreter: the Popen seen here
    mig = "MIG-4f2a6c1e-8b7d-5e3a-9c2f-1d0e6b7a8c9d"
    params = gpu_parameters(1, True, mig)
    ex = _executor_class(params.pop(VISIBLE_KEY))(folder=tmp_path)
    ex.update_parameters(tasks_per_node=1, timeout_min=1, **params)
    job = ex._submit_command("true")
    assert started == [mig] and job.job_id == "4242"
    ex = _executor_class(None)(folder=tmp_path)
    ex.update_parameters(tasks_per_node=2, timeout_min=1, **gpu_parameters(2, True, "2,3"))
    ex._submit_command("true")
    assert started == [mig, "2,3"]


# ---- the sbatch script -----------------------------------------------------------------------------

def _script(overrides):
    cfg = compose_point(overrides).cfg
    return backends.get("slurm").script_text(cfg, Path("/tmp/launcher-test"), 1)


def test_srun_gets_the_cpus_per_task_and_exclusive_is_asked_where_configured():
    text = _script(["cluster=local_slurm", "cluster.cpus_per_task=3"])
    srun = next(line for line in text.splitlines() if line.startswith("srun "))
    assert "--cpus-per-task=3" in srun  # Slurm >= 22.05: srun does not inherit sbatch's
    assert "export SRUN_CPUS_PER_TASK=3" in text  # for any srun the setup lines run
    assert "#SBATCH --exclusive" not in text
    assert "#SBATCH --exclusive" in _script(["cluster=local_slurm", "cluster.exclusive=true"])


@pytest.mark.parametrize("path", sorted(CONF.glob("*.yaml")), ids=lambda p: p.stem)
def test_each_cluster_template_fits_the_nodes_it_describes(path):
    c = yaml.safe_load(path.read_text())
    if c.get("cpus_per_node"):
        assert c["gpus_per_node"] * c["cpus_per_task"] <= c["cpus_per_node"], path.name
    threads = int((c.get("env") or {}).get("OMP_NUM_THREADS", 1))
    assert threads <= int(c.get("cpus_per_task", 1)), f"{path.name}: OMP_NUM_THREADS above the task's CPUs"
    assert "NCCL_ASYNC_ERROR_HANDLING" not in (c.get("env") or {}), "deprecated name: TORCH_NCCL_ASYNC_ERROR_HANDLING"
    if c.get("use_gpus"):
        assert c.get("gpu", {}).get("memory_gb") and c.get("gpu", {}).get("peak_tflops"), path.name


# ---- ports and the watchdog --------------------------------------------------------------------------

def test_no_job_id_maps_to_torchruns_port():
    ports = {dist_env.port_for_job(str(j)) for j in range(0, 60_000)}
    assert not ports & set(dist_env.RESERVED)
    assert all(dist_env.PORT_BASE <= p < dist_env.EPHEMERAL_START for p in ports)
    # consecutive ids (jobs side by side on a node) never share a port
    assert len({dist_env.port_for_job(str(j)) for j in range(5000, 15000)}) == 10000


def test_the_watchdog_reads_the_run_dir_less_often_in_large_jobs():
    assert fs_poll_interval(8) == 1.0
    assert fs_poll_interval(1024) == 8.0
    assert 1024 / fs_poll_interval(1024) <= 128 and 16384 / fs_poll_interval(16384) <= 128


# ---- the runs root the nodes must see -------------------------------------------------------------

MOUNTS = """/dev/sda1 / ext4 rw 0 0
tmpfs /tmp tmpfs rw 0 0
nas:/export/home /home nfs4 rw 0 0
lustre@o2ib:/scratch /scratch lustre rw 0 0
"""


def test_the_filesystem_of_a_path_is_its_longest_mount_point():
    from launcher.backends.slurm import fs_type

    assert fs_type(Path("/home/me/runs"), MOUNTS) == "nfs4"
    assert fs_type(Path("/scratch/x"), MOUNTS) == "lustre"
    assert fs_type(Path("/tmp/runs"), MOUNTS) == "tmpfs"
    assert fs_type(Path("/opt/runs"), MOUNTS) == "ext4"
    assert fs_type(Path("/scratchpad"), MOUNTS) == "ext4"  # a prefix of the name is not a mount point above it


def test_a_runs_root_the_nodes_cannot_mount_is_refused_before_submitting():
    from launcher.backends.slurm import unshared_runs_root

    own = {"login1", "10.0.0.1", "127.0.0.1", "localhost"}
    problem = unshared_runs_root(Path("/tmp/runs"), "tmpfs", {"10.0.1.5", "10.0.1.6"}, own)
    assert "submit.runs_root=/tmp/runs" in problem and "shared filesystem" in problem and "10.0.1.5" in problem
    assert unshared_runs_root(Path("/home/r"), "nfs4", {"10.0.1.5"}, own) is None  # shared: fine
    # every node is this host (scripts/slurm-local.sh): a local filesystem is fine
    assert unshared_runs_root(Path("/tmp/runs"), "tmpfs", {"127.0.0.1"}, own) is None
    assert unshared_runs_root(Path("/tmp/runs"), "ext4", {"login1"}, own) is None
    assert unshared_runs_root(Path("/tmp/runs"), "ext4", set(), own) is None  # unknown nodes: no claim


def test_more_local_processes_than_this_hosts_gpus_is_refused(monkeypatch):
    from omegaconf import OmegaConf

    from launcher import host
    from launcher.backends import local
    from launcher.config.errors import ConfigErrors
    from launcher.config.rules import resolve
    from launcher.config.view import ConfigView

    monkeypatch.delenv(host.HOST_GPUS_ENV)  # the detection itself, not the pure tier's fixed view
    monkeypatch.setattr(host, "has_nvidia_gpus", lambda dev="/dev": True)  # a host with two GPUs given
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert local.BACKEND.host_gpu_count() == 2
    cfg = compose_point(["cluster=local", "cluster.gpus_per_node=4", "train.global_batch_size=16"]).cfg
    resolved = OmegaConf.to_container(cfg, resolve=True)
    with pytest.raises(ConfigErrors) as e:
        resolve(ConfigView(resolved), resolved)
    assert any(err.key == "cluster.gpus_per_node" and "cluster.gpus_per_node=2" in err.fix for err in e.value.errors)
    ok = compose_point(["cluster=local", "cluster.gpus_per_node=2", "train.global_batch_size=16"]).cfg
    resolved = OmegaConf.to_container(ok, resolve=True)
    resolve(ConfigView(resolved), resolved)


@pytest.mark.parametrize("gpus,batch,expected", [(0, None, 2), (1, None, 1), (2, None, 2), (8, None, 4),
                                                 (8, 64, 8), (8, 48, 6), (3, 16, 2)])
def test_the_local_default_takes_the_gpus_this_host_has(gpus, batch, expected, monkeypatch, capsys):
    """cluster=local without cluster.gpus_per_node: one process per GPU, as many as the global batch's
    micro-batches split over (said in one line where that is fewer); 2 processes on a host without GPUs.
    Each default passes the checks."""
    from omegaconf import OmegaConf

    from launcher.backends import local
    from launcher.config.rules import resolve
    from launcher.config.view import ConfigView

    monkeypatch.setenv(local.HOST_GPUS_ENV, str(gpus))
    monkeypatch.setattr("launcher.host._SAID", set())
    cfg = compose_point(["cluster=local", *([f"train.global_batch_size={batch}"] if batch else [])]).cfg
    resolved = OmegaConf.to_container(cfg, resolve=True)
    assert resolved["cluster"]["gpus_per_node"] == expected
    assert resolve(ConfigView(resolved), resolved).world_size == expected
    said = capsys.readouterr().err
    if 0 < expected < gpus:
        assert said.count(f"cluster=local: {expected} of this host's {gpus} GPUs") == 1, said
    else:
        assert "cluster=local:" not in said
    # the view's count decides the processes; the GPUs they compute on are the ones that are there
    assert local.BACKEND.host_gpu_count() == (gpus or None) and not local.BACKEND.host_has_gpus()


def test_the_default_is_the_value_given_where_the_user_gives_one(monkeypatch):
    from omegaconf import OmegaConf

    from launcher.backends import local

    monkeypatch.setenv(local.HOST_GPUS_ENV, "8")
    resolved = OmegaConf.to_container(compose_point(["cluster=local", "cluster.gpus_per_node=2"]).cfg, resolve=True)
    assert resolved["cluster"]["gpus_per_node"] == 2


def test_a_simulated_host_runs_its_processes_on_the_gpus_that_are_there(monkeypatch, capsys):
    """LAUNCHER_HOST_GPUS stands in for the host's GPUs: the default process count is the view's, and
    where the host lacks those GPUs the processes run on the CPU, said in one line at submission; 0 on a
    GPU host is the CPU too. Nothing is refused for it."""
    from launcher import host
    from launcher.backends import local

    monkeypatch.setattr(host, "detected_gpus", lambda: 0)  # this host: no GPU
    monkeypatch.setattr(host, "_SAID", set())  # said once a process: an earlier test may have said it
    monkeypatch.setenv(host.HOST_GPUS_ENV, "1")
    run = compose_point(["cluster=local"]).cfg
    assert local.BACKEND.request_problems(run) == []
    assert not local.BACKEND.host_has_gpus() and local.BACKEND.host_gpu_count() == 1
    params = local.BACKEND.parameters(run)
    assert params["tasks_per_node"] == 1 and "gpus_per_node" not in params  # no GPU asked of submitit
    assert "LAUNCHER_HOST_GPUS=1 takes this host to have 1 GPU(s) and it has 0: the 1 process(es) run on " \
           "the CPU (gloo)" in capsys.readouterr().err
    monkeypatch.setattr(host, "detected_gpus", lambda: 8)  # a host with 8: 1 of them
    assert local.BACKEND.host_has_gpus() and local.BACKEND.parameters(run)["gpus_per_node"] == 1
    monkeypatch.setenv(host.HOST_GPUS_ENV, "0")  # GPUs there, none used: the CPU
    assert not local.BACKEND.host_has_gpus()
    monkeypatch.delenv(host.HOST_GPUS_ENV)
    assert local.BACKEND.host_has_gpus() and local.BACKEND.host_gpu_count() == 8
    monkeypatch.setenv(host.HOST_GPUS_ENV, "two")
    with pytest.raises(ValueError, match="LAUNCHER_HOST_GPUS='two'"):
        host.host_gpus()


def test_train_deterministic_switches_torch_to_deterministic_kernels(monkeypatch):
    """train.deterministic (launcher/runtime/task.py calls it before the first matmul): deterministic
    algorithms on, cuDNN's deterministic ones, cuBLAS's fixed workspace; a value the user set is kept."""
    import torch

    from launcher.runtime import env as dist_env

    before = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic,
              torch.backends.cudnn.benchmark)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    try:
        dist_env.deterministic_kernels()
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
        dist_env.deterministic_kernels()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
    finally:
        torch.use_deterministic_algorithms(before[0])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[1], before[2]
