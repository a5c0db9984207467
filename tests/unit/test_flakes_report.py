"""scripts/flakes.py over runs made already (--from): each test's pass rate over the runs, a test that
passed in some and failed in others called flaky, and the time per module (--by-module)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from helpers import REPO


def _flakes():
    spec = importlib.util.spec_from_file_location("flakes", REPO / "scripts" / "flakes.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["flakes"] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def _junit(path: Path, cases) -> Path:
    rows = []
    for name, time, failed in cases:
        inner = '<failure message="boom: it broke">trace</failure>' if failed else ""
        rows.append(f'<testcase classname="tests.integration.test_a" name="{name}" file="tests/integration/test_a.py" '
                    f'time="{time}">{inner}</testcase>')
    path.write_text(f'<testsuites><testsuite name="pytest">{"".join(rows)}</testsuite></testsuites>')
    return path


def test_runs_made_already_give_each_tests_pass_rate_and_each_modules_time(tmp_path, capsys):
    flakes = _flakes()
    a = _junit(tmp_path / "a.xml", [("test_steady@slurm-a", 10.0, False), ("test_shaky", 2.0, False)])
    b = _junit(tmp_path / "b.xml", [("test_steady@slurm-a", 12.0, False), ("test_shaky", 3.0, True)])
    rc = flakes.main(["--from", str(a), str(b), "--by-module", "--json", str(tmp_path / "t.json")])
    out = capsys.readouterr().out
    assert rc == 1  # a flaky test fails the report
    shaky = next(line for line in out.splitlines() if "test_shaky" in line and "FLAKY" in line)
    assert "1/2" in shaky and "run 2: failed: boom: it broke" in out
    steady = next(line for line in out.splitlines() if "test_steady" in line)
    assert "2/2" in steady and "ok" in steady and "@" not in steady  # the xdist group is not the test's name
    module = next(line for line in out.splitlines() if line.startswith("tests/integration/test_a.py "))
    assert module.split()[1:] == ["2", "13.5"]  # medians 11.0 + 2.5


def test_every_run_passing_exits_0_and_a_missing_report_does_not(tmp_path):
    flakes = _flakes()
    a = _junit(tmp_path / "a.xml", [("test_x", 1.0, False)])
    assert flakes.main(["--from", str(a), str(a)]) == 0
    assert flakes.main(["--from", str(a), str(tmp_path / "none.xml")]) == 1
