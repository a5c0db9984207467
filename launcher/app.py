"""`launch`: the Hydra app. Composes the run config from conf/ and sends it down the one launch path.

  launch [overrides]        one run   (Hydra run mode; submitted like a one-point sweep)
  launch -m [overrides]     a sweep   (our Hydra launcher plugin: one Slurm array for all points)

Stays light: nothing here imports torch or deepspeed.
"""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from launcher.schema import register_configs

CONF_DIR = Path(os.environ.get("LAUNCHER_CONF_DIR") or Path(__file__).resolve().parent.parent / "conf")

register_configs()

# Config groups whose option names are numbers (zero/0.yaml .. zero/3.yaml). Hydra's override
# grammar reads `zero=1` as an int, which a group choice may not be; quote the numbers for it.
NUMERIC_GROUPS = ("zero",)
_NUMERIC_CHOICE = re.compile(r"^([+~]*(?:%s)=)(.*)$" % "|".join(NUMERIC_GROUPS))


def normalize_overrides(args):
    """`zero=1` -> `zero='1'`, `zero=1,2,3` -> `zero='1','2','3'`; everything else unchanged."""
    out = []
    for a in args:
        m = _NUMERIC_CHOICE.match(a)
        if m and "'" not in a and '"' not in a:
            a = m.group(1) + re.sub(r"(?<![\w.])(\d+)(?![\w.])", r"'\1'", m.group(2))
        out.append(a)
    return out


def _fail(err: Exception) -> None:
    print(f"launch: {err}", file=sys.stderr)
    sys.exit(2)


def finish(result, points) -> None:
    """After submission: wait for the runs where the backend (or submit.wait) says so, showing
    progress; exit 1 unless every run completed."""
    cfg = points[0].cfg
    wait = cfg.submit.wait
    if wait is None:
        wait = bool(result.backend and result.backend.waits)
    if wait and not result.dry_run:
        from launcher.submit.progress import wait_and_report

        if not wait_and_report(result, points, sys.stdout, timeout_s=int(cfg.submit.wait_timeout_s)):
            sys.exit(1)


def submit_points(points) -> None:
    """The launch pipeline for these points, then the wait policy and the exit code."""
    from launcher.submit.pipeline import InvalidSweep, launch

    try:
        result = launch(points)
    except InvalidSweep as e:
        _fail(e)
    finish(result, points)
    return result


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def _run(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    from launcher.submit.pipeline import Point

    hc = HydraConfig.get()
    submit_points([Point(cfg=cfg, overrides=list(hc.overrides.task),
                         choices=OmegaConf.to_container(hc.runtime.choices))])


def main() -> None:
    sys.argv[1:] = normalize_overrides(sys.argv[1:])
    _run()


if __name__ == "__main__":
    main()
