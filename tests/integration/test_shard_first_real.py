"""Shard-first construction through real `launch cluster=local` runs: the weights each layout builds,
gathered, are bitwise the single-process model's (GPT(cfg.model, seed=cfg.seed)) - one process,
megatron tp2, pp2, tp2 x pp2, and ZeRO-3 on 4 ranks, whose ranks never hold the whole model; and every
rank records the memory its construction and its steps used.

The runs use the build-only recipe of benchmarks/construction_memory.py (the engine is constructed,
nothing trained) with recipe.params.dump_weights: each rank writes what it built (megatron: its shards
and where they sit in the full parameters; ZeRO-3: the parameters gathered by DeepSpeed's
zero.GatheredParameters after deepspeed.initialize), put back together by ``gather_weights``.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Dict, List

import pytest
import torch
import yaml
from omegaconf import OmegaConf

from helpers import REPO, launch, read_metrics, runs_json

sys.path.insert(0, str(REPO))  # benchmarks/ is not an installed package
from benchmarks.construction_memory import TARGET, gather_weights  # noqa: E402

TINY = ["model=gpt_tiny", "precision=fp32", "seed=11", "cluster=local",
        "train.log_interval=0"]

LAYOUTS = {
    # name: (overrides, processes)
    "single": (["parallelism.engine=ddp"], 1),
    "tp2": (["parallelism=tp"], 2),
    "pp2": (["parallelism=pp"], 2),
    "tp2xpp2": (["parallelism=3d"], 4),
    "zero3x4": (["zero=3"], 4),
}


def _launch(overrides: List[str], procs: int, root: Path, timeout: float = 300) -> Path:
    res = launch([*TINY, f"cluster.gpus_per_node={procs}", *overrides], root, timeout=timeout,
                 extra_env={"PYTHONPATH": str(REPO)})  # the build-only recipe's module, found at launch
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    (run,) = runs_json(root)
    assert run["status"] == "completed", run
    return Path(run["dir"])


def _states(rdir: Path, procs: int) -> Dict[int, dict]:
    states = {r: json.loads((rdir / "ranks" / f"state_{r}.json").read_text()) for r in range(procs)}
    for st in states.values():
        assert st["host_peak_build_bytes"] >= 0 and st["host_peak_source"] in ("hwm", "sampled"), st
        assert st["host_rss_after_build_bytes"] > 0 and st["host_rss_before_build_bytes"] > 0, st
    return states


@pytest.mark.dist
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_the_weights_built_gathered_are_bitwise_the_single_process_models(name, tmp_path):
    overrides, procs = LAYOUTS[name]
    rdir = _launch(["train.steps=1", "train.micro_batch_size=1", f"train.global_batch_size={2 * procs}",
                    f"recipe._target_={TARGET}", "+recipe.params.dump_weights=true", *overrides],
                   procs, tmp_path / "runs")
    cfg = OmegaConf.create(yaml.safe_load((rdir / "config.yaml").read_text()))
    from recipes.gpt.model import GPT

    want = {n: p.detach() for n, p in GPT(cfg.model, seed=int(cfg.seed)).named_parameters()}
    got = gather_weights(rdir / "built_weights")
    assert sorted(got) == sorted(want)
    differ = [n for n in want if want[n].dtype != got[n].dtype or not torch.equal(
        want[n].reshape(-1).view(torch.uint8), got[n].reshape(-1).view(torch.uint8))]
    assert not differ, (name, differ)

    states = _states(rdir, procs)
    total = sum(p.numel() for p in want.values())
    if name == "zero3x4":  # each rank holds its partitions only: ceil(numel / 4) of every parameter
        held = sum(math.ceil(p.numel() / 4) for p in want.values()) * 4
        assert all(st["params"] == held for st in states.values()), (held, states)
        assert held < 0.26 * total * 4
    if name == "tp2xpp2":  # about a quarter each (the norms and biases replicated, the head's copy)
        assert all(st["params"] < 0.4 * total * 4 for st in states.values()), states


@pytest.mark.dist
@pytest.mark.timeout(600)
def test_a_training_run_records_its_construction_and_step_memory(tmp_path):
    """The GPT recipe itself (ZeRO-3, built partitioned): every rank's state record carries what the
    model's construction used and the peak over the steps; every metrics row the resident memory."""
    rdir = _launch(["train.steps=2", "train.micro_batch_size=2", "train.global_batch_size=4", "zero=3"], 2,
                   tmp_path / "runs")
    for st in _states(rdir, 2).values():
        assert st["host_peak_step_bytes"] >= st["host_rss_after_build_bytes"] - (64 << 20), st
        assert st["host_peak_step_source"] in ("hwm", "lifetime") and st["activation_bytes"] > 0, st
        assert st["params"] > 0 and st["optimizer"] > 0  # the records already there are kept
    rows = read_metrics(rdir)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["host_rss_bytes"] > 10 << 20 for r in rows), rows


# ------------------------------------------------------------------------------------------------
# gather_weights itself: it notices a missing element and two ranks that disagree


# ------------------------------------------------------------------------------------------------
# the ZeRO-3 fill itself, chunk by chunk, for every rank of a group (no DeepSpeed: its layout by hand)


