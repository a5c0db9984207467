"""What one training step costs in collectives and host reads, per engine, on two real gloo ranks.

A probe wraps every torch.distributed collective (its name, dtype and bytes, and who called it) and
every host read of a tensor (``item``, ``tolist``, ``__bool__``, ``__float__``, ``__int__``, ``cpu``)
and ``torch.cuda.synchronize`` (``read:<caller>:synchronize``) in the training thread, and the order of
the project's reads and AdamW's steps, windowed by the loop's heartbeat (one window = the stop
agreement of one step and the whole of the next). On a GPU each host read of a device tensor is a
device sync; on this CPU they are counted where they would be. Counts are by caller: ``project`` (the
launcher and the recipes), ``torch`` (e.g. ZeroRedundancyOptimizer's broadcasts, AdamW's CPU step
counters) or ``deepspeed``. Each case prints its counts (``-s``); docs/performance.md records them.
"""
from __future__ import annotations

import json
import os
import sys
import threading
from collections import Counter
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from omegaconf import OmegaConf

from launcher.runtime.context import STOP_VOTES

pytestmark = pytest.mark.dist

REPO = Path(__file__).resolve().parent.parent.parent
COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter",
               "reduce_scatter_tensor", "all_to_all_single", "send", "recv", "isend", "irecv",
               "batch_isend_irecv", "barrier", "all_gather_object", "broadcast_object_list")
READS = ("item", "tolist", "__bool__", "__float__", "__int__", "cpu")


def _area() -> str:
    """Who called: the first frame outside this file and torch.distributed's wrappers."""
    f = sys._getframe(2)
    while f is not None:
        name = f.f_code.co_filename
        if name != __file__ and not any(w in name for w in ("torch/distributed/c10d_logger",
                                                               "torch/distributed/distributed_c10d")):
            break
        f = f.f_back
    name = f.f_code.co_filename if f is not None else ""
    if name.startswith(str(REPO / "launcher")) or name.startswith(str(REPO / "recipes")):
        return "project"
    return "deepspeed" if "/deepspeed/" in name else "torch"


def _payload(name: str, args: tuple, kwargs: Dict[str, Any]) -> Any:
    """The tensor a collective sends (the input of a gather or scatter into one tensor)."""
    if name in ("all_gather_into_tensor", "reduce_scatter_tensor"):
        return args[1] if len(args) > 1 else kwargs.get("input_tensor", kwargs.get("input"))
    return args[0] if args else kwargs.get("tensor")


