"""How fast the planner evaluates layouts (pure Python, no torch).

    .venv/bin/python benchmarks/plan_speed.py [--repeat N]

Workload: `launcher plan --search` for gpt_175b on 1024 A100s (128 nodes x 8, cluster a100_80g),
global batch 1536, bf16: every valid (dp, tp, pp, zero, micro batch, recompute, sequence parallel).
Prints layouts evaluated per second for
  - enumerate: the candidates generated and each decided by launcher.config.rules' table
  - estimate:  the estimators alone over the enumerated layouts (memory, comm, time, feasibility)
  - search:    enumerate + estimate + rank, what `launcher plan --search` runs
  - baseline:  the same estimate reached through the run config, the way a launch checks one point:
               an OmegaConf config per layout, launcher.config.rules.problems, then the estimate read from it
and the ratios: search against the baseline, and against the 10,000 layouts/s target.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from recipes.gpt.plan.search import enumerate_layouts, evaluate_all, search  # noqa: E402
from recipes.gpt.plan.spec import ClusterSpec  # noqa: E402
from recipes.gpt.schema import ModelSpec  # noqa: E402

TARGET = 10_000.0
OVERRIDES = ["model=gpt_175b", "cluster=a100_80g", "cluster.nodes=128", "precision=bf16",
             "train.global_batch_size=1536", "train.micro_batch_size=1"]


def best_of(fn, repeat: int, clock=time.perf_counter) -> float:
    times = []
    for _ in range(repeat):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return min(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--baseline-sample", type=int, default=200, help="layouts timed through the config path")
    args = ap.parse_args()

    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from launcher.app import CONF_DIR, normalize_overrides
    from launcher.config.rules import problems
    from recipes.gpt.plan.estimate import estimate
    from recipes.gpt.plan.spec import LayoutSpec

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=normalize_overrides(OVERRIDES))
    m = ModelSpec.from_cfg(cfg.model)
    cluster = ClusterSpec.from_cfg(cfg.cluster)
    gbs = int(cfg.train.global_batch_size)

    layouts = list(enumerate_layouts(m, cluster, gbs, "bf16"))
    n = len(layouts)
    t_enum = best_of(lambda: list(enumerate_layouts(m, cluster, gbs, "bf16")), args.repeat)
    t_est = best_of(lambda: evaluate_all(m, cluster, layouts), args.repeat)
    t_search = best_of(lambda: search(m, cluster, gbs, "bf16"), args.repeat)
    t_search_cpu = best_of(lambda: search(m, cluster, gbs, "bf16"), args.repeat, time.process_time)
    ranked = search(m, cluster, gbs, "bf16")

    sample = layouts[:: max(1, n // args.baseline_sample)][: args.baseline_sample]

    def through_config():
        for lay in sample:
            point = OmegaConf.merge(cfg, {
                "parallelism": {"tp": lay.tp, "pp": lay.pp, "sequence_parallel": lay.sequence_parallel},
                "zero": {"stage": lay.zero},
                "train": {"micro_batch_size": lay.micro_batch_size, "recompute": lay.recompute},
            })
            errs = problems(point)
            assert not errs, (lay, errs)
            estimate(ModelSpec.from_cfg(point.model), ClusterSpec.from_cfg(point.cluster), LayoutSpec.from_cfg(point))

    t_base = best_of(through_config, max(1, args.repeat // 2))
    rate_est, rate_search, rate_base = n / t_est, n / t_search, len(sample) / t_base

    best = ranked[0]
    print(f"workload: gpt_175b ({m.num_layers} layers, h {m.hidden_size}) on {cluster.world_size} GPUs "
          f"({cluster.nodes} x {cluster.gpus_per_node}, {cluster.name}), global batch {gbs}, bf16")
    print(f"layouts: {n} valid, {sum(e.feasible for e in ranked)} fit in {cluster.memory_bytes / 2**30:g} GiB "
          f"(python {sys.version.split()[0]}, {os.cpu_count()} cpu, load average {os.getloadavg()[0]:.1f})")
    print(f"enumerate only    : {n / t_enum:12,.0f} layouts/s  ({t_enum * 1e3:.1f} ms for {n})")
    print(f"estimate only     : {rate_est:12,.0f} layouts/s  ({t_est * 1e3:.1f} ms for {n})")
    print(f"search (enumerate + estimate + rank): {rate_search:,.0f} layouts/s  ({t_search * 1e3:.1f} ms wall; "
          f"{n / t_search_cpu:,.0f} layouts per CPU-second)")
    print(f"baseline (per layout: OmegaConf config + layout.check + the same estimate from it): "
          f"{rate_base:,.0f} layouts/s "
          f"({len(sample)} layouts in {t_base * 1e3:.0f} ms)")
    print(f"ratio: search / baseline = {rate_search / rate_base:.0f}x;  search / target {TARGET:,.0f}/s = "
          f"{rate_search / TARGET:.2f}x  ->  {'PASS' if rate_search > TARGET else 'BELOW TARGET'}")
    print(f"best layout: dp {best.layout.dp} tp {best.layout.tp} pp {best.layout.pp} zero {best.layout.zero} "
          f"micro {best.layout.micro_batch_size} recompute {best.layout.recompute} sp {best.layout.sequence_parallel}: "
          f"{best.step_time_s:.2f} s/step, {best.timing.tflops_per_gpu:.0f} TFLOP/s per GPU, "
          f"MFU {best.timing.mfu:.1%}, "
          f"{best.memory.total / 2**30:.1f} GiB per GPU")
    return 0 if rate_search > TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
