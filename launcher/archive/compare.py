"""Differences between two archived runs: config, seeds, topology, code and metrics."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from launcher.run.rundir import RunDir


def flatten(node: Any, prefix: str = "") -> Dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}; lists stay values."""
    if isinstance(node, dict):
        out: Dict[str, Any] = {}
        for k, v in node.items():
            out.update(flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: node}


def dict_diff(a: Dict[str, Any], b: Dict[str, Any]) -> Dict[str, Tuple[Any, Any]]:
    fa, fb = flatten(a), flatten(b)
    return {k: (fa.get(k), fb.get(k)) for k in sorted(set(fa) | set(fb)) if fa.get(k) != fb.get(k)}


def topology_summary(run_dir: Path) -> Dict[str, Any]:
    """World size, nodes, hosts per rank and GPU models, from what the job recorded."""
    rd = RunDir(run_dir)
    ranks, nodes = rd.ranks(), rd.topology()
    gpus = sorted({d.get("name") for n in nodes for d in (n.get("gpus") or {}).get("devices", [])} - {None})
    layout = (rd.run() or {}).get("layout", {})
    return {
        "world_size": layout.get("world_size") or len(ranks),
        "nodes": layout.get("nodes"),
        "dp": layout.get("dp"), "tp": layout.get("tp"), "pp": layout.get("pp"),
        "rank_hosts": [r.get("slurmd_nodename") or r.get("hostname") for r in ranks],
        "gpu_models": gpus,
        "cpu_models": sorted({(n.get("cpu") or {}).get("model") for n in nodes} - {None}),
    }


def losses(run_dir: Path) -> List[float]:
    return [r["loss"] for r in RunDir(run_dir).metrics() if "loss" in r]


def loss_comparison(a: List[float], b: List[float]) -> Dict[str, Any]:
    """Bitwise equality of two loss curves (JSON keeps doubles exact), else where they part."""
    identical = len(a) == len(b) and all(x == y for x, y in zip(a, b))
    first: Optional[int] = None
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            first = i + 1
            break
    common = min(len(a), len(b))
    return {
        "bitwise_identical": identical,
        "steps": [len(a), len(b)],
        "first_different_step": first,
        "max_abs_diff": max((abs(x - y) for x, y in zip(a, b)), default=0.0) if common else None,
    }


def code_summary(run_dir: Path) -> Dict[str, Any]:
    rd = RunDir(run_dir)
    git, snap, patch = rd.git(), rd.snapshot(), rd.patch()
    own = (rd.software() or {}).get("launcher") or {}  # the launcher's own code, apart from the user's

    return {
        "repo": git.get("repo"),
        "commit": git.get("commit"),
        "dirty": git.get("dirty"),
        "note": git.get("note"),  # "not a git repo": the user's code has no commit
        "patch_sha256": hashlib.sha256(patch.encode()).hexdigest() if rd.has_patch() else None,
        "snapshot_sha256": snap.get("sha256"),
        "source": snap.get("source"),
        "launcher_version": own.get("version"),
        "launcher_commit": own.get("commit"),
        "launcher_dirty": own.get("dirty"),
    }


def diff_runs(a: Path, b: Path) -> Dict[str, Any]:
    a, b = Path(a), Path(b)
    seeds_a, seeds_b = RunDir(a).seeds() or {}, RunDir(b).seeds() or {}
    cfg_a, cfg_b = RunDir(a).config(), RunDir(b).config()
    for cfg in (cfg_a, cfg_b):  # where a run was stored is not what it was
        cfg.get("submit", {}).pop("runs_root", None)
    return {
        "a": str(a), "b": str(b),
        "config": {k: list(v) for k, v in dict_diff(cfg_a, cfg_b).items()},
        "seeds": {k: list(v) for k, v in dict_diff(seeds_a, seeds_b).items()},
        "topology": {k: list(v) for k, v in dict_diff(topology_summary(a), topology_summary(b)).items()},
        "code": {k: list(v) for k, v in dict_diff(code_summary(a), code_summary(b)).items()},
        "metrics": loss_comparison(losses(a), losses(b)),
        "reshards": {"a": reshard_lines(a), "b": reshard_lines(b)},
    }


def reshard_lines(rdir: Path) -> List[str]:
    """Each resume of the run on another layout (reshard.jsonl), one line each: the step, what moved,
    and whether the loaded state was bitwise what was saved."""
    out = []
    for r in RunDir(rdir).reshards():
        moved = ", ".join(f"{k} {a} -> {b}" for k, (a, b) in (r.get("moved") or {}).items())
        check = r.get("verify") or {}
        verdict = "bitwise equal" if r.get("bitwise_equal") else "NOT equal"
        out.append(f"step {r.get('step')}: {moved} ({check.get('tensors', '?')} tensors {verdict})")
    return out


def to_json(obj: Any) -> str:
    return json.dumps(obj, indent=2, default=str)
