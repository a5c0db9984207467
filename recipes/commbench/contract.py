"""The communication benchmark's contract with the launcher (launcher.config.recipe_contract): its settings
checked at launch (a bad recipe.params fails there, not after the job has queued), its results file,
its section of the run report and what preflight's comm rung runs and reads (``link_check``).
Light: the login side imports it (no torch).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Tuple

from launcher.config.recipe_contract import LinkCheck, RecipeSpec, ReportSection, RunFile
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

def _short(use_gpus: bool) -> Tuple[str, ...]:
    """Its settings for preflight's comm rung: on CPU links, small messages keep the rung short."""
    return () if use_gpus else ("recipe.params.max_bytes=1048576", "recipe.params.iters=5",
                                "recipe.params.warmup_iters=2")


def _inter_busbw(bench: Any) -> Optional[float]:
    """The best all-reduce bus bandwidth between nodes in its results (None: no inter-node row)."""
    rows = [r for r in (bench or {}).get("rows", []) if r.get("op") == "all_reduce" and r.get("scope") == "inter"]
    return max((float(r["busbw_gbs"]) for r in rows), default=None)


RECIPE = RecipeSpec(
    name="commbench",
    check=settings.from_cfg,
    check_doc="docs/commbench.md",
    report=_section,
    results=_results,
    link_check=LinkCheck(overrides=_short, inter_busbw=_inter_busbw),
    run_files=(
        RunFile(RESULTS, "recipe (rank 0)", "recipes/commbench: per collective and message size, time, algorithm "
                "and bus bandwidth (nccl-tests' definitions), intra- or inter-node; world size, backend, hosts"),
    ),
)
