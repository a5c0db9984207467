"""Injected faults (launcher.config.faults, recipes.common.faults): train.fail_* and train.faults read as
one list, each firing on its own attempt, on its own rank, at its own step; the ones a shorter run never
reaches dropped by preflight; the checkpointer's kill_in_save drills on each listed step."""
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from launcher.config import faults
from launcher.config.faults import Fault
from recipes.common.faults import inject_fault

TRAIN = {"steps": 20, "fail_at_step": 3, "fail_rank": 1, "fail_mode": "exception", "fail_attempt": 1,
         "fail_peers": "error",
         "faults": [{"at_step": 7, "rank": 0, "mode": "exception", "attempt": 2},
                    {"at_step": 9, "rank": 1, "mode": "exception", "attempt": None}]}


def test_train_fail_and_the_list_read_as_one_list_in_order():
    assert faults.faults(TRAIN) == [
        Fault(3, 1, "exception", 1, "train.fail_at_step"),
        Fault(7, 0, "exception", 2, "train.faults[0]"),
        Fault(9, 1, "exception", None, "train.faults[1]"),
    ]
    assert faults.faults({"fail_at_step": None, "faults": []}) == []
    assert faults.faults(OmegaConf.create(TRAIN)) == faults.faults(TRAIN)  # typed or plain alike


def fires(train, attempt, rank, step):
    ctx = SimpleNamespace(attempt=attempt, rank=rank, abort_on_error=False, device="cpu")
    try:
        inject_fault(OmegaConf.create({"train": train}), ctx, step)
    except RuntimeError as e:
        return str(e)
    return None


@pytest.mark.parametrize("attempt,rank,step,fired", [
    (1, 1, 3, True), (2, 1, 3, False),  # train.fail_*: attempt 1 only
    (2, 0, 7, True), (1, 0, 7, False), (2, 1, 7, False),  # faults[0]: attempt 2, rank 0
    (1, 1, 9, True), (3, 1, 9, True), (3, 0, 9, False),  # faults[1]: every attempt, rank 1
    (1, 1, 4, False),
])
def test_each_fault_fires_on_its_attempt_rank_and_step_only(attempt, rank, step, fired):
    said = fires(TRAIN, attempt, rank, step)
    assert (said == f"injected failure at step {step} on rank {rank}") if fired else said is None, said


def test_a_listed_fault_that_never_fires_is_named_by_its_entry():
    train = {"faults": [{"at_step": 30, "rank": 0}, {"at_step": 0, "rank": 4, "attempt": 0}]}
    assert [k for k, _ in faults.listed_problems(train, steps=20, world=2)] == [
        "train.faults[0].at_step", "train.faults[1].at_step", "train.faults[1].rank", "train.faults[1].attempt"]
    assert faults.listed_problems(TRAIN, steps=20, world=2) == []  # train.fail_* has its own rows


def test_preflight_keeps_only_the_faults_a_shorter_run_reaches():
    assert faults.kept(TRAIN, steps=20, world=2) == ()
    assert faults.kept(TRAIN, steps=8, world=2) == ("train.faults=[{at_step:7,rank:0,mode:exception,attempt:2}]",)
    assert faults.kept(TRAIN, steps=2, world=1) == ("train.fail_at_step=null", "train.faults=[]")
    assert faults.kept({"fail_at_step": 3, "fail_rank": 0, "faults": []}, steps=8, world=1) == ()


def test_the_kept_override_composes_back_to_the_same_faults():
    """The override preflight writes is one Hydra parses into the same typed entries."""
    from hydra import compose, initialize_config_dir

    from launcher.app import CONF_DIR, normalize_overrides

    (override,) = faults.kept(TRAIN, steps=8, world=2)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=normalize_overrides([override, "train.fail_at_step=null"]))
    assert faults.faults(cfg.train) == [Fault(7, 0, "exception", 2, "train.faults[0]")]


def test_a_kill_in_save_drill_dies_on_each_listed_step_on_its_rank_and_attempt(tmp_path):
    from launcher.run.rundir import RunDir
    from launcher.training.checkpoint import Checkpointer

    rd = RunDir(tmp_path / "run")
    rd.path.mkdir()
    cfg = OmegaConf.create({"train": {"steps": 9, "fail_at_step": 2, "fail_rank": 0, "fail_mode": "kill_in_save",
                                      "fail_attempt": 1, "checkpoint": {"every": 0, "keep": 2, "async_save": False},
                                      "faults": [{"at_step": 5, "rank": 1, "mode": "kill_in_save", "attempt": 2}]}})

    def make(rank, attempt):
        ctx = SimpleNamespace(rundir=rd, rank=rank, world_size=2, attempt=attempt, device="cpu", heartbeat=None)
        return Checkpointer(cfg, ctx, engine=None, store=None)

    ck = make(rank=1, attempt=2)
    assert [s for s in range(1, 10) if ck.due(s)] == [2, 5, 9]  # every rank saves at each drill's step
    assert ck.kill_at == {5}
    assert make(rank=0, attempt=1).kill_at == {2}
    assert make(rank=0, attempt=2).kill_at == set() and make(rank=1, attempt=1).kill_at == set()
