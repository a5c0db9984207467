"""Measured dense bf16 matmul peak of this GPU (TFLOP/s): the best of a few large square GEMMs.
The realistic ceiling for MFU, next to the datasheet number."""
from __future__ import annotations

import json
import sys

import torch


def measure(n: int = 8192, iters: int = 50, dtype=torch.bfloat16) -> float:
    a = torch.randn(n, n, device="cuda", dtype=dtype)
    b = torch.randn(n, n, device="cuda", dtype=dtype)
    for _ in range(5):
        a @ b
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        a @ b
    end.record()
    torch.cuda.synchronize()
    return 2 * n**3 * iters / (start.elapsed_time(end) / 1e3) / 1e12


if __name__ == "__main__":
    if not torch.cuda.is_available():
        sys.exit("matmul_peak: no CUDA device")
    best = max(measure(n) for n in (4096, 8192, 16384))
    print(json.dumps({"gpu": torch.cuda.get_device_name(0), "bf16_matmul_tflops": round(best, 1)}))
