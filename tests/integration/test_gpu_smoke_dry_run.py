"""benchmarks/gpu_smoke.sh --dry-run on this machine: the GPU smoke's plumbing. Every step prints one
JSON line naming its step (the same lines land in $OUT/gpu_smoke.jsonl); the steps that can run on
CPU ran and passed (the no-CUDA refusal through a real launch, async checkpoints bitwise), those that
need CUDA or a GPU-sized run say they were skipped and why."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
from gpu_smoke import STEPS  # noqa: E402


@pytest.mark.timeout(180)
def test_dry_run_prints_one_parsable_line_per_step(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path / "out"), SMOKE_PYTHON=sys.executable, SMOKE_SCRATCH=str(tmp_path),
               PYTHONPATH=str(REPO))
    res = subprocess.run([str(REPO / "benchmarks" / "gpu_smoke.sh"), "--dry-run"], capture_output=True, text=True,
                         env=env, timeout=170, cwd=str(tmp_path))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    lines = [json.loads(x) for x in res.stdout.splitlines() if x.strip()]  # every stdout line is JSON
    names = [x["step"] for x in lines]
    assert names == ["setup", *[s.name for s in STEPS]]
    for x in lines:
        assert {"step", "ok", "measured", "expected"} <= x.keys(), x
        if x["ok"] is not True:
            assert x["ok"] is None and x["why"].startswith("skipped: "), x  # nothing failed, skips say why
    by = {x["step"]: x for x in lines}
    ran = {n for n, x in by.items() if x["ok"] is True}
    assert ran == {"env", "no_cuda_refusal", "async_checkpoint"}
    refusal = by["no_cuda_refusal"]["measured"]
    assert "DeviceError" in refusal["error"] and refusal["steps"] == 0 and refusal["attempt"] == 1
    assert by["async_checkpoint"]["measured"]["mismatched"] == 0 and by["async_checkpoint"]["measured"]["saves"] == 4
    assert "needs CUDA" in by["matmul_peak"]["why"]
    saved = [json.loads(x) for x in (tmp_path / "out" / "gpu_smoke.jsonl").read_text().splitlines()]
    assert saved == lines
    assert (tmp_path / "out" / "gpu_smoke_logs" / "no_cuda_refusal.log").stat().st_size > 0
    assert not list(Path(tmp_path).glob("gpu_smoke_*"))  # the scratch runs are removed
