"""The GPT recipe's DDP loop in two real processes matches one process (the single-process
recipe tests: tests/unit/test_gpt_recipe.py)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from omegaconf import OmegaConf

from recipes.gpt.schema import GPTRunConfig as RunConfig
from recipes.gpt.train import main
from unit.test_gpt_recipe import TINY_MODEL, make_cfg, make_ctx, read_metrics, run_single  # noqa: F401 (fixtures and helpers shared with the pure tests)


def _ddp_worker(rank: int, world_size: int, cfg_yaml: str, run_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{run_dir}/store", rank=rank, world_size=world_size
    )
    cfg = OmegaConf.merge(OmegaConf.structured(RunConfig), OmegaConf.create(cfg_yaml))
    ctx = make_ctx(cfg, Path(run_dir), rank=rank, world_size=world_size)
    try:
        summary = main(cfg, ctx)
        (Path(run_dir) / f"summary{rank}.json").write_text(json.dumps(summary))
    finally:
        ctx.close()
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_main_two_process_ddp_matches_single_process(tmp_path):
    steps = 8
    cfg = make_cfg(train={"steps": steps})
    run_single(cfg, tmp_path / "single")
    single = [r["loss"] for r in read_metrics(tmp_path / "single")]

    ddp_dir = tmp_path / "ddp"
    ddp_dir.mkdir()
    mp.spawn(_ddp_worker, args=(2, OmegaConf.to_yaml(cfg), str(ddp_dir)), nprocs=2, join=True)
    rows = read_metrics(ddp_dir)
    assert len(rows) == steps  # rank 0 only writes
    assert [r["loss"] for r in rows] == pytest.approx(single, rel=1e-5)
    summaries = [json.loads((ddp_dir / f"summary{r}.json").read_text()) for r in range(2)]
    assert all(s["world_size"] == 2 and s["grad_accum"] == 2 for s in summaries)
    # every rank reports the same (all-reduced) loss
    assert summaries[0]["final_loss"] == summaries[1]["final_loss"]
