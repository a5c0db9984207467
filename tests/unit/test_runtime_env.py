"""Rendezvous settings derived from the job: ports never collide between jobs on one node; the job's
place read by the backend that detects itself, never by name here."""
import os

from launcher.runtime.env import EPHEMERAL_START, PORT_BASE, DistEnv, ephemeral_start, port_for_job, resolve_addr


def test_port_in_range_and_distinct_for_neighbouring_jobs():
    ports = {port_for_job(str(1000 + i)) for i in range(500)}
    assert len(ports) == 500
    assert all(PORT_BASE <= p < EPHEMERAL_START for p in ports)
    assert 29500 not in {port_for_job(str(j)) for j in range(1, 100)}


def test_port_never_in_the_ephemeral_range():
    # pids and job ids of any size land below the kernel's range for outgoing connections
    first = ephemeral_start()
    assert all(PORT_BASE <= port_for_job(str(j), first) < first for j in range(0, 4_000_000, 997))
    assert all(port_for_job(str(j), 40000) < 40000 for j in range(0, 100_000, 13))


def test_array_task_ids_map_to_distinct_ports():
    assert port_for_job("4242_0") != port_for_job("4242_1")


def test_resolvable_host_kept():
    assert resolve_addr("localhost") == "localhost"


def test_the_local_clusters_daemons_listen_below_every_derived_rendezvous_port():
    """scripts/slurm-local.sh's daemons (slurmctld, slurmdbd, mariadb, the slurmds) listen below
    PORT_BASE, where port_for_job never lands: a local job whose pid maps onto a daemon's port would
    fail its rendezvous with EADDRINUSE (seen once: pid 19385 -> 16817, the old slurmctld port)."""
    import re as _re

    from helpers import REPO
    from launcher.runtime.env import PORT_BASE, port_for_job

    text = (REPO / "scripts" / "slurm-local.sh").read_text()
    ports = {name: int(v) for name, v in _re.findall(r"^(\w+_PORT(?:_BASE)?)=\$\(\((\d+) \+ OFFSET\)\)", text, _re.M)}
    assert set(ports) == {"CTLD_PORT", "DBD_PORT", "DB_PORT", "NODE_PORT_BASE"}, ports
    daemon_ports = {ports["CTLD_PORT"], ports["DBD_PORT"], ports["DB_PORT"]} | set(range(ports["NODE_PORT_BASE"],
                                                                                          ports["NODE_PORT_BASE"] + 4))
    assert max(daemon_ports) < PORT_BASE, daemon_ports
    assert min(port_for_job(str(pid)) for pid in range(0, 40000, 7)) >= PORT_BASE


def test_only_rank_0_asks_slurm_for_an_address_dns_lacks(tmp_path, monkeypatch):
    """A node name DNS does not know: rank 0 asks scontrol once and leaves the answer in the run dir;
    any other rank reads it there (never asking); SLURM_NODE_ALIASES and LAUNCHER_MASTER_ADDR need
    no question at all."""
    import socket

    from launcher.backends import slurm
    from launcher.runtime import env

    asked = []

    def scontrol(argv):
        asked.append(argv[3])
        return f"NodeName={argv[3]} NodeAddr=10.1.2.3 State=IDLE"

    def no_dns(host, *a, **kw):
        raise socket.gaierror(socket.EAI_NONAME, "unknown")

    monkeypatch.setattr(slurm.limits, "run", scontrol)
    monkeypatch.setattr(env.socket, "getaddrinfo", no_dns)
    monkeypatch.delenv(env.ADDR_ENV, raising=False)
    monkeypatch.delenv("SLURM_NODE_ALIASES", raising=False)
    monkeypatch.setenv("SUBMITIT_EXECUTOR", "slurm")  # a task of a Slurm job: its backend is asked
    shared = tmp_path / "ranks" / "master_addr.json"
    assert resolve_addr("n1", leader=False, shared=shared, wait_s=0) == "10.1.2.3" and asked == ["n1"]
    assert not shared.exists()  # (a rank that is not the leader never writes it)
    assert resolve_addr("n1", leader=True, shared=shared) == "10.1.2.3" and asked == ["n1", "n1"]
    assert [resolve_addr("n1", leader=False, shared=shared, wait_s=0) for _ in range(5)] == ["10.1.2.3"] * 5
    assert asked == ["n1", "n1"]
    # another master host (the next attempt's nodes): the old answer is not taken
    assert resolve_addr("n2", leader=False, shared=shared, wait_s=0) == "10.1.2.3" and asked[-1] == "n2"
    monkeypatch.setenv("SLURM_NODE_ALIASES", "n3:10.9.9.9:n3,n4:[10.8.8.8]:n4")
    assert resolve_addr("n4", leader=True, shared=shared) == "10.8.8.8" and len(asked) == 3
    monkeypatch.setenv(env.ADDR_ENV, "10.7.7.7")
    assert resolve_addr("n9", leader=True, shared=shared) == "10.7.7.7" and len(asked) == 3


