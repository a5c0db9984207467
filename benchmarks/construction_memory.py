"""Construction memory: what building the model costs each rank, whole vs shard-first.

Runs, as real `launch cluster=local` runs on CPU (fp32), a GPT of a few hundred million parameters
(default: GPT-3 Medium's shape, 24 x 1024, ~356M parameters, 1.42 GB in fp32):

  (a) one process building it whole (engine ddp: the whole GPT, initialised),
  (a') one process, engine megatron with tp = pp = 1 (shard-first with one shard: the whole model),
  (b) megatron tp2 x pp2 on 4 local ranks (each rank builds only its slices and stage),
  (c) DeepSpeed ZeRO-3 on 4 local ranks (built inside zero.Init, partitions filled from the init),

each with the build-only recipe below (``build_only``: the engine is constructed, nothing trained),
reads every rank's ``host_peak_build_bytes`` (ranks/state_<r>.json: the peak resident memory during
the model's construction minus the resident memory before it, recipes.common.memory) and prints
them side by side with the ratio of each run's largest rank to the whole build (a). Beside it, what
the planner estimated per rank (plan.json, layouts[0].memory_bytes) against what stayed resident.

  .venv/bin/python benchmarks/construction_memory.py [--layers 24 --hidden 1024 --heads 16]
        [--runs a,a1,b,c] [--json out.json]

The build-only recipe is also what tests/integration/test_shard_first_real.py launches, with
``+recipe.params.dump_weights=true``: every rank writes the weights it built (its shards, or for
ZeRO-3 the gathered parameters) under <run>/built_weights/, and ``gather_weights`` puts them back
together into full tensors.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

REPO = Path(__file__).resolve().parent.parent
TARGET = "benchmarks.construction_memory.build_only"
DUMP_DIR = "built_weights"
GB = 1e9

# ---------------------------------------------------------------------------------------------------
# the build-only recipe (runs in every rank)


def build_only(cfg: Any, ctx: Any) -> Dict[str, Any]:
    """Build the GPT recipe's engine for ``cfg`` (model, optimizer, DeepSpeed / mesh set-up) and stop:
    no step. Records in ranks/state_<r>.json what the model's construction used (the engine's
    ``build_meter``), the resident memory once the whole engine stands (``host_rss_after_engine_bytes``:
    with DeepSpeed's optimizer partitions) and the parameter bytes the rank holds. With
    ``recipe.params.dump_weights``, writes the weights it built (``dump_weights``)."""
    import torch.distributed as dist

    from recipes.common.memory import host_rss_bytes
    from recipes.gpt.engines import build_engine

    t0 = time.perf_counter()
    engine = build_engine(cfg, ctx)
    build_s = time.perf_counter() - t0
    after_engine = host_rss_bytes()
    params = dict(cfg.recipe.params or {})
    if params.get("dump_weights"):
        dump_weights(engine, Path(ctx.run_dir) / DUMP_DIR, int(ctx.rank))
    built = engine.build_meter.record() if engine.build_meter is not None else {}
    ctx.rundir.write_state(int(ctx.rank), {
        "rank": int(ctx.rank), "pp_stage": ctx.layout.coords(int(ctx.rank))[1], "dp_rank": engine.dp_rank,
        "params": engine.state_bytes()["params"], **built, "host_rss_after_engine_bytes": after_engine,
        "engine_build_s": build_s,
    })
    if dist.is_initialized():
        dist.barrier()
    return {"steps": 0, "params": engine.num_params, "world_size": int(ctx.world_size), "engine": engine.describe()}


# ---------------------------------------------------------------------------------------------------
# the built weights: written per rank, gathered into full tensors


def _index(sel: Any, n: int) -> Any:
    """A row / column selection (None, a slice, indices) as a LongTensor of indices into range(n)."""
    import torch

    if sel is None:
        return torch.arange(n)
    if isinstance(sel, slice):
        return torch.arange(n)[sel]
    return torch.as_tensor(sel, dtype=torch.long).reshape(-1)


def _entry(name: str, shape: Tuple[int, ...], values: Any, rows: Any = None, cols: Any = None) -> Dict[str, Any]:
    shape = tuple(int(s) for s in shape)
    return {"name": name, "shape": shape, "rows": _index(rows, shape[0]),
            "cols": _index(cols, shape[1]) if len(shape) > 1 else None,
            "values": values.detach().to("cpu").clone()}


def dump_weights(engine: Any, out: Path, rank: int) -> None:
    """<out>/rank_<r>.pt: a list of {name (GPT.named_parameters() name), shape (the full parameter's),
    rows, cols (indices into the full parameter), values} for what this rank built. Megatron: every
    shard of data-parallel rank 0 of each (pp, tp) place, where it sits in the full parameter
    (``init_spec``); ZeRO-3: the parameters gathered by DeepSpeed (zero.GatheredParameters, a
    collective: every rank joins), written by rank 0; ddp and ZeRO 0-2: rank 0's full parameters."""
    import torch

    entries: List[Dict[str, Any]] = []
    if hasattr(engine, "stage") and hasattr(engine, "mesh"):  # MegatronEngine
        from recipes.gpt.parallel.tensor_parallel import source

        if engine.dp_rank == 0:
            for p in engine.stage.parameters():  # (a tied head is its embedding's parameter: listed once)
                name, shape = source(p)
                spec = getattr(p, "init_spec", None)
                rows, cols = (spec[2], spec[3]) if spec is not None else (None, None)
                entries.append(_entry(name, shape, p, rows, cols))
    elif hasattr(engine, "ds") and getattr(engine, "stage", 0) == 3:  # DeepSpeed ZeRO-3
        import deepspeed

        named = list(engine.module.named_parameters())
        with deepspeed.zero.GatheredParameters([p for _, p in named]):
            if rank == 0:
                entries = [_entry(n, tuple(p.ds_shape), p.reshape(p.ds_shape)) for n, p in named]
    else:
        module = engine.module if hasattr(engine, "ds") else engine.model
        if rank == 0:
            entries = [_entry(n, tuple(p.shape), p) for n, p in module.named_parameters()]
    out.mkdir(parents=True, exist_ok=True)
    torch.save(entries, out / f"rank_{rank}.pt")


def _bits(t: Any) -> Any:
    """The tensor's bytes: equal bits, not equal values (-0.0 is not 0.0, a NaN equals itself)."""
    import torch

    return t.contiguous().reshape(-1).view(torch.uint8)


def gather_weights(dump_dir: Path) -> Dict[str, Any]:
    """The full parameters put together from every rank's dump (``dump_weights``): name -> tensor.
    Fails where an element is written by no rank, or by two ranks with different bits (replicas:
    tp-replicated norms and biases, the last stage's copy of a tied embedding)."""
    import torch

    full: Dict[str, torch.Tensor] = {}
    written: Dict[str, torch.Tensor] = {}
    for path in sorted(Path(dump_dir).glob("rank_*.pt")):
        for e in torch.load(path, weights_only=True):
            name, shape = e["name"], tuple(e["shape"])
            if name not in full:
                full[name] = torch.zeros(shape, dtype=e["values"].dtype)
                written[name] = torch.zeros(shape, dtype=torch.bool)
            idx = (e["rows"],) if e["cols"] is None else (e["rows"][:, None], e["cols"][None, :])
            values = e["values"].reshape(len(e["rows"]), *(() if e["cols"] is None else (len(e["cols"]),)),
                                         *shape[2:])
            seen = written[name][idx]
            if seen.any() and not torch.equal(_bits(full[name][idx][seen]), _bits(values[seen])):
                raise AssertionError(f"{name}: two ranks built different values for the same elements ({path.name})")
            full[name][idx] = values
            written[name][idx] = True
    missing = [n for n, w in written.items() if not bool(w.all())]
    if missing:
        raise AssertionError(f"no rank built every element of {missing}")
    return full


# ---------------------------------------------------------------------------------------------------
# the benchmark (runs in this process: launches the runs, reads their records)

RUNS = {
    # key: (label, processes, overrides)
    "a": ("(a) whole, 1 process (ddp)", 1, ["parallelism.engine=ddp"]),
    "a1": ("(a') megatron tp1 x pp1, 1 process", 1, ["parallelism.engine=megatron"]),
    "b": ("(b) megatron tp2 x pp2, 4 ranks", 4, ["parallelism=3d"]),
    "c": ("(c) ZeRO-3, 4 ranks", 4, ["zero=3"]),
}


def _model_overrides(args: argparse.Namespace) -> List[str]:
    return ["model=gpt_125m", f"model.name=gpt_{args.layers}x{args.hidden}", f"model.num_layers={args.layers}",
            f"model.hidden_size={args.hidden}", f"model.num_heads={args.heads}",
            f"model.ffn_hidden_size={4 * args.hidden}", f"model.seq_len={args.seq_len}"]


def _launch(overrides: List[str], procs: int, root: Path) -> Path:
    env = dict(os.environ, LAUNCHER_RUNS=str(root), PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    cmd = [str(Path(sys.executable).parent / "launch"), "precision=fp32", "seed=1", "cluster=local",
           f"cluster.gpus_per_node={procs}", "wandb.enabled=false", "train.steps=1", "train.micro_batch_size=1",
           f"train.global_batch_size={procs}", f"recipe._target_={TARGET}", *overrides]
    t0 = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=str(root.parent), timeout=1800)
    if res.returncode != 0:
        raise SystemExit(f"launch failed ({' '.join(cmd)}):\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
    runs = sorted(p.parent for p in root.glob("*/*/run.json"))
    print(f"  {' '.join(overrides)} on {procs}: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return max(runs, key=lambda p: p.stat().st_mtime)


def _read(run: Path) -> Dict[str, Any]:
    states = {}
    for p in sorted((run / "ranks").glob("state_*.json")):
        st = json.loads(p.read_text())
        states[int(st["rank"])] = st
    plan = json.loads((run / "plan.json").read_text()) if (run / "plan.json").exists() else {}
    layouts = plan.get("layouts") or [{}]
    return {"dir": str(run), "states": states, "planned": layouts[0].get("memory_bytes") or {},
            "params": (json.loads((run / "status.json").read_text()).get("summary") or {}).get("params")}


def _machine() -> str:
    mem = ""
    try:
        kib = int(next(line for line in open("/proc/meminfo") if line.startswith("MemTotal")).split()[1])
        mem = f", {kib / 1024 ** 2:.0f} GiB RAM"
    except (OSError, StopIteration, ValueError):
        pass
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    import torch

    return f"{cpu}, {os.cpu_count()} cores{mem}; Linux {platform.release()}; torch {torch.__version__}"


def report(results: Dict[str, Dict[str, Any]], whole_key: str = "a") -> str:
    """The table: per run, each rank's construction peak, the largest over ranks and its ratio to
    the whole build; what stayed resident after construction and after the whole engine against
    the planner's per-rank parameters and model states."""
    mb = lambda b: f"{b / 1e6:,.0f}"  # noqa: E731
    whole = (max(s["host_peak_build_bytes"] for s in results[whole_key]["states"].values())
             if whole_key in results else None)
    lines = ["| run | per-rank construction peak, MB (host_peak_build_bytes) | largest | ratio to (a) | "
             "resident after construction, MB | planner params/rank, MB | resident after engine, MB | "
             "planner params+grads+optimizer/rank, MB |",
             "|---|---|---|---|---|---|---|---|"]
    for key, res in results.items():
        st = [res["states"][r] for r in sorted(res["states"])]
        peaks = [s["host_peak_build_bytes"] for s in st]
        kept = [s["host_rss_after_build_bytes"] - s["host_rss_before_build_bytes"] for s in st]
        engine = [s["host_rss_after_engine_bytes"] - s["host_rss_before_build_bytes"] for s in st]
        plan = res["planned"]
        ratio = f"{max(peaks) / whole:.3f}" if whole else "-"
        lines.append(
            f"| {RUNS[key][0]} | {' / '.join(mb(p) for p in peaks)} | {mb(max(peaks))} | {ratio} | "
            f"{' / '.join(mb(k) for k in kept)} | {mb(plan.get('params', 0))} | {' / '.join(mb(e) for e in engine)} | "
            f"{mb(sum(plan.get(k, 0) for k in ('params', 'grads', 'optimizer')))} |")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--runs", default="a,a1,b,c", help="which of a, a1, b, c (comma separated)")
    ap.add_argument("--target", type=float, default=0.35, help="the ratio (b) and (c) must not exceed")
    ap.add_argument("--json", help="write the per-rank records here")
    args = ap.parse_args(argv)

    keys = [k for k in args.runs.split(",") if k]
    results: Dict[str, Dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="construction-memory-") as tmp:
        for key in keys:
            label, procs, overrides = RUNS[key]
            root = Path(tmp) / key / "runs"
            root.mkdir(parents=True)
            results[key] = _read(_launch([*_model_overrides(args), *overrides], procs, root))
    params = next((r["params"] for r in results.values() if r["params"]), None)
    print(f"machine: {_machine()}")
    args = " ".join(argv if argv is not None else sys.argv[1:])
    print(f"command: .venv/bin/python benchmarks/construction_memory.py {args}")
    print(f"model: {args.layers} layers x {args.hidden} hidden, {args.heads} heads, seq_len {args.seq_len}, "
          f"vocab 50304, fp32: {params:,} parameters, {params * 4 / GB:.2f} GB" if params else "")
    print()
    print(report(results))
    verdicts = []
    if "a" in results:
        whole = max(s["host_peak_build_bytes"] for s in results["a"]["states"].values())
        for key in ("b", "c"):
            if key in results:
                worst = max(s["host_peak_build_bytes"] for s in results[key]["states"].values())
                ok = worst / whole <= args.target
                verdicts.append(ok)
                print(f"{RUNS[key][0]}: largest rank {worst / whole:.3f} of the whole build "
                      f"({'meets' if ok else 'MISSES'} the target <= {args.target})")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0 if all(verdicts) else 1


if __name__ == "__main__":
    raise SystemExit(main())
