"""The planner's model-state bytes per rank equal what each engine really holds, for every layout of
the engine test matrix (parameters, gradients and optimizer states; activations are estimates)."""
import json
from pathlib import Path

import pytest
import yaml

from helpers import EQUIV_BASE, launch, runs_json
from launcher.schema import typed
from recipes.gpt.plan.memory import model_state_bytes_per_rank

pytestmark = [pytest.mark.timeout(600), pytest.mark.dist]

MATRIX = [
    ("single", ["parallelism.engine=ddp"], 1),
    ("dp2", ["parallelism.engine=ddp"], 2),
    ("zero1", ["zero=1"], 2),
    ("zero2", ["zero=2"], 2),
    ("zero3", ["zero=3"], 2),
    ("tp2", ["parallelism=tp"], 2),
    ("pp2", ["parallelism=pp"], 2),
    ("dp2xtp2", ["parallelism=tp"], 4),
    ("pp2xtp2", ["parallelism=3d"], 4),
    ("dp2xpp2xtp2", ["parallelism=3d", "parallelism.sequence_parallel=true"], 8),
    ("pp2xdp2-zero1", ["parallelism=pp", "zero=1"], 4),
]



@pytest.mark.parametrize("name,overrides,procs", MATRIX, ids=[m[0] for m in MATRIX])
def test_estimated_model_state_bytes_are_exact(name, overrides, procs, runs_root):
    res = launch([*EQUIV_BASE, "train.steps=2", f"cluster.gpus_per_node={procs}", *overrides], runs_root)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    (run,) = runs_json(runs_root)
    rdir = Path(run["dir"])
    cfg = typed(yaml.safe_load((rdir / "config.yaml").read_text()))
    status = json.loads((rdir / "status.json").read_text())
    attempts = {k: status.get(k) for k in ("restarts", "resumed", "stop")}  # why, should a check fail
    for rank in range(procs):
        held = json.loads((rdir / "ranks" / f"state_{rank}.json").read_text())
        # megatron's ZeRO-1 (torch ZeroRedundancyOptimizer) shards whole tensors greedily, so each
        # data-parallel rank holds a different share: the planner models that partition exactly
        want = model_state_bytes_per_rank(cfg, stage=held["pp_stage"], dp_rank=held["dp_rank"])
        got = {k: held[k] for k in ("params", "grads", "optimizer")}
        assert got == {k: want[k] for k in got}, (name, rank, got, want, attempts)
