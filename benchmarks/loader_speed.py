"""Loader speed: tokens/s the data=tokens loader delivers (launcher.data.tokens.TokenDataset read through
recipes.common.data.train_batches and the step loop's Prefetch thread) against tokens/s the fastest CPU
training step of gpt_tiny consumes, measured side by side in this process.

  .venv/bin/python benchmarks/loader_speed.py [--tokens 20000000] [--steps 200] [--batches 16,64,256]

Builds a prepared dataset of random documents (manifest.write_dataset, --tokens tokens, uint16, several
shards) in a temporary dir; a blend of it with itself (weights 3:1) when --blend. For each global batch
of --batches (gpt_tiny: seq_len 64, one process, micro batch = the batch), times:
- train: gpt_tiny forward + backward + AdamW step (fp32, all cores), the median of --train-steps steps
  after two warm-up steps: batch * seq_len / step time = what the step consumes;
- loader: ``Prefetch(train_batches(...)).get(step)`` for --steps consecutive steps with no training in
  between (the loader alone, as fast as it can go: the background thread and the caller both busy).
Prints both and their ratio per batch, then the fastest training step's consumption against the
loader at that batch (the issue's bar: >= 20x).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from launcher.config.layout import Layout  # noqa: E402
from launcher.data.manifest import write_dataset  # noqa: E402
from recipes.common.data import Prefetch, train_batches  # noqa: E402
from recipes.gpt.model import GPT  # noqa: E402

MODEL = OmegaConf.load(REPO / "conf" / "model" / "gpt_tiny.yaml")


def build_dataset(out: Path, tokens: int, vocab: int, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(50, 2000, size=tokens // 1000 + 1)
    lengths = lengths[np.cumsum(lengths) <= tokens]
    flat = rng.integers(1, vocab, size=int(lengths.sum()))
    docs = np.split(flat, np.cumsum(lengths)[:-1])
    write_dataset(out, {"train": docs}, vocab_size=vocab, eos_id=0, shard_tokens=4_000_000)
    return out


def train_tokens_per_s(batch: int, steps: int) -> float:
    torch.manual_seed(0)
    model = GPT(MODEL, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    seq = int(MODEL.seq_len)
    tokens = torch.randint(0, int(MODEL.vocab_size), (batch, seq))
    labels = torch.randint(0, int(MODEL.vocab_size), (batch, seq))
    times = []
    for k in range(steps + 2):
        t0 = time.perf_counter()
        model(tokens, labels=labels).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if k >= 2:
            times.append(time.perf_counter() - t0)
    return batch * seq / statistics.median(times)


def loader_tokens_per_s(cfg, batch: int, steps: int) -> float:
    layout = Layout(dp=1, micro_batch_size=batch, grad_accum=1)
    seq = int(MODEL.seq_len)
    data = train_batches(cfg, layout, 0, seq_len=seq, vocab_size=int(MODEL.vocab_size))
    prefetch = Prefetch(data, last=steps)
    try:
        prefetch.get(1)  # the first step is made inline; then one step ahead in the thread, as in training
        t0 = time.perf_counter()
        for step in range(2, steps + 1):
            prefetch.get(step)
        elapsed = time.perf_counter() - t0
    finally:
        prefetch.close()
    return (steps - 1) * batch * seq / elapsed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=20_000_000)
    ap.add_argument("--steps", type=int, default=200, help="loader steps timed per batch")
    ap.add_argument("--train-steps", type=int, default=10, help="training steps timed per batch")
    ap.add_argument("--batches", default="16,64,256")
    ap.add_argument("--blend", action="store_true", help="read a 3:1 blend of the dataset with itself")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; gpt_tiny seq_len {MODEL.seq_len}")
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        path = build_dataset(Path(tmp) / "ds", args.tokens, int(MODEL.vocab_size))
        print(f"dataset: {args.tokens:,} tokens written in {time.perf_counter() - t0:.1f} s")
        data = {"name": "tokens", "seed": None, "path": str(path), "packing": True, "blend": []}
        if args.blend:
            data["blend"] = [{"path": str(path), "weight": 3.0}, {"path": str(path), "weight": 1.0}]
        cfg = OmegaConf.create({"seed": 1, "data": data})
        rows = []
        for b in batches:
            train = train_tokens_per_s(b, args.train_steps)
            loader = loader_tokens_per_s(cfg, b, args.steps)
            rows.append((b, train, loader))
            print(f"batch {b:4d}: train step consumes {train:12,.0f} tok/s   loader {loader:14,.0f} tok/s   "
                  f"ratio {loader / train:7.1f}x", flush=True)
    fastest = max(rows, key=lambda r: r[1])
    print(f"fastest training step (batch {fastest[0]}): {fastest[1]:,.0f} tok/s; the loader at that batch "
          f"{fastest[2]:,.0f} tok/s = {fastest[2] / fastest[1]:.1f}x (bar: 20x); slowest loader "
          f"{min(r[2] for r in rows):,.0f} tok/s = {min(r[2] for r in rows) / fastest[1]:.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