class Probe:
    """Counts per heartbeat window; ``beat`` is the watchdog's (``RunContext.heartbeat``)."""

    def __init__(self) -> None:
        self.thread = threading.get_ident()
        self.current: Counter = Counter()
        self.bytes: Counter = Counter()
        self.windows: List[Dict[str, Any]] = []
        self.order: List[str] = []  # "read" (the project's) and "optimizer" (AdamW.step), as they came
        self._busy = False

    def _note(self, key: str, nbytes: int = 0) -> None:
        if threading.get_ident() != self.thread or self._busy:
            return
        self._busy = True  # (a read inside a counted call is the call's own business)
        try:
            self.current[key] += 1
            self.bytes[key] += nbytes
        finally:
            self._busy = False

    def install(self) -> Probe:
        probe = self

        def collective(name: str, real: Any) -> Any:
            def wrapped(*args: Any, **kwargs: Any) -> Any:
                if not probe._busy:
                    tensor = _payload(name, args, kwargs)
                    nbytes = tensor.numel() * tensor.element_size() if torch.is_tensor(tensor) else 0
                    dtype = str(tensor.dtype).removeprefix("torch.") if torch.is_tensor(tensor) else "-"
                    probe._note(f"collective:{_area()}:{name}:{dtype}", nbytes)
                was, probe._busy = probe._busy, True
                try:
                    return real(*args, **kwargs)
                finally:
                    probe._busy = was
            return wrapped

        for name in COLLECTIVES:
            if hasattr(dist, name):
                setattr(dist, name, collective(name, getattr(dist, name)))

        def read(name: str, real: Any) -> Any:
            def wrapped(*args: Any, **kwargs: Any) -> Any:
                area = _area()
                probe._note(f"read:{area}:{name}")
                if area == "project" and threading.get_ident() == probe.thread and not probe._busy:
                    probe.order.append("read")
                return real(*args, **kwargs)
            return wrapped

        real_step = torch.optim.AdamW.step

        def step(*args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() == probe.thread:
                probe.order.append("optimizer")
            return real_step(*args, **kwargs)

        torch.optim.AdamW.step = step

        for name in READS:
            setattr(torch.Tensor, name, read(name, getattr(torch.Tensor, name)))
        torch.cuda.synchronize = read("synchronize", torch.cuda.synchronize)
        return self

    def beat(self, step: Any = None) -> None:
        self.windows.append({"step": step, "counts": dict(self.current), "bytes": dict(self.bytes),
                             "order": self.order})
        self.current, self.bytes, self.order = Counter(), Counter(), []


def _worker(rank: int, world: int, cfgs: Dict[str, str], root: str) -> None:
    """Every case in the same two processes, one after another (imports and the group made once)."""
    torch.set_num_threads(1)
    sys.path.insert(0, str(REPO / "tests"))
    from recipes.gpt.schema import GPTRunConfig
    from recipes.gpt.train import main
    from unit.test_gpt_recipe import make_ctx

    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world))  # DeepSpeed asks for them
    dist.init_process_group("gloo", init_method=f"file://{root}/store", rank=rank, world_size=world)
    probe = Probe().install()
    try:
        for name, cfg_yaml in cfgs.items():
            run_dir = Path(root) / name
            run_dir.mkdir(exist_ok=True)
            cfg = OmegaConf.merge(OmegaConf.structured(GPTRunConfig), OmegaConf.create(cfg_yaml))
            ctx = make_ctx(cfg, run_dir, rank=rank, world_size=world)
            probe.windows, probe.current, probe.bytes, probe.order = [], Counter(), Counter(), []
            ctx.watch = probe
            try:
                main(cfg, ctx)
            finally:
                ctx.close()
            (run_dir / f"probe{rank}.json").write_text(json.dumps(probe.windows))
            dist.barrier()
    finally:
        dist.destroy_process_group()


def _cfg(**sections: Any) -> str:
    sys.path.insert(0, str(REPO / "tests"))
    from unit.test_gpt_recipe import make_cfg

    cfg = make_cfg(train={"steps": 5, "checkpoint": {"every": 0}}, data={"eval_every": 0}, **sections)
    return OmegaConf.to_yaml(cfg)


def per_step(root: Path, name: str) -> Dict[str, Any]:
    """Rank 0's counts in the steady windows (between the heartbeats of steps 2..4 of 5), per step,
    checked equal in each window."""
    windows = json.loads((root / name / "probe0.json").read_text())
    steady = [w for w in windows if w["step"] in (3, 4)]  # the windows after step 2's and 3's heartbeats
    assert len(steady) == 2 and steady[0]["counts"] == steady[1]["counts"], windows
    counts, nbytes = steady[0]["counts"], steady[0]["bytes"]
    print(f"\n[step probe] {name} order: {steady[0]['order']}")
    print(f"\n[step probe] {name}\n  " + "\n  ".join(
        f"{k}: {v}" + (f" ({nbytes[k]} B)" if nbytes.get(k) else "") for k, v in sorted(counts.items())))
    return {"counts": counts, "bytes": nbytes, "order": steady[0]["order"]}


def _sum(counts: Dict[str, int], prefix: str) -> int:
    return sum(v for k, v in counts.items() if k.startswith(prefix))


BF16 = {"dtype": "bf16"}
CASES = {  # case: (config sections, the project's collectives per step)
    "ddp": ({"precision": BF16}, 1),  # the loss all-reduce, carrying the stop votes (DDP's own buckets are C++)
    "fsdp": ({"parallelism": {"engine": "fsdp"}}, 1),
    "deepspeed_zero2": ({"zero": {"stage": 2}}, 1),
    "megatron_dp2": ({"parallelism": {"engine": "megatron"}, "precision": BF16}, 2),  # + one gradient bucket
    "megatron_dp2_zero1": ({"parallelism": {"engine": "megatron"}, "zero": {"stage": 1}}, 2),
}
HALF = {"precision": {"dtype": "bf16", "grad_reduce_dtype": "bf16"}}
RUNS = {**{name: sections for name, (sections, _) in CASES.items()},
        "ddp_bf16_reduce": {**HALF}, "megatron_dp2_bf16_reduce": {"parallelism": {"engine": "megatron"}, **HALF}}


