"""The planner's model-state bytes per rank equal what each engine really holds (parameters, gradients
and optimizer states; activations are estimates). Every layout of the engine test matrix is checked on
the run its engine test makes anyway (helpers.assert_state_bytes_exact: test_engine_megatron.py's
layouts, test_engine_deepspeed.py's ZeRO stages); here the two that no other test runs."""
from pathlib import Path

import pytest

from helpers import EQUIV_BASE, assert_state_bytes_exact, launch, runs_json

pytestmark = [pytest.mark.timeout(600), pytest.mark.dist]


def test_estimated_model_state_bytes_are_exact_in_one_process(equivalence_reference):
    assert_state_bytes_exact(Path(equivalence_reference), 1)


def test_estimated_model_state_bytes_are_exact_for_ddp_on_two(runs_root):
    res = launch([*EQUIV_BASE, "train.steps=2", "cluster.gpus_per_node=2", "parallelism.engine=ddp"], runs_root)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    (run,) = runs_json(runs_root)
    assert_state_bytes_exact(Path(run["dir"]), 2)
