"""`launcher reproduce RUN`: launch a new run from an archived one — its resolved config, its code
snapshot and its seeds, never today's conf/ or today's code."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from launcher.archive import compare
from launcher.layout import ConfigError, ConfigErrors
from launcher.rundir import RunDir
from launcher.schema import RunConfig


def archived_point(run_dir: Path, overrides: List[str], runs_root: Optional[Path]):
    """The run config to reproduce `run_dir` with, plus any overrides (dotted key=value)."""
    from launcher.submit.pipeline import Point

    rd = RunDir(run_dir)
    meta = rd.run() or {}
    if meta.get("kind") == "hydra_app":  # another Hydra app's config: not a RunConfig of this project
        app = meta.get("app") or {}
        raise ConfigErrors([ConfigError("RUN", f"run {meta.get('run_id')} is a run of a Hydra app "
                                        f"({app.get('name') or app.get('task') or 'not launch'}), not of `launch`",
                                        "run that app again with its archived overrides (overrides.yaml) and "
                                        "hydra/launcher=launcher_slurm or launcher_local")])
    plain = rd.config()
    plain.setdefault("submit", {})["runs_root"] = str(runs_root or rd.path.parent.parent)
    plain["submit"]["dry_run"] = False
    try:
        cfg = OmegaConf.merge(OmegaConf.structured(RunConfig), plain)
        if overrides:
            cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(list(overrides)))
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "?"
        raise ConfigErrors([ConfigError(str(key), str(e).splitlines()[0], "use a key of the archived config")])
    ov = rd.overrides()
    return Point(cfg=cfg, overrides=list(ov.get("overrides", [])) + list(overrides), choices=ov.get("choices", {}))


def topology_warnings(run_dir: Path, cfg: Any) -> List[str]:
    """What differs between the archived run's topology and the one requested, and what that changes."""
    topo = compare.topology_summary(run_dir)
    warns = []
    world = int(cfg.cluster.nodes) * int(cfg.cluster.gpus_per_node)
    if topo.get("world_size") and world != topo["world_size"]:
        warns.append(
            f"world size {world} differs from the original {topo['world_size']}: the data-parallel degree and "
            "the order of gradient reductions change, so losses will match only to rounding, not bitwise"
        )
    gpu = str(cfg.cluster.gpu.name)
    if topo.get("gpu_models") and gpu not in topo["gpu_models"] and gpu != "cpu":
        warns.append(
            f"GPU type {gpu} differs from the original {', '.join(topo['gpu_models'])}: kernels and their "
            "numerics differ; expect matching curves only to rounding"
        )
    return warns


def reproduce(run_dir: Path, overrides: List[str], runs_root: Optional[Path] = None, out=None):
    from launcher.app import finish
    from launcher.submit import pipeline

    out = out or sys.stdout
    run_dir = Path(run_dir)
    rd = RunDir(run_dir)
    meta = rd.run()
    if not meta:
        raise FileNotFoundError(f"{run_dir} is not an archived run (no {RunDir.RUN})")
    snapshot = Path(rd.snapshot().get("path", ""))
    if not snapshot.is_dir():
        raise FileNotFoundError(f"run {meta['run_id']} has no code snapshot to reproduce from ({snapshot})")
    point = archived_point(run_dir, overrides, runs_root)
    for w in topology_warnings(run_dir, point.cfg):
        print(f"warning: {w}", file=sys.stderr)
    print(f"reproducing {meta['run_id']} with its archived config, seeds and code snapshot {snapshot}", file=out)
    extra: Dict[str, Any] = {"reproduces": meta["run_id"], "reproduces_dir": str(run_dir)}
    result = pipeline.launch([point], argv=list(sys.argv), out=out, code_snapshot=snapshot, extra_meta=extra)
    finish(result, [point])
    return result
