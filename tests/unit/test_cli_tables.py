"""`launcher runs` / `launcher status` tables: one line per run at any width (launcher/cli/tables.py)."""
from __future__ import annotations

import io

import pytest
from rich.console import Console

from launcher.cli import tables

HEADER = ("run_id", "status", "class", "job", "loss/result", "tokens/s", "dir")
ROWS = [(f"20261205-102045-c999-{i}", "running (job ended: NODE_FAIL)" if i else "completed", "", str(6168 + i),
         "5.5062", "40,392", f"/home/someone/projects/a-long-project-name/runs/20261205-102045-c999/{i}")
        for i in range(3)]


def rendered(width: int, rows=ROWS):
    table, dropped = tables.one_line_table(HEADER, rows, width, optional=("dir", "class", "tokens/s", "job"))
    out = io.StringIO()
    Console(file=out, width=width, color_system=None).print(table)
    return out.getvalue().splitlines(), dropped


@pytest.mark.parametrize("width", [200, 120, 80, 60, 40])
def test_each_run_is_one_line_within_the_width(width):
    lines, dropped = rendered(width)
    assert len(lines) == 3 + len(ROWS) + 1  # header box, one line per run, bottom rule
    assert max(len(line) for line in lines) <= max(width, 40)
    for row in ROWS:
        assert sum(row[0] in line for line in lines) == 1  # the run id is never cut
    if width >= 200:
        assert dropped == [] and all(any(row[-1] in line for line in lines) for row in ROWS)


def test_columns_go_in_the_order_given_and_only_as_many_as_needed():
    done = [(*row[:1], "completed", *row[2:]) for row in ROWS]
    assert rendered(200)[1] == rendered(200, done)[1] == []
    assert rendered(80, done)[1] == ["dir"]  # 79 columns without it
    assert rendered(80)[1] == ["dir", "class", "tokens/s"]  # a long status takes more room
    assert rendered(60, done)[1] == ["dir", "class", "tokens/s"]
    lines, dropped = rendered(40)
    assert dropped == ["dir", "class", "tokens/s", "job"] and any("…" in line for line in lines)
    assert str(tables.left_out_line(["dir"], 80, "--json")) == "(at 80 columns without dir: --json)"
    assert tables.left_out_line([], 80) is None


def test_piped_output_has_no_width_limit_unless_columns_is_set(monkeypatch):
    monkeypatch.setattr("sys.stdout", io.StringIO())
    monkeypatch.delenv("COLUMNS", raising=False)
    assert tables.console().width >= 10_000
    monkeypatch.setenv("COLUMNS", "80")
    assert tables.console().width == 80
