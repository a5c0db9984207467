"""Hydra's sweep grammar over numeric config-group names through the real `launch` command: every
sweep form in -m mode, plain choices in single-run mode (composition alone: tests/unit/test_sweep_grammar.py)."""
import re

import pytest

from helpers import launch


def _points(stdout):
    """(overrides, zero.stage) of each point of a dry run."""
    heads = re.findall(r"^# ---- point \d+: (.*)$", stdout, re.M)
    stages = [int(s) for s in re.findall(r"^zero:\n  stage: (\d)", stdout, re.M)]
    return list(zip(heads, stages))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("sweep,want", [
    ("zero=1,2", [1, 2]),
    ("zero='1','2'", [1, 2]),
    ("zero=range(0,2)", [0, 1]),
    ("zero=range(1,4,2)", [1, 3]),
    ("zero=choice(0,2)", [0, 2]),
    ("zero=glob(*)", [0, 1, 2, 3]),
    ("zero=glob([1,2])", [1, 2]),
    ("zero=glob(*,exclude=[0,3])", [1, 2]),
])
def test_multirun_forms(sweep, want, tmp_path):
    res = launch(["-m", "submit.dry_run=true", "cluster=local_slurm", sweep], tmp_path / "runs", timeout=280)
    assert res.returncode == 0, res.stderr[-3000:]
    points = _points(res.stdout)
    assert [s for _, s in points] == want, res.stdout[-3000:]
    for head, stage in points:
        assert re.search(rf"zero='?{stage}'?", head), head
    assert f"# dry run: nothing submitted ({len(want)} point(s))" in res.stdout


@pytest.mark.timeout(300)
@pytest.mark.parametrize("given,stage", [("zero=3", 3), ("zero='1'", 1)])
def test_single_run(given, stage, tmp_path):
    res = launch(["submit.dry_run=true", "cluster=local_slurm", given], tmp_path / "runs", timeout=280)
    assert res.returncode == 0, res.stderr[-3000:]
    assert [s for _, s in _points(res.stdout)] == [stage]


@pytest.mark.timeout(300)
def test_single_run_refuses_a_sweep_saying_multirun(tmp_path):
    res = launch(["submit.dry_run=true", "zero=range(0,2)"], tmp_path / "runs", timeout=280)
    assert res.returncode != 0 and "--multirun" in res.stderr
