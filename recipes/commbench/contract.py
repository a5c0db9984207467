"""The communication benchmark's contract with the launcher (launcher.recipe_contract): its settings
checked at launch (a bad recipe.params fails there, not after the job has queued), its results file
and its section of the run report. Light: the login side imports it (no torch).
"""
from __future__ import annotations

from launcher.recipe_contract import RecipeSpec, RunFile
from recipes.commbench import settings

RESULTS = "commbench.json"  # rank 0 writes it (bench.py); the report and preflight's comm rung read it

RECIPE = RecipeSpec(
    name="commbench",
    check=settings.from_cfg,
    check_doc="docs/commbench.md",
    run_files=(
        RunFile(RESULTS, "recipe (rank 0)", "recipes/commbench: per collective and message size, time, algorithm "
                "and bus bandwidth (nccl-tests' definitions), intra- or inter-node; world size, backend, hosts"),
    ),
)
