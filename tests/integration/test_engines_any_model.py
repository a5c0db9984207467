"""launcher.training.engines on a real 2-process gloo group (CPU, fp32, dropout 0), for a plain user
module and a tiny Hugging Face LlamaForCausalLM (built from a LlamaConfig, never downloaded):

- DDP, FSDP2 (also with CPU offload and without resharding after the forward), ZeRO-2 and ZeRO-3
  losses over 4 steps (2 micro batches per rank per step) equal the
  single-process losses (one process, the same 8 samples a step) within fp32 rounding: the bound of
  the GPT's DeepSpeed-vs-DDP equivalence test (tests/integration/test_engine_deepspeed.py,
  FP32_LOSS_RTOL = 1e-6, ~2 ulp of the loss);
- a run checkpointed after step 2 by launcher.training.Checkpointer and resumed into fresh engines
  ends bitwise equal to the uninterrupted run: every rank's parameters and optimizer state (shards
  where the engine shards), and the losses of steps 3-4.

One pair of processes runs every case (DeepSpeed's import is paid once); each rank writes its results
with torch.save, compared here. Run as a script it is one rank of that worker.

And the GPT recipe on ``parallelism=fsdp`` (a real ``launch cluster=local`` on 2 processes) against the
shared single-process DDP reference of the engine-equivalence drills (tests/conftest.py).
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List

import pytest

REPO = Path(__file__).resolve().parent.parent.parent
FP32_LOSS_RTOL = 1e-6  # tests/integration/test_engine_deepspeed.py
STEPS, RESUME_AT = 4, 2
MICRO, ACCUM, SEQ, VOCAB = 2, 2, 8, 128  # per rank: 2 micro batches of 2 samples; global batch 8
MODELS = ("plain", "hf")
# case: (engine, ZeRO stage, parallelism.* options)
ENGINES = {"ddp": ("ddp", 0, {}), "fsdp": ("fsdp", 0, {}), "zero2": ("deepspeed", 2, {}), "zero3": ("deepspeed", 3, {}),
           # FSDP2's host offload, and gathered blocks kept from the forward to the backward (and after an eval)
           "fsdp_offload_keep": ("fsdp", 0, {"cpu_offload": True, "reshard_after_forward": False})}
# tensor parallelism over both ranks (dp 1 x tp 2) by the plain module's TP plan, FSDP2 over dp
TP_CASE = ("fsdp", 0, {"tp": 2})


# ---- the worker (one rank) ---------------------------------------------------------------------------

def _net():
    """A user module outside the engines' knowledge: embedding, a ModuleList of blocks, a head; its
    forward takes labels and returns the loss."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Block(nn.Module):
        def __init__(self, h: int) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(h)
            self.fc1, self.fc2 = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

        def forward(self, x):
            return x + self.fc2(F.gelu(self.fc1(self.norm(x))))

    class Net(nn.Module):
        def __init__(self, vocab: int = VOCAB, h: int = 32, layers: int = 2) -> None:
            super().__init__()
            self.emb = nn.Embedding(vocab, h)
            self.blocks = nn.ModuleList(Block(h) for _ in range(layers))
            self.head = nn.Linear(h, vocab)

        def forward(self, tokens, labels=None):
            x = self.emb(tokens)
            for b in self.blocks:
                x = b(x)
            logits = self.head(x)
            return logits if labels is None else F.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                                 labels.reshape(-1))

    del torch
    return Net()


def _tp_contract():
    """The plain module's contract with a TP plan: each block's fc1 split by columns, fc2 by rows."""
    import dataclasses

    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from launcher.training.engines import plain_contract

    return dataclasses.replace(plain_contract(_net()), tp_plan=lambda model: {
        "blocks.*.fc1": ColwiseParallel(), "blocks.*.fc2": RowwiseParallel()})


def _hf():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                        attention_dropout=0.0))