@pytest.fixture(scope="module")
def probed(tmp_path_factory) -> Path:
    """Every run of this module in one spawn of two gloo ranks."""
    root = tmp_path_factory.mktemp("step_syncs")
    mp.spawn(_worker, args=(2, {name: _cfg(**sections) for name, sections in RUNS.items()}, str(root)),
             nprocs=2, join=True)
    return root


@pytest.mark.timeout(900)
@pytest.mark.parametrize("case", list(CASES))
def test_one_collective_and_one_host_read_per_step(probed, case):
    """Per steady step: the project's collectives are the loss (+ stop votes) all-reduce and the
    engine's own gradient reductions, nothing for the stop; its host waits are the one read of the
    step's stats and nothing else: no ``torch.cuda.synchronize`` (the loop times the step to that
    read, megatron steps its optimizer before it)."""
    _, collectives = CASES[case]
    probe = per_step(probed, case)
    got = probe["counts"]
    assert probe["order"][-1:] == ["read"] and "optimizer" in probe["order"], probe["order"]  # the read waits
    assert _sum(got, "collective:project:") == collectives, got
    reads = {k: v for k, v in got.items() if k.startswith("read:project:")}
    assert got.get("read:project:synchronize", 0) == 0, reads
    assert reads == {"read:project:tolist": 1}, reads


STEP_PATH = ["recipes/gpt/train.py", "recipes/lm/train.py", "recipes/common/phases.py",
             *sorted(str(p.relative_to(REPO)) for d in ("recipes/gpt/engines", "launcher/training/engines")
                     for p in (REPO / d).glob("*.py"))]


def test_the_step_path_never_synchronizes_the_device():
    """What the CPU probe cannot see: a ``torch.cuda.synchronize`` behind a CUDA-only branch of the
    loops, the phase timer or the engines (on a GPU a second host wait per step)."""
    calls = [f"{name}:{i}" for name in STEP_PATH
             for i, line in enumerate((REPO / name).read_text().splitlines(), 1)
             if "cuda.synchronize(" in line.split("#")[0]]
    assert not calls, calls


PARAMS = 19_712  # the tiny GPT's parameters (tests/unit/test_gpt_recipe.py's TINY_MODEL)


def _bytes(got: Dict[str, Any], dtype: str) -> int:
    """Bytes per step of the collectives in ``dtype``."""
    return sum(b for k, b in got["bytes"].items() if k.startswith("collective:") and k.endswith(":" + dtype))


@pytest.mark.timeout(900)
@pytest.mark.parametrize("engine", ["ddp", "megatron"])
def test_bf16_gradient_reduction_halves_the_bytes(probed, engine):
    """precision.grad_reduce_dtype=bf16: every gradient crosses once, in bf16 (2 B per parameter:
    DDP's compression hook, the megatron engine's buckets); fp32 (the default) sends none in bf16,
    and the megatron buckets carry 4 B per parameter."""
    name = "ddp" if engine == "ddp" else "megatron_dp2"
    exact, half = per_step(probed, name), per_step(probed, f"{name}_bf16_reduce")
    assert _bytes(exact, "bfloat16") == 0
    assert _bytes(half, "bfloat16") == 2 * PARAMS
    assert _bytes(half, "float32") <= 4 * (2 + STOP_VOTES)  # the step's stats (loss, norm, stop votes) only
    if engine == "megatron":  # (DDP's own fp32 buckets are reduced in C++, out of the probe's sight)
        assert _bytes(exact, "float32") - _bytes(half, "float32") == 4 * PARAMS


@pytest.mark.timeout(900)
def test_zero1_broadcasts_one_bucket_per_owner(probed):
    """megatron ZeRO-1: after the step each of the 2 dp ranks broadcasts its updated shard as one flat
    bucket (ZeroRedundancyOptimizer with parameters as bucket views), every parameter's bytes once."""
    got = per_step(probed, "megatron_dp2_zero1")
    assert got["counts"].get("collective:torch:broadcast:float32") == 2, got["counts"]
    assert got["bytes"]["collective:torch:broadcast:float32"] == 4 * PARAMS
