#!/usr/bin/env bash
# MFU of our recipe on one GPU: gpt_1b3, bf16, fused (SDPA flash) attention, a few hundred steps.
# Prints MFU against the datasheet peak (cluster.gpu.peak_tflops) and against the bf16 matmul
# peak measured on the same GPU. Target: >= 50% of the measured peak.
#   benchmarks/gpu_mfu.sh [datasheet_tflops (default 989, H100/H200 SXM dense bf16)] [steps (300)]
set -euo pipefail
cd "$(dirname "$0")/.."
DATASHEET="${1:-989}"
STEPS="${2:-300}"
command -v nvidia-smi >/dev/null || { echo "gpu_mfu: no GPU here" >&2; exit 1; }
LAUNCHER_TORCH_SPEC="${LAUNCHER_TORCH_SPEC:-torch==2.13.0}" ./scripts/setup.sh
PY=.venv/bin/python
# the GPU and the NCCL this torch brings: a CPU build (or hidden GPUs) stops here, never times the CPU
$PY -c 'import sys, torch
if not torch.cuda.is_available(): sys.exit(f"gpu_mfu: torch {torch.__version__} sees no GPU (torch.version.cuda={torch.version.cuda})")
nccl = ".".join(map(str, torch.cuda.nccl.version()))
print(f"device: {torch.cuda.get_device_name(0)} x {torch.cuda.device_count()}, torch {torch.__version__}, "
      f"CUDA {torch.version.cuda}, NCCL {nccl}")'
peak_json="$($PY benchmarks/matmul_peak.py)"
echo "measured: $peak_json"
measured="$($PY -c 'import json,sys; print(json.loads(sys.argv[1])["bf16_matmul_tflops"])' "$peak_json")"
root="$(mktemp -d)"
LAUNCHER_RUNS="$root" .venv/bin/launch model=gpt_1b3 precision=bf16 cluster=local cluster.gpus_per_node=1 \
  cluster.gpu.peak_tflops="$DATASHEET" train.micro_batch_size=8 train.global_batch_size=8 \
  train.steps="$STEPS" train.log_interval=50 optim.warmup_steps=10
$PY - "$root" "$DATASHEET" "$measured" <<'PYEOF'
import json, statistics, sys, glob
root, datasheet, measured = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
rows = [json.loads(l) for l in open(glob.glob(f"{root}/*/*/metrics.jsonl")[0])]
if not any("peak_memory_bytes" in r for r in rows):  # recorded only on a CUDA device
    sys.exit("gpu_mfu: the run did not train on the GPU (no device memory in its metrics)")
rows = rows[len(rows) // 5:]  # skip warm-up
tflops = statistics.median(r["tflops"] for r in rows)
print(f"gpt_1b3 bf16 1 GPU: {tflops:.1f} TFLOP/s per GPU (model FLOPs), "
      f"MFU {tflops / datasheet:.1%} of datasheet {datasheet:.0f}, {tflops / measured:.1%} of measured {measured:.0f}")
print("target >= 50% of measured:", "PASS" if tflops / measured >= 0.5 else "BELOW TARGET")
PYEOF
