"""Every tensor of two runs' checkpoints compared, step by step (torch: run as a process of its own,
so the command that asks never imports it):

    python -m launcher.features.verify_resume.tensors REFERENCE_RUN_DIR RESUMED_RUN_DIR

prints one JSON object: {"steps": [the steps both runs have a checkpoint of], "files": N, "held":
[the components the checkpoints hold], "diffs": [verdict.Diff as a mapping, ...]}. Each checkpoint's
``*.pt`` files are read (``universal/`` is left out: it is the same state by parameter name), every
tensor and number in them by its path; a value one run has and the other has not, or of another
shape or type, is a difference too."""
from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path
from typing import Any, Dict, Iterator, List, Tuple

from launcher.features.verify_resume.verdict import Diff, component_of

STEP_DIR = re.compile(r"^step_(\d+)$")


def checkpoint_steps(run_dir: Path) -> Dict[int, Path]:
    root = Path(run_dir) / "checkpoints"
    out: Dict[int, Path] = {}
    for d in root.iterdir() if root.is_dir() else ():
        m = STEP_DIR.match(d.name)
        if m and d.is_dir():
            out[int(m.group(1))] = d
    return out


def leaves(obj: Any, path: str = "") -> Iterator[Tuple[str, Any]]:
    """(path, value) of every tensor, number, string and array in a loaded checkpoint object."""
    import torch

    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, dict):
        for k in obj:
            yield from leaves(obj[k], f"{path}.{k}" if path else str(k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from leaves(v, f"{path}[{i}]")
    elif hasattr(obj, "state_dict") and callable(obj.state_dict):
        yield from leaves(obj.state_dict(), path)
    elif type(obj).__module__ == "numpy" or hasattr(obj, "__array__"):
        yield path, torch.as_tensor(__import__("numpy").asarray(obj))
    elif isinstance(obj, (int, float, str, bool, bytes)) or obj is None:
        yield path, obj


def _load(path: Path) -> Dict[str, Any]:
    import torch

    try:  # the run's own checkpoint (verify-resume just made it): its RNG states hold NumPy objects
        obj = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # unreadable: a difference of its own
        return {"(unreadable)": f"{type(e).__name__}: {e}"}
    return dict(leaves(obj))


def _diff(a: Any, b: Any) -> Tuple[float, float]:
    """(max absolute, max relative) difference; (0, 0) when bitwise equal."""
    import torch

    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.shape != b.shape or a.dtype != b.dtype:
            return math.inf, math.inf
        if torch.equal(a, b) or (a.is_floating_point() and torch.equal(a.isnan(), b.isnan())
                                 and torch.equal(a.nan_to_num(), b.nan_to_num())):
            return 0.0, 0.0
        d = (a.double() - b.double()).abs()
        d = d[~d.isnan()] if d.numel() else d
        big = float(d.max()) if d.numel() else math.inf
        scale = float(a.double().abs().max()) if a.numel() else 0.0
        return big, big / max(scale, 1e-30)
    if type(a) is not type(b):
        return math.inf, math.inf
    if isinstance(a, float) and isinstance(b, float):
        if a == b or (math.isnan(a) and math.isnan(b)):
            return 0.0, 0.0
        return abs(a - b), abs(a - b) / max(abs(a), 1e-30)
    return (0.0, 0.0) if a == b else (math.inf, math.inf)


def compare(reference: Path, resumed: Path) -> Dict[str, Any]:
    a_steps, b_steps = checkpoint_steps(reference), checkpoint_steps(resumed)
    steps = sorted(set(a_steps) & set(b_steps))
    diffs: List[Diff] = []
    files = 0
    held: set = set()  # what the reference's checkpoints hold (a component never saved cannot differ)
    for step in steps:
        names = sorted({p.relative_to(d).as_posix() for d in (a_steps[step], b_steps[step])
                        for p in d.glob("*.pt")})
        for name in names:
            files += 1
            pa, pb = a_steps[step] / name, b_steps[step] / name
            if not pa.exists() or not pb.exists():
                diffs.append(Diff(step, name, "(the file)", component_of(name, ""), math.inf, math.inf))
                continue
            la, lb = _load(pa), _load(pb)
            held.update(component_of(name, key) for key in la)
            for key in sorted(set(la) | set(lb)):
                if key not in la or key not in lb:
                    diffs.append(Diff(step, name, key, component_of(name, key), math.inf, math.inf))
                    continue
                big, rel = _diff(la[key], lb[key])
                if big or rel:
                    diffs.append(Diff(step, name, key, component_of(name, key), big, rel))
    return {"steps": steps, "files": files, "held": sorted(held), "diffs": [d.__dict__ for d in diffs]}


def main(argv: List[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    print(json.dumps(compare(Path(argv[0]), Path(argv[1]))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
