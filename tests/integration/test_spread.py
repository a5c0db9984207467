"""launcher.submit.spread: a launch's per-run writes over two processes give what one process gives,
and a child that fails leaves its half to the parent."""
from __future__ import annotations

import copy
import os
import signal
from pathlib import Path

import pytest

from launcher.submit import spread


def _writer(root: Path, fail_in_child_at: int = -1):
    parent = os.getpid()

    def fn(i: int) -> dict:
        if i == fail_in_child_at and os.getpid() != parent:
            raise OSError("disk said no")
        (root / f"{i}.json").write_text(str(i))
        return {"i": i, "pid": os.getpid(), "path": root / f"{i}.json"}  # a Path: JSON holds it as text
    return fn


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="the second process needs a second core")
def test_the_second_half_is_written_by_a_child_and_results_come_back_in_order(tmp_path):
    n = 3 * spread._FORK_MIN
    out = spread.in_processes(_writer(tmp_path), list(range(n)))
    assert [r["i"] for r in out] == list(range(n))
    assert sorted(int(p.stem) for p in tmp_path.iterdir()) == list(range(n))
    probe = spread._PROBE  # the first few here, then half of the rest each
    cut = probe + (n - probe) // 2
    pids = {r["pid"] for r in out[cut:]}
    assert pids != {os.getpid()} and len(pids) == 1  # one child wrote the second half
    assert {r["pid"] for r in out[:cut]} == {os.getpid()}
    assert out[-1]["path"] == str(tmp_path / f"{n - 1}.json")


def test_a_child_that_fails_leaves_its_half_to_the_parent(tmp_path):
    n = 2 * spread._FORK_MIN
    out = spread.in_processes(_writer(tmp_path, fail_in_child_at=n - 3), list(range(n)))
    assert [r["i"] for r in out] == list(range(n))
    assert {r["pid"] for r in out} == {os.getpid()}  # the child's results were dropped, its half redone here
    assert len(list(tmp_path.iterdir())) == n


def test_a_few_items_are_not_worth_a_fork(tmp_path):
    out = spread.in_processes(_writer(tmp_path), list(range(spread._FORK_MIN - 1)))
    assert {r["pid"] for r in out} == {os.getpid()}


def _forks(monkeypatch) -> list:
    """The pids in_processes forks (the test's worker has other children: each is asked for by pid)."""
    forked, real = [], os.fork

    def fork() -> int:
        pid = real()
        if pid:
            forked.append(pid)
        return pid

    monkeypatch.setattr(spread.os, "fork", fork)
    return forked


def test_an_error_in_the_parents_half_stops_the_child_and_is_raised(tmp_path, monkeypatch):
    forked = _forks(monkeypatch)

    def fn(i: int) -> int:
        if i == spread._PROBE:
            raise KeyboardInterrupt  # Ctrl-C while the runs are being written (past the first few)
        return i

    with pytest.raises(KeyboardInterrupt):
        spread.in_processes(fn, list(range(2 * spread._FORK_MIN)))
    (pid,) = forked
    with pytest.raises(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)  # ended and reaped: no child left behind


def test_a_child_that_does_not_answer_is_ended_and_its_half_redone(tmp_path, monkeypatch):
    parent = os.getpid()

    def fn(i: int) -> int:
        if os.getpid() != parent:
            os.kill(os.getpid(), signal.SIGSTOP)  # a child stuck (a lock a thread held at the fork)
        return i

    forked = _forks(monkeypatch)
    monkeypatch.setattr(spread, "_CHILD_S", 1.0)
    monkeypatch.setattr(spread, "_ITEM_S", 0.0)
    out = spread.in_processes(fn, list(range(2 * spread._FORK_MIN)))
    assert out == list(range(2 * spread._FORK_MIN))
    (pid,) = forked
    with pytest.raises(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)  # ended and reaped


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="the second process needs a second core")
def test_pickled_results_of_any_type_come_back_from_the_child_in_order():
    from launcher.config.errors import ConfigError

    parent = os.getpid()

    def fn(i: int):
        return (i, os.getpid() != parent, ConfigError("train.steps", f"bad {i}", "fix it"))

    n = 3 * spread._FORK_MIN
    out = spread.in_processes(fn, list(range(n)), pickled=True)
    assert [r[0] for r in out] == list(range(n))
    assert any(r[1] for r in out) and not out[0][1]  # the second half computed in the child
    assert all(isinstance(r[2], ConfigError) and str(r[2]) == str(fn(r[0])[2]) for r in out)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="the second process needs a second core")
def test_a_large_launch_is_validated_in_two_processes_as_in_one(monkeypatch):
    """Every point's resolution, layout, plan and checks record, and every invalid point's message, are
    what one process gives (the child's half pickled back)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from launcher.app import CONF_DIR, normalize_overrides
    from launcher.submit import pipeline

    n = 2 * spread._FORK_MIN

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        base = OmegaConf.to_container(compose(config_name="config", overrides=normalize_overrides(
            ["cluster=local_slurm", "cluster.nodes=2"])), resolve=True)

    def point(seed: int, tp: int = 1):  # as the sweep composer's fast path gives them: resolved already
        resolved = copy.deepcopy(base)
        resolved["seed"], resolved["parallelism"]["tp"] = seed, tp
        return pipeline.Point.of_resolved(resolved, [f"seed={seed}", *([f"parallelism.tp={tp}"] if tp > 1 else [])],
                                          {})

    good = [point(i) for i in range(n)]
    mixed = [point(i, 1 + 2 * (i % 2)) for i in range(n)]  # every other point tp=3 on 2 ranks: invalid
    forked = _forks(monkeypatch)

    def outcome(points):
        try:
            return [(c.index, c.resolved, c.layout, c.plan, c.checks) for c in pipeline.validate(points)]
        except pipeline.InvalidSweep as e:
            return str(e)

    valid, invalid = outcome(good), outcome(mixed)
    assert len(forked) == 2 and len(valid) == n and [v[0] for v in valid] == list(range(n))
    assert f"{n // 2} of {n} point(s) invalid" in invalid and "point 1 (seed=1 parallelism.tp=3)" in invalid
    assert f"point {n - 1} (seed={n - 1} parallelism.tp=3)" in invalid, invalid[-500:]
    monkeypatch.setattr(spread, "_FORK_MIN", 10 ** 9)  # one process
    assert outcome(good) == valid and outcome(mixed) == invalid and len(forked) == 2
