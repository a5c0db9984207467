"""What the universal (layout-independent) form costs the saves of engines whose ranks hold shards:
FSDP2 (DTensor shards), megatron's tensor parallelism and DeepSpeed ZeRO-2 and ZeRO-3 (flat partitions;
its own save is synchronous), each with train.checkpoint.universal=false
and true, side by side in one run on this host (real launches, cluster=local, async saves).

For each: the bytes of the last checkpoint on disk, whether its universal form was linked to the
engine's own files (meta.json) or written as universal/, and the seconds the training loop waited on
its saves (the GPT recipe's ``checkpoint_blocked_s``, the final save included) per save. Target (issue
"GPU and 512 nodes II"): with universal=true the bytes and the blocked time within 1.5x of
universal=false.

    .venv/bin/python benchmarks/checkpoint_sharded.py [--layouts fsdp,megatron_tp2,deepspeed_zero2,deepspeed_zero3]
                                                      [--steps 12] [--every 3]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent

# a GPT of ~40M parameters: saves large enough to time, steps short enough for two CPU processes
MODEL = ["model=gpt_tiny", "model.num_layers=4", "model.hidden_size=512", "model.num_heads=8",
         "model.ffn_hidden_size=2048", "model.seq_len=64", "model.vocab_size=8192"]
LAYOUTS: Dict[str, List[str]] = {
    "fsdp": ["parallelism=fsdp", "cluster.gpus_per_node=2"],
    "megatron_tp2": ["parallelism.engine=megatron", "parallelism.tp=2", "cluster.gpus_per_node=2"],
    "deepspeed_zero2": ["parallelism.engine=deepspeed", "zero.stage=2", "cluster.gpus_per_node=2"],
    "deepspeed_zero3": ["parallelism.engine=deepspeed", "zero.stage=3", "cluster.gpus_per_node=2"],
}


def bytes_under(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def measure(layout: str, universal: bool, steps: int, every: int, work: Path) -> Dict[str, object]:
    root = work / f"{layout}-{universal}"
    cmd = [str(BIN / "launch"), *MODEL, *LAYOUTS[layout], "precision=fp32", "cluster=local",
           f"train.steps={steps}", f"train.checkpoint.every={every}", "train.checkpoint.keep=1",
           "train.global_batch_size=4", "train.micro_batch_size=2", "train.log_interval=0",
           f"train.checkpoint.universal={str(universal).lower()}"]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=str(REPO), timeout=900,
                         env=dict(os.environ, LAUNCHER_RUNS=str(root)))
    if res.returncode != 0:
        raise RuntimeError(f"{layout} universal={universal} failed:\n{res.stdout[-2000:]}\n{res.stderr[-2000:]}")
    (run,) = [p.parent for p in root.glob("*/*/run.json")]
    summary = json.loads((run / "status.json").read_text())["summary"]
    ckpt = sorted((run / "checkpoints").glob("step_*"))[-1]
    saves = steps // every
    return {"bytes": bytes_under(ckpt), "form": json.loads((ckpt / "meta.json").read_text())["universal"],
            "blocked_per_save": summary["checkpoint_blocked_s"] / saves, "saves": saves}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--every", type=int, default=3)
    args = ap.parse_args()
    ok = True
    with tempfile.TemporaryDirectory(prefix="ckpt-sharded-") as tmp:
        print(f"{'layout':14s} {'universal':>9s} {'form':>8s} {'checkpoint MiB':>15s} {'blocked s/save':>15s}")
        for layout in args.layouts.split(","):
            got = {u: measure(layout, u, args.steps, args.every, Path(tmp)) for u in (False, True)}
            for u, m in got.items():
                print(f"{layout:14s} {str(u).lower():>9s} {str(m['form']):>8s} {m['bytes'] / 2**20:15.1f} "
                      f"{m['blocked_per_save']:15.3f}", flush=True)
            size = got[True]["bytes"] / got[False]["bytes"]
            blocked = got[True]["blocked_per_save"] / max(got[False]["blocked_per_save"], 1e-3)
            verdict = "PASS" if size <= 1.5 and blocked <= 1.5 else "FAIL"
            ok &= verdict == "PASS"
            print(f"{layout:14s} universal true/false: bytes {size:.2f}, blocked per save {blocked:.2f} "
                  f"(target <= 1.5): {verdict}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
