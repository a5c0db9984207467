"""The communication benchmark's contract with the launcher (launcher.recipe_contract): its settings
checked at launch (a bad recipe.params fails there, not after the job has queued), its results file
and its section of the run report. Light: the login side imports it (no torch).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from launcher.recipe_contract import RecipeSpec, ReportSection, RunFile
from recipes.commbench import settings

RESULTS = "commbench.json"  # rank 0 writes it (bench.py); the report and preflight's comm rung read it


def _section(run_dir: Path) -> Optional[ReportSection]:
    """The report's Communication section; None when the run left no results (it failed before)."""
    bench = _results(run_dir)
    if not bench:
        return None
    from recipes.commbench import report  # the report's helpers (matplotlib): only a page pays for them

    return report.section(bench)


def _results(run_dir: Path) -> Any:
    from launcher.archive import atomic

    return atomic.read_json(Path(run_dir) / RESULTS)

RECIPE = RecipeSpec(
    name="commbench",
    check=settings.from_cfg,
    check_doc="docs/commbench.md",
    report=_section,
    results=_results,
    run_files=(
        RunFile(RESULTS, "recipe (rank 0)", "recipes/commbench: per collective and message size, time, algorithm "
                "and bus bandwidth (nccl-tests' definitions), intra- or inter-node; world size, backend, hosts"),
    ),
)
