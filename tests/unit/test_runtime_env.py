"""Rendezvous settings derived from the job: ports never collide between jobs on one node."""
from launcher.runtime.env import EPHEMERAL_START, PORT_BASE, ephemeral_start, port_for_job, resolve_addr


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
