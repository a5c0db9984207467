"""The trivial Hydra app benchmarks/sweep_submit.py sweeps with Hydra's own submitit launcher (and with
this project's generic launcher): one `seed` key, returns it. Its jobs never need to run for the
benchmark (they are held with --begin and cancelled once queued)."""
import hydra
from omegaconf import DictConfig


@hydra.main(version_base="1.3", config_path=None, config_name=None)
def main(cfg: DictConfig) -> int:
    return int(cfg.get("seed", 0))


if __name__ == "__main__":
    main()
