"""Engine overhead: our recipe (launched with `launch`, cluster=local) vs a minimal hand-written
torch DDP loop on the same model, same process count, same batch shapes. Runs them alternately
(A B A B ...) so machine noise hits both, and prints the tokens/s ratio. Target: >= 0.95.

  .venv/bin/python benchmarks/engine_overhead.py [--procs 2] [--steps 30] [--rounds 3] [--engine ddp]

Tokens/s of each run is the median over its steps after the first 5 (warm-up).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MODEL = dict(num_layers=4, hidden_size=256, num_heads=4, ffn_hidden_size=1024, vocab_size=4096, seq_len=128)
MICRO, GLOBAL = 4, 16
WARMUP = 5


def _baseline_worker(rank: int, world: int, port: int, steps: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist
    from omegaconf import OmegaConf

    from recipes.gpt.model import GPT

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = GPT(OmegaConf.create(MODEL))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    accum = GLOBAL // (world * MICRO)
    g = torch.Generator().manual_seed(rank)
    data = [torch.randint(0, MODEL["vocab_size"], (MICRO, MODEL["seq_len"] + 1), generator=g) for _ in range(accum)]
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        for k, batch in enumerate(data):
            ctx = ddp.no_sync() if k < accum - 1 else torch.enable_grad()
            with ctx:
                loss = ddp(batch[:, :-1], labels=batch[:, 1:]) / accum
                loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        reduced = loss.detach().clone()
        dist.all_reduce(reduced)
        reduced.item()
        times.append(time.perf_counter() - t0)
    if rank == 0:
        Path(out).write_text(json.dumps(times))
    dist.destroy_process_group()


def baseline(procs: int, steps: int) -> float:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    mp.spawn(_baseline_worker, args=(procs, port, steps, out), nprocs=procs, join=True)
    times = json.loads(Path(out).read_text())[WARMUP:]
    return GLOBAL * MODEL["seq_len"] / statistics.median(times)


def ours(procs: int, steps: int, engine: str, root: Path) -> float:
    overrides = [f"model.{k}={v}" for k, v in MODEL.items()] + [
        "cluster=local", f"cluster.gpus_per_node={procs}", f"train.steps={steps}", f"parallelism.engine={engine}",
        f"train.micro_batch_size={MICRO}", f"train.global_batch_size={GLOBAL}", "train.log_interval=0",
    ]
    env = dict(os.environ, LAUNCHER_RUNS=str(root))
    res = subprocess.run([str(Path(sys.executable).parent / "launch"), *overrides], capture_output=True, text=True,
                         env=env, timeout=900)
    if res.returncode != 0:
        raise SystemExit(f"launch failed:\n{res.stdout[-2000:]}\n{res.stderr[-2000:]}")
    metrics = sorted(root.glob("*/*/metrics.jsonl"), key=lambda p: p.stat().st_mtime)[-1]
    rows = [json.loads(line) for line in metrics.read_text().splitlines()][WARMUP:]
    return statistics.median(r["tokens_per_s"] for r in rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--engine", default="ddp", help="our engine to compare (ddp, deepspeed with zero=...)")
    args = ap.parse_args()
    sys.path.insert(0, str(REPO))
    ratios = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            b = baseline(args.procs, args.steps)
            o = ours(args.procs, args.steps, args.engine, Path(tmp))
            ratios.append(o / b)
            print(f"round {r + 1}: hand-written DDP {b:,.0f} tok/s | ours ({args.engine}) {o:,.0f} tok/s | "
                  f"ratio {o / b:.3f}", flush=True)
    med = statistics.median(ratios)
    print(f"tokens/s ratio ours/baseline (median of {args.rounds}): {med:.3f}  target >= 0.95  "
          f"{'PASS' if med >= 0.95 else 'BELOW TARGET'}")


if __name__ == "__main__":
    main()