SLURM_TASK = {"SUBMITIT_EXECUTOR": "slurm", "SLURM_JOB_ID": "9123", "SLURM_ARRAY_JOB_ID": "9100",
              "SLURM_ARRAY_TASK_ID": "23", "SLURM_NTASKS": "16", "SLURM_JOB_NUM_NODES": "2", "SLURM_NODEID": "1",
              "SLURM_PROCID": "13", "SLURM_LOCALID": "5", "SLURM_JOB_NODELIST": "gpu[007-008]",
              "SLURMD_NODENAME": "gpu008"}
LOCAL_TASK = {"SUBMITIT_EXECUTOR": "local", "SUBMITIT_LOCAL_JOB_ID": "4242", "SUBMITIT_LOCAL_NTASKS": "4",
              "SUBMITIT_LOCAL_JOB_NUM_NODES": "1", "SUBMITIT_LOCAL_NODEID": "0", "SUBMITIT_LOCAL_GLOBALID": "3",
              "SUBMITIT_LOCAL_LOCALID": "3"}


def _only(monkeypatch, environ):
    import os

    for k in list(os.environ):
        if k.startswith(("SLURM", "SUBMITIT_")):
            monkeypatch.delenv(k)
    for k, v in environ.items():
        monkeypatch.setenv(k, v)


def test_detect_asks_the_backend_whose_job_this_is(monkeypatch, tmp_path):
    """Slurm's and submitit-local's environments each read by their backend: ranks, nodes, the array
    task's job id, the port from the task's own id; a local job inside a Slurm allocation is local."""
    from launcher import backends
    from launcher.runtime import env

    monkeypatch.setenv(env.ADDR_ENV, "10.0.0.7")  # no DNS question in a unit test
    _only(monkeypatch, SLURM_TASK)
    assert backends.running().name == "slurm"
    d = env.detect(addr_file=tmp_path / "addr.json")
    assert (d.rank, d.world_size, d.local_rank, d.local_world_size, d.node_rank, d.num_nodes) == (13, 16, 5, 8, 1, 2)
    assert d.hostnames == ["gpu007", "gpu008"] and (d.job_id, d.raw_job_id) == ("9100_23", "9123")
    assert d.master_port == port_for_job("9123", ephemeral_start()) and d.master_addr == "10.0.0.7"
    assert env.scheduler_node_name() == "gpu008" and env.node_name() == "gpu008"
    _only(monkeypatch, {**LOCAL_TASK, "SLURM_JOB_ID": "77", "SLURMD_NODENAME": "gpu001"})
    d = env.detect(master_port=23456)
    assert backends.running().name == "local" and (d.rank, d.world_size, d.job_id) == (3, 4, "4242")
    assert d.master_port == 23456 and env.scheduler_node_name() is None
    _only(monkeypatch, {})
    assert backends.running() is None and env.scheduler_node_name() is None
    import pytest

    with pytest.raises(env.NotInAJob):
        env.detect()


def test_slurm_host_lists_expand_as_slurm_writes_them():
    from launcher.backends.slurm import hostnames

    assert hostnames("gpu[001-003,7],login-a[1-2]x") == ["gpu001", "gpu002", "gpu003", "gpu7", "login-a1x", "login-a2x"]
    assert hostnames("n1") == ["n1"] and hostnames("") == []
    assert hostnames("r[1-2]n[09-10]") == ["r1n09", "r1n10", "r2n09", "r2n10"]


def test_runtime_env_names_no_scheduler_variable():
    """A second scheduler is one module under launcher/backends: runtime/env reads none of Slurm's or
    submitit's variables itself."""
    import re

    from helpers import REPO

    text = (REPO / "launcher" / "runtime" / "env.py").read_text()
    assert not re.findall(r"SLURM\w*|SUBMITIT_\w+|scontrol", text)


def test_export_gives_deepspeeds_local_size_the_processes_per_node(monkeypatch):
    """DeepSpeed's CPU accelerator takes LOCAL_SIZE for its device count (ZeRO-3 asks it every step);
    without it, it runs `numactl` each time and counts NUMA nodes instead of the node's ranks."""
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "GROUP_RANK", "MASTER_ADDR",
              "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    denv = DistEnv(rank=5, world_size=8, local_rank=1, local_world_size=4, node_rank=1, num_nodes=2,
                   hostnames=["n1", "n2"], job_id="7", raw_job_id="7", array_job_id=None, array_task_id=None,
                   master_addr="n1", master_port=21000)
    env = denv.export()
    assert env["LOCAL_SIZE"] == env["LOCAL_WORLD_SIZE"] == "4"
    assert os.environ["LOCAL_SIZE"] == "4" and os.environ["RANK"] == "5"
