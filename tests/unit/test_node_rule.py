"""The node ledger's rule (pure) and its files: a node's state from its events, and what a submission
leaves out (never so many that the job cannot be placed)."""
from __future__ import annotations

import json

import pytest

from launcher.features.nodes import rule
from launcher.features.nodes.ledger import Ledger, ledger_dir, settings_of
from launcher.features.nodes.rule import EXCLUDED, EXPIRED, OK, SUSPECT, Event, Settings, exclusion, states

H = 3600.0
S = Settings(exclude_after=2, window_s=24 * H, expire_s=24 * H)


def ev(node, t, kind="cuda_error", run="r/0", attempt=1):
    return Event(node=node, time=t, kind=kind, run=run, attempt=attempt)


def test_one_event_is_suspect_two_within_the_window_exclude_and_the_expiry_brings_it_back():
    assert states([ev("n1", 0)], 10, S)["n1"].state == SUSPECT
    two = [ev("n1", 0), ev("n1", 5 * H, run="r/1")]
    got = states(two, 6 * H, S)["n1"]
    assert got.state == EXCLUDED and got.runs == ["r/0", "r/1"] and got.expires_at == 29 * H
    assert "cuda_error: a rank, attempt 1 of r/1" in got.evidence
    assert states(two, 29 * H + 1, S)["n1"].state == EXPIRED
    # two events a window apart: neither is recent with the other, the node stays suspect
    apart = [ev("n1", 0), ev("n1", 30 * H)]
    assert states(apart, 30 * H + 1, S)["n1"].state == SUSPECT


def test_a_clearing_drops_what_came_before_it_and_events_after_it_count_again():
    evs = [ev("n1", 0), ev("n1", 1), Event("n1", 2, rule.CLEARED)]
    assert states(evs, 3, S)["n1"].state == OK
    assert states([*evs, ev("n1", 4), ev("n1", 5)], 6, S)["n1"].state == EXCLUDED
    # the order they are read in does not matter
    assert states(list(reversed([*evs, ev("n1", 4)])), 6, S)["n1"].state == SUSPECT


def test_a_submission_leaves_out_the_excluded_nodes_but_never_so_many_that_it_cannot_be_placed():
    by = states([ev("n1", 0), ev("n1", 1), ev("n2", 0), ev("n2", 1), ev("n2", 2), ev("n3", 0)], 3, S)
    assert [by[n].state for n in ("n1", "n2", "n3")] == [EXCLUDED, EXCLUDED, SUSPECT]
    assert exclusion(by, 1).nodes == ("n2", "n1")  # (no partition known: all of them)
    four = ["n1", "n2", "n3", "n4"]
    assert exclusion(by, 2, four).nodes == ("n2", "n1") and not exclusion(by, 2, four).kept
    tight = exclusion(by, 3, four)  # room for one left out: the one with the most events
    assert tight.nodes == ("n2",) and tight.kept == ("n1",) and "cluster.nodes=3" in tight.why
    none = exclusion(by, 4, four)
    assert none.nodes == () and none.kept == ("n2", "n1") and "fewer than cluster.nodes=4" in none.why
    # the node a job just failed on goes first, excluded or not
    assert exclusion(by, 1, four, also=("n3",)).nodes == ("n3", "n2", "n1")
    assert exclusion({}, 1).why == ""


def test_the_ledger_is_one_file_per_event_and_skips_what_is_no_event(tmp_path, capsys):
    led = Ledger(tmp_path / "nodes")
    led.append(ev("node1", 100.0))
    led.append(ev("node/../x", 101.0, kind="hang"))
    (led.events_dir / "junk.json").write_text("[1, 2")
    led.clear("node1", who="alice")
    got = led.events()
    assert [e.kind for e in got] == ["cuda_error", "hang", "cleared"] and got[1].node == "node/../x"
    assert all("/" not in p.name for p in led.events_dir.iterdir())
    assert "1 file(s) that are no event skipped" in capsys.readouterr().err
    assert json.loads(sorted(led.events_dir.glob("*.json"))[0].read_text())["node"] == "node1"
    with pytest.raises(ValueError, match="unknown node event kind"):
        led.append(ev("n", 1.0, kind="bad"))


def test_where_the_ledger_is_and_its_settings_come_from_the_config(tmp_path):
    assert ledger_dir({"submit": {"runs_root": str(tmp_path)}}) == tmp_path / "nodes"
    assert ledger_dir({"cluster": {"health": {"ledger": str(tmp_path / "team")}}}) == tmp_path / "team"
    s = settings_of({"cluster": {"health": {"exclude_after": 3, "window_h": 1, "expire_h": 0.5}}})
    assert (s.exclude_after, s.window_s, s.expire_s) == (3, 3600.0, 1800.0)


