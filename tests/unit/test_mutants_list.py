"""scripts/mutants.py's list stays tied to the code: every mutant's old text occurs exactly once in its
file and every test it names exists (its drift check, run in-process: nothing is started), so a
refactor that moves the code under a mutant fails the pure tier instead of silently disarming it."""
from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "mutants.py"


def _load():
    name = "launcher_mutants_script"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, SCRIPT)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up while the file runs
        spec.loader.exec_module(module)
    return sys.modules[name]


mutants = _load()
# in a mutant's scratch copy (scripts/mutants.py runs the tests there) the mutant's own edit is "drift"
pytestmark = pytest.mark.skipif(bool(os.environ.get(mutants.MUTANT_ENV)),
                                reason="a mutant's run: the list is checked on the unmutated checkout")


@pytest.mark.parametrize("m", mutants.MUTANTS, ids=lambda m: m.id)
def test_the_mutant_still_applies_to_the_code(m):
    problem = mutants.drift(m, mutants.REPO)
    assert problem is None, f"{m.id} ({m.what}) DRIFT: {problem}: update its text, file or killer"


def test_the_list_check_passes():
    assert mutants.main(["--list"]) == 0  # what `python scripts/mutants.py --list` exits with


def test_every_mutant_is_a_real_edit_with_a_killer():
    ids = [m.id for m in mutants.MUTANTS]
    assert len(ids) == len(set(ids)), "mutant ids repeat"
    for m in mutants.MUTANTS:
        assert m.old != m.new, m.id
        assert m.what, m.id
        if m.killer == mutants.FAST:
            assert m.quick, f"{m.id}: a unit-killed mutant names the unit tests that kill it (--quick)"
            assert all(q.startswith("tests/unit/") for q in m.quick), m.id
        else:
            assert m.killer.startswith("tests/integration/") and "::" in m.killer, m.id


def test_drift_is_reported(tmp_path):
    """The check itself: text that moved, a file that went and a renamed killer are each DRIFT."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text("x = 1\nx = 1\ny = 2\n")
    (tmp_path / "tests" / "unit").mkdir(parents=True)
    (tmp_path / "tests" / "unit" / "test_a.py").write_text("def test_y():\n    pass\n")
    M = mutants.Mutant
    assert mutants.drift(M("T", "pkg/a.py", "y = 2", "y = 3", mutants.FAST, "w", ("tests/unit/test_a.py::test_y",)),
                         tmp_path) is None
    assert "found 2 times" in mutants.drift(M("T", "pkg/a.py", "x = 1", "x = 2", mutants.FAST, "w"), tmp_path)
    assert "found 0 times" in mutants.drift(M("T", "pkg/a.py", "z = 1", "z = 2", mutants.FAST, "w"), tmp_path)
    assert "does not exist" in mutants.drift(M("T", "pkg/b.py", "y = 2", "y = 3", mutants.FAST, "w"), tmp_path)
    assert "no test test_z" in mutants.drift(
        M("T", "pkg/a.py", "y = 2", "y = 3", mutants.FAST, "w", ("tests/unit/test_a.py::test_z[1]",)), tmp_path)


def test_a_mutant_run_leaves_this_check_out():
    """In a mutated copy the drift check fails on the mutant's own edit: were it run there, every
    mutant would read as killed."""
    assert mutants.LIST_TEST == Path(__file__).resolve().relative_to(mutants.REPO).as_posix()
    assert f"--ignore={mutants.LIST_TEST}" in mutants.pytest_command("python", ["tests/unit"])
