"""SlurmBackend.pause: scontrol runs inside the job it requeues, so the requeue can kill it before it exits."""
import types

import pytest

from launcher.backends import slurm as slurm_mod
from launcher.backends.slurm import SlurmBackend


def _backend(monkeypatch, rc):
    calls = []

    def scontrol(self, verb, job_id):
        calls.append((verb, job_id))
        if rc:
            raise slurm_mod.jobs.subprocess.CalledProcessError(rc, ["scontrol", verb, job_id], "", "")

    def run(args, **kw):
        calls.append(tuple(args[1:]))
        return types.SimpleNamespace(returncode=0, stdout="", stderr="")

    monkeypatch.setattr(SlurmBackend, "_scontrol", scontrol)
    monkeypatch.setattr(slurm_mod.jobs.subprocess, "run", run)
    return SlurmBackend.__new__(SlurmBackend), calls


def test_a_requeuehold_killed_by_its_own_requeue_is_taken_and_the_hold_made_sure_of(monkeypatch):
    b, calls = _backend(monkeypatch, -15)
    b.pause("7_3")  # no error: the point stays paused, it does not fail
    assert calls == [("requeuehold", "7_3"), ("hold", "7_3")]


def test_a_requeuehold_that_slurm_refuses_still_raises(monkeypatch):
    b, calls = _backend(monkeypatch, 1)
    with pytest.raises(slurm_mod.jobs.subprocess.CalledProcessError):
        b.pause("7_3")
    assert calls == [("requeuehold", "7_3")]


def test_a_plain_requeuehold_asks_nothing_more(monkeypatch):
    b, calls = _backend(monkeypatch, 0)
    b.pause("7_3")
    assert calls == [("requeuehold", "7_3")]