def test_a_slurm_submission_leaves_out_the_ledgers_excluded_nodes_beside_the_users_own(tmp_path, monkeypatch,
                                                                                      capsys):
    import time

    from launcher import backends
    from launcher.features.nodes import exclude as node_exclude
    from launcher.features.preflight.climb import compose_point

    now = time.time()
    led = Ledger(tmp_path / "runs" / "nodes")
    for t in (now - 60, now - 30):
        led.append(ev("node2", t))
    slurm = backends.get("slurm")
    monkeypatch.setattr(slurm, "partition_nodes", lambda part: ["node1", "node2", "node3", "node4"])
    monkeypatch.setattr(node_exclude, "_said", set())
    monkeypatch.setattr(node_exclude, "_recent", {})
    base = ["cluster=local_slurm", f"submit.runs_root={tmp_path / 'runs'}"]
    params = slurm.parameters(compose_point(base).cfg)
    assert params["exclude"] == "node2" and "excluding node2 (the node ledger" in capsys.readouterr().err
    own = slurm.parameters(compose_point([*base, "+cluster.sbatch_extra.exclude=node9"]).cfg)
    assert own["exclude"] == "node9,node2" and "exclude" not in own.get("additional_parameters", {})
    off = slurm.parameters(compose_point([*base, "cluster.health.enabled=false",
                                          "+cluster.sbatch_extra.exclude=n9"]).cfg)
    assert "exclude" not in off and off["additional_parameters"]["exclude"] == "n9"  # the user's own, as given
    four = slurm.parameters(compose_point([*base, "cluster.nodes=4"]).cfg)  # all four needed: none left out
    assert "exclude" not in four and "fewer than cluster.nodes=4" in capsys.readouterr().err
    # the ledger is read once while it is unchanged (a sweep of many points), again once it changes
    reads = []
    real = Ledger.states
    monkeypatch.setattr(Ledger, "states", lambda self, *a, **k: reads.append(1) or real(self, *a, **k))
    node_exclude._states.cache_clear()
    monkeypatch.setattr(node_exclude, "_recent", {})
    monkeypatch.setattr(node_exclude, "FRESH_S", 0.0)  # (looked at again at every ask: its file stamp decides)
    for _ in range(3):
        slurm.parameters(compose_point(base).cfg)
    assert len(reads) == 1
    time.sleep(0.01)
    led.clear("node2")
    assert "exclude" not in slurm.parameters(compose_point(base).cfg) and len(reads) == 2


def test_the_placing_job_waits_for_the_held_job_sets_its_excluded_nodes_and_always_releases_it(monkeypatch):
    import io
    import subprocess

    from launcher.backends.slurm import place

    calls = []

    def scontrol(*args):
        calls.append(args)
        refused = args[0] == "update" and "node9" in args[2]
        return subprocess.CompletedProcess(args, 1 if refused else 0, "", "refused" if refused else "")

    monkeypatch.setattr(place, "_scontrol", scontrol)
    states = iter(["COMPLETING", "COMPLETING", "PENDING"])
    got = place.place("17", ["node1", "node3"], state=lambda j: next(states), poll_s=0, out=io.StringIO())
    assert got == "ExcNodeList=node1,node3"
    assert calls == [("update", "JobId=17", "ExcNodeList=node1,node3"), ("release", "17")]
    calls.clear()  # a refused update: released as it is
    assert "refused" in place.place("17", ["node9"], state=lambda j: "PENDING", out=io.StringIO())
    assert calls[-1] == ("release", "17")
    calls.clear()  # never pending in time: released
    assert "not pending in time" in place.place("17", ["n"], state=lambda j: "RUNNING", wait_s=0, out=io.StringIO())
    assert calls == [("release", "17")]
    calls.clear()  # cancelled meanwhile: nothing to do
    assert place.place("17", ["n"], state=lambda j: "CANCELLED", out=io.StringIO()) is None and calls == []


HELD = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 3 has a total capacity of 79.19 GiB of which 1.25 GiB "
        "is free. Process 4242 has 61.40 GiB memory in use. Including non-PyTorch memory, this process has 16.50 GiB "
        "memory in use. Of the allocated memory 15.20 GiB is allocated by PyTorch")
OWN = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which 1.25 GiB "
       "is free. Including non-PyTorch memory, this process has 77.90 GiB memory in use. Of the allocated memory ...")


def test_an_out_of_memory_is_the_nodes_only_where_other_processes_held_the_gpu():
    from launcher.doctor.failure_text import node_oom, text_kind
    from launcher.features.nodes.record import fault_detail, kind_of
    from launcher.runtime import restart_policy

    assert node_oom(HELD) == ("GPU 3 ran out of memory with 61.4 GiB of its 79.2 GiB held by other processes "
                              "(this one held 16.5 GiB)")
    assert node_oom(OWN) is None and node_oom("RuntimeError: CUDA out of memory") is None  # the model's own
    assert text_kind(f"torch.OutOfMemoryError: {HELD}") == "node_fault" and text_kind(OWN) == "oom"
    assert kind_of(HELD) == "oom_node" and kind_of("CUDA error: uncorrectable ECC error") == "cuda_error"
    assert fault_detail(HELD).startswith("GPU 3 ran out of memory with 61.4 GiB") and fault_detail(OWN) == OWN
    assert restart_policy.kind_of(RuntimeError(HELD), HELD, "/x/train.py") == "node_fault"
    assert restart_policy.kind_of(RuntimeError(OWN), OWN, "/x/train.py") == "other"