def _cfg(engine: str, stage: int, options: Dict[str, Any]) -> Any:
    from omegaconf import OmegaConf

    from launcher.config.schema import RunConfig

    return OmegaConf.merge(OmegaConf.structured(RunConfig), {
        "seed": 5, "zero": {"stage": stage}, "parallelism": {"engine": engine, **options},
        "optim": {"lr": 3e-3, "weight_decay": 0.1, "grad_clip": 0.5},
        "train": {"steps": STEPS, "micro_batch_size": MICRO, "global_batch_size": 8,
                  "checkpoint": {"every": 0, "keep": 2, "async_save": False}},
        "wandb": {"enabled": False}})


def _batches(step: int, dp: int, dp_rank: int):
    """Rank ``dp_rank``'s micro batches of ``step``'s global batch (8 samples, a function of the step)."""
    import torch

    g = torch.Generator().manual_seed(1000 + step)
    data = torch.randint(0, VOCAB, (MICRO * ACCUM * 2, SEQ + 1), generator=g)
    mine = data.chunk(dp)[dp_rank]
    return [(m[:, :-1].contiguous(), m[:, 1:].contiguous()) for m in mine.split(MICRO)]


def _ctx(rank: int, world: int, layout: Any, run_dir: Path):
    from launcher.run.rundir import RunDir
    from launcher.runtime.context import RunContext

    run_dir.mkdir(parents=True, exist_ok=True)
    return RunContext(rank=rank, world_size=world, local_rank=rank, local_world_size=world, node_rank=0,
                      hostname="h", rundir=RunDir(run_dir), layout=layout, device="cpu", backend="gloo")


def _train(model: str, engine: str, stage: int, rank: int, world: int, run_dir: Path, steps: int,
           options: Dict[str, Any]) -> Dict:
    """Train (resuming from run_dir's latest checkpoint, if any) through ``steps``; losses by step and
    this rank's final state."""
    from launcher.config.layout import Layout
    from launcher.training import Checkpointer, StepLoop
    from launcher.training.engines import build_engine

    cfg = _cfg(engine, stage, options)
    tp = int(options.get("tp", 1))
    layout = Layout(dp=world // tp, tp=tp, zero=stage, micro_batch_size=MICRO, grad_accum=ACCUM * 2 * tp // world,
                    engine=engine)
    ctx = _ctx(rank, world, layout, run_dir)
    eng = build_engine(cfg, ctx, _hf if model == "hf" else _net, _tp_contract() if tp > 1 else None)
    # (the single-process reference saves nothing: the Checkpointer's collectives are the whole group's)
    loop = StepLoop(cfg, ctx, Checkpointer(cfg, ctx, eng) if world > 1 else None, steps=steps)
    losses = {}
    for step in loop:
        loss, norm = eng.train_step(_batches(step, eng.dp, eng.dp_rank), lr=3e-3)
        losses[step] = loss
        loop.log(loss=loss, grad_norm=norm)
    ev = eng.eval_loss(_batches(99, eng.dp, eng.dp_rank))
    state = {k: v.detach().clone() for k, v in eng.local_state().items()}
    ctx.close()
    return {"losses": losses, "state": state, "eval": ev, "describe": eng.describe()}


