"""The example Hydra app: returns (x - 1)^2 + (y + 2)^2 (+ seeded noise) and writes it to value.txt
in its working directory (the job's output dir with hydra.job.chdir=true, else the launch dir's
`hydra.runtime.output_dir`). Nothing here knows about Slurm or the launcher: the launcher is chosen
on the command line (hydra/launcher=launcher_local | launcher_slurm).
"""
from __future__ import annotations

import random
import time
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig


def quadratic(x: float, y: float) -> float:
    return (x - 1.0) ** 2 + (y + 2.0) ** 2


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float:
    if cfg.sleep_s:
        time.sleep(float(cfg.sleep_s))
    if cfg.fail:
        raise ValueError(f"asked to fail (x={cfg.x}, y={cfg.y})")
    value = quadratic(float(cfg.x), float(cfg.y)) + float(cfg.noise) * random.Random(int(cfg.seed)).gauss(0, 1)
    out = Path(HydraConfig.get().runtime.output_dir)
    (out / "value.txt").write_text(f"{value!r}\n")
    print(f"x={cfg.x} y={cfg.y} seed={cfg.seed} -> {value}")
    return value


if __name__ == "__main__":
    main()
