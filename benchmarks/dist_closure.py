"""The installed distributions a set of root packages needs (their requirements, followed; extras and
markers for other Pythons left out), as this interpreter's environment holds them. For the GPU smoke's
carried wheels (benchmarks/gpu_wheels.sh) and its bare-machine rehearsal (benchmarks/gpu_smoke_bare.sh):

    python benchmarks/dist_closure.py wheels            name==version of the smoke's needs beyond torch's
    python benchmarks/dist_closure.py link-torch DEST   torch's closure linked into DEST (a site dir)
"""
from __future__ import annotations

import importlib.metadata as md
import os
import re
import sys
from typing import Dict, List, Optional

SMOKE_ROOTS = ["hydra-core", "omegaconf", "submitit", "deepspeed", "rich", "pyyaml", "numpy"]


def requires(name: str) -> List[str]:
    out = []
    for r in md.distribution(name).requires or []:
        if ";" in r and "extra" in r.split(";", 1)[1]:
            continue
        out.append(re.match(r"[A-Za-z0-9_.\-]+", r).group(0))
    return out


def closure(roots: List[str]) -> Dict[str, Optional[str]]:
    """Normalised name -> installed version (None: not installed here, e.g. a marker for older Pythons)."""
    seen: Dict[str, Optional[str]] = {}
    todo = list(roots)
    while todo:
        name = todo.pop()
        key = name.lower().replace("_", "-")
        if key in seen:
            continue
        try:
            seen[key] = md.version(name)
        except md.PackageNotFoundError:
            seen[key] = None
            continue
        todo += requires(name)
    return seen


def link(names: List[str], dest: str) -> None:
    """Each distribution's top-level files and folders, symlinked into ``dest``."""
    for name in names:
        dist = md.distribution(name)
        for f in dist.files or []:
            top = str(f).split("/")[0]
            src = os.path.join(str(dist.locate_file("")), top)
            if top not in ("..", "bin") and os.path.exists(src) and not os.path.exists(os.path.join(dest, top)):
                os.symlink(src, os.path.join(dest, top))


def main(argv: List[str]) -> None:
    torch = closure(["torch"])
    if argv[:1] == ["wheels"]:
        for name, version in sorted(closure(SMOKE_ROOTS).items()):
            if version is not None and name not in torch:
                print(f"{name}=={version}")
    elif argv[:1] == ["link-torch"] and len(argv) == 2:
        link([n for n, v in torch.items() if v is not None], argv[1])
        print("torch's closure:", ", ".join(sorted(torch)))
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