def worker(rank: int, port: int, out: Path, cases: List[str]) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    results: Dict[str, Any] = {}
    for case in cases:
        model, name = case.split(":")
        if name == "single":  # rank 0 alone, no process group used
            if rank == 0:
                results[case] = _train(model, "ddp", 0, 0, 1, out / case, STEPS, {})
            dist.barrier()
            continue
        engine, stage, options = TP_CASE if name == "fsdp_tp2" else ENGINES[name]
        whole = _train(model, engine, stage, rank, 2, out / case / "whole", STEPS, options)
        _train(model, engine, stage, rank, 2, out / case / "resumed", RESUME_AT, options)  # saves after step 2
        resumed = _train(model, engine, stage, rank, 2, out / case / "resumed", STEPS, options)  # fresh engine
        results[case] = {"whole": whole, "resumed": resumed}
    torch.save(results, out / f"rank_{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


# ---- the test ------------------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_workers(out: Path, cases: List[str], timeout: float) -> List[Dict]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    port = _free_port()
    # (LOCAL_RANK, RANK, WORLD_SIZE: what the launcher's runtime sets for every rank; DeepSpeed asks for them)
    procs = [subprocess.Popen([sys.executable, __file__, str(r), str(port), str(out), ",".join(cases)],
                              env=dict(env, LOCAL_RANK=str(r), RANK=str(r), WORLD_SIZE="2"),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for r, p in enumerate(procs):
        assert p.returncode == 0, f"rank {r} exited {p.returncode}:\n" + "\n".join(logs)
    import torch

    return [torch.load(out / f"rank_{r}.pt", weights_only=False) for r in (0, 1)]


def _max_rel(xs: Dict[int, float], ref: Dict[int, float]) -> float:
    assert sorted(xs) == sorted(ref)
    return max(abs(xs[s] - ref[s]) / abs(ref[s]) for s in ref)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> List[Dict]:
    cases = [f"{m}:{e}" for m in MODELS for e in ("single", *ENGINES)] + ["plain:fsdp_tp2"]
    return _run_workers(tmp_path_factory.mktemp("engines"), cases, timeout=400)


@pytest.mark.dist
@pytest.mark.timeout(420)
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("engine", list(ENGINES))
def test_losses_equal_single_process_and_resume_is_bitwise(results, model, engine):
    _check(results, model, engine)


@pytest.mark.dist
@pytest.mark.timeout(420)
def test_tensor_parallel_plan_on_fsdp(results):
    """dp 1 x tp 2: the blocks' linears split over both ranks by the model's TP plan (torch's
    parallelize_module), FSDP2 over dp; the same losses and an exact resume."""
    _check(results, "plain", "fsdp_tp2")
    assert "tp=2" in results[0]["plain:fsdp_tp2"]["whole"]["describe"]


def _check(results, model: str, engine: str) -> None:
    import torch

    ref = results[0][f"{model}:single"]["losses"]
    assert ref[STEPS] < ref[1], ref  # it trains
    for rank in (0, 1):
        got = results[rank][f"{model}:{engine}"]
        whole, resumed = got["whole"], got["resumed"]
        dev = _max_rel(whole["losses"], ref)
        print(f"{model} {engine} rank {rank} ({whole['describe']}): max rel loss deviation {dev:.2e}")
        assert dev <= FP32_LOSS_RTOL, (whole["losses"], ref)
        # the resumed run redid steps 3-4 from the step-2 checkpoint: bitwise the uninterrupted run
        assert sorted(resumed["losses"]) == [3, 4]
        assert all(resumed["losses"][s] == whole["losses"][s] for s in (3, 4)), (resumed["losses"], whole["losses"])
        assert sorted(resumed["state"]) == sorted(whole["state"])
        assert any(k.startswith("optim.") for k in whole["state"])
        differ = [k for k, v in whole["state"].items() if not torch.equal(v, resumed["state"][k])]
        assert not differ, differ
        assert resumed["eval"] == whole["eval"]
        assert abs(whole["eval"] - results[0][f"{model}:single"]["eval"]) <= 1e-5 * abs(whole["eval"])


@pytest.mark.dist
@pytest.mark.timeout(600)
def test_gpt_recipe_on_fsdp_matches_single_process_ddp(equivalence_reference, tmp_path):
    """The GPT through the generic FSDP2 engine with its own init: the reference's losses within fp32
    rounding (10 steps, 16 samples a step, 4 micro batches per rank)."""
    from helpers import EQUIV_BASE, launch, read_metrics, runs_json

    res = launch([*EQUIV_BASE, "cluster.gpus_per_node=2", "parallelism=fsdp"], tmp_path / "runs", timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    (run,) = runs_json(tmp_path / "runs")
    assert run["status"] == "completed", run
    got = {r["step"]: r["loss"] for r in read_metrics(Path(run["dir"]))}
    ref = {r["step"]: r["loss"] for r in read_metrics(equivalence_reference)}
    dev = _max_rel(got, ref)
    print(f"gpt fsdp: max rel loss deviation from single-process DDP {dev:.2e}")
    assert dev <= FP32_LOSS_RTOL, (got, ref)
    assert ref[10] < ref[1] - 0.2


if __name__ == "__main__":
    worker(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]), sys.argv[4].split(","))
