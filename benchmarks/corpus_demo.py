"""A corpus from text already on this machine, prepared and trained on (issue 21): the Python standard
library's sources and docs (the directory of the `os` module: *.py, *.txt, *.rst; site-packages left
out, as benchmarks/data_prepare.py takes them), prepared with the real `launcher data prepare`, then
gpt_tiny (the default recipe) and hf_llama_tiny (`recipe=lm`) each trained on it by the real `launch`
(cluster=local, one process, data=tokens with periodic eval loss).

  .venv/bin/python benchmarks/corpus_demo.py [--vocab-size 4096] [--gpt-steps 600] [--llama-steps 600]
                                             [--batch 32] [--keep DIR] [--out table.md]

Prints the prepare throughput (tokens/s), the unigram entropy of the train and val splits (nats per
token: the loss of the best model that ignores context) and per model its first and final train loss,
its eval losses and its training tokens/s, as markdown (also written to --out).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from data_prepare import GLOBS, corpus  # noqa: E402  (this directory: the same corpus as the prepare benchmark)

from launcher.data.manifest import Manifest  # noqa: E402
from launcher.data.stats import unigram_entropy  # noqa: E402

BIN = Path(sys.executable).parent
MODELS = {"gpt_tiny": ["model=gpt_tiny"], "hf_llama_tiny": ["recipe=lm", "model=hf_llama_tiny"]}


def _env(runs: Path) -> Dict[str, str]:
    return dict(os.environ, LAUNCHER_RUNS=str(runs), PYTHONUNBUFFERED="1",
                PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))


def prepare(out: Path, vocab: int, runs: Path) -> Manifest:
    cmd = [str(BIN / "launcher"), "data", "prepare", *corpus(), "-o", str(out), "--vocab-size", str(vocab),
           "--no-progress"]
    for g in GLOBS:
        cmd += ["--glob", g]
    res = subprocess.run(cmd, capture_output=True, text=True, env=_env(runs))
    if res.returncode != 0:
        sys.exit(f"corpus_demo: launcher data prepare failed:\n{res.stderr[-3000:]}")
    print(res.stdout.strip(), file=sys.stderr)
    return Manifest.load(out)


def train(name: str, ds: Path, m: Manifest, steps: int, lr: float, batch: int, eval_every: int,
          runs: Path) -> Dict:
    # the vocabulary is the dataset's (m.vocab_size): the model options take it from the manifest
    cmd = [str(BIN / "launch"), *MODELS[name], "cluster=local", "cluster.gpus_per_node=1", "data=tokens",
           f"data.path={ds}", f"data.eval_every={eval_every}", "data.eval_batches=4", f"train.steps={steps}",
           f"train.global_batch_size={batch}", f"train.micro_batch_size={batch}", f"optim.lr={lr}",
           "train.log_interval=0", "wandb.enabled=false", f"name=corpus-{name}"]
    print("  " + " ".join(cmd[1:]), file=sys.stderr)
    t0 = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True, env=_env(runs), cwd=str(runs.parent))
    wall = time.perf_counter() - t0
    if res.returncode != 0:
        sys.exit(f"corpus_demo: training {name} failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
    listed = subprocess.run([str(BIN / "launcher"), "runs", "--json", "--root", str(runs)], capture_output=True,
                            text=True, env=_env(runs), check=True)
    run = json.loads(listed.stdout)[-1]
    rows = [json.loads(line) for line in (Path(run["dir"]) / "metrics.jsonl").read_text().splitlines() if line]
    timed = [r["tokens_per_s"] for r in rows[2:]] or [r["tokens_per_s"] for r in rows]
    return {"cmd": " ".join(["launch", *cmd[1:]]), "first": rows[0]["loss"], "final": rows[-1]["loss"],
            "evals": [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r],
            "tokens_per_s": sum(timed) / len(timed), "wall": wall, "steps": steps}


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--gpt-steps", type=int, default=600)
    ap.add_argument("--llama-steps", type=int, default=600)
    ap.add_argument("--gpt-lr", type=float, default=3e-3)
    ap.add_argument("--llama-lr", type=float, default=6e-3)
    ap.add_argument("--batch", type=int, default=32, help="global batch (one micro batch), samples of 64 tokens")
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--keep", type=Path, help="write the dataset and runs here (default: a temporary dir)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="corpus-demo-") as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        ds, runs = work / "stdlib", work / "runs"
        m = prepare(ds, args.vocab_size, runs)
        h_train, h_val = unigram_entropy(m, "train"), unigram_entropy(m, "val")
        results = {name: train(name, ds, m, steps, lr, args.batch, args.eval_every, runs)
                   for name, steps, lr in (("gpt_tiny", args.gpt_steps, args.gpt_lr),
                                           ("hf_llama_tiny", args.llama_steps, args.llama_lr))}
    size = sum(i.size for i in m.inputs) / 1e6
    lines = [f"corpus: {Path(os.__file__).parent} ({', '.join(GLOBS)}; site-packages left out): "
             f"{len(m.inputs)} files, {size:.1f} MB, {sum(s.documents for s in m.splits.values()):,} documents; "
             f"{os.cpu_count()} CPUs",
             f"prepare: {sum(s.tokens for s in m.splits.values()):,} tokens (vocab {m.vocab_size}) in "
             f"{m.prepare.seconds:.1f} s, {m.prepare.tokens_per_s:,.0f} tokens/s, {m.prepare.workers} worker(s)",
             f"unigram entropy: train {h_train:.3f} nats/token ({m.split('train').tokens:,} tokens), "
             f"val {h_val:.3f} ({m.split('val').tokens:,} tokens)", "",
             "| model | steps | batch tokens | first loss | final loss | below entropy | eval losses (step: loss) "
             "| final eval below entropy | train tokens/s | wall s |",
             "|---|---:|---:|---:|---:|---:|---|---:|---:|---:|"]
    for name, r in results.items():
        evals = ", ".join(f"{s}: {v:.3f}" for s, v in r["evals"])
        lines.append(f"| {name} | {r['steps']} | {args.batch * 64:,} | {r['first']:.3f} | {r['final']:.3f} | "
                     f"{h_train - r['final']:.2f} | {evals} | {h_train - r['evals'][-1][1]:.2f} | "
                     f"{r['tokens_per_s']:,.0f} | {r['wall']:.0f} |")
    lines += ["", "commands:"] + [f"  {r['cmd']}" for r in results.values()]
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
