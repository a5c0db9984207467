"""The pure tier's view of the host: the same on a laptop, a one-GPU workstation and an 8-GPU node.

The local backend counts this host's GPUs (launcher/host.py: ``host_gpus``) for the default
process count of ``cluster=local`` and for the rules that refuse more processes than GPUs. Every pure
test sees the host that ``LAUNCHER_HOST_GPUS`` names where it is set (``LAUNCHER_HOST_GPUS=8
./scripts/test.sh --fast``: the tier on a simulated 8-GPU host), else a host without GPUs, whatever the
machine running the tests has. A test about the detection itself removes the variable.
"""
from __future__ import annotations

import os

import pytest

from launcher.host import HOST_GPUS_ENV

HOST_GPUS = os.environ.get(HOST_GPUS_ENV) or "0"


@pytest.fixture(autouse=True)
def _fixed_host_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(HOST_GPUS_ENV, HOST_GPUS)


@pytest.fixture
def cpu_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """A host without GPUs, whatever LAUNCHER_HOST_GPUS the tier runs with: for a test whose premise is
    N local processes on the CPU (the default's 2, or cluster.gpus_per_node=N), not the host's GPUs."""
    monkeypatch.setenv(HOST_GPUS_ENV, "0")
