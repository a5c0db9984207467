"""launcher.doctor: each class of failure from the text real failures left, with its fix.

The fixtures below were captured once (2026-11-29) from real runs of this launcher on CPU (gloo, 2
ranks, gpt_tiny) and from the local Slurm cluster (scripts/slurm-local.sh), then trimmed: the source
line under each traceback frame and the ^^^ markers are left out. How each was provoked:

- EXC_RANK1                train.fail_at_step=2 train.fail_rank=1 (rank 1's ranks/rank_1.error)
- PEER_CLOSED              the same run, rank 0's error (its peer had gone)
- PEER_RESET               SIGKILL of rank 1 mid-run (kill -9 of the pid in ranks/rank_1.json); rank 0's error
- GLOO_TIMEOUT             SIGSTOP of rank 1 with train.dist_timeout_s=8; rank 0's error
- WATCHDOG_ENDED           the same run, rank 1's stderr once continued
- OOM_STARTUP              RLIMIT_AS = the tiny run's VmPeak + 150 MB, model.hidden_size=1024 num_layers=4
- OOM_STEP                 RLIMIT_AS = VmPeak + 300 MB, train.micro_batch_size=64 model.seq_len=512
- PYTHON_MEMORY_ERROR      `python -c "x = bytearray(8 * 1024**3)"` under RLIMIT_AS = 2 GiB
- EADDRINUSE               cluster.master_port=<a port the capturing process held bound>
- TCPSTORE_CLIENT_TIMEOUT  torch.distributed.TCPStore(host, <closed port>, 2, False, timeout=3 s)
- HANG_*                   train.fail_mode=sleep train.fail_at_step=3 train.fail_rank=1 train.hang_timeout_s=5
                           (HANG_*_2 / HANG_STACK_0: fail_at_step=2, hang_timeout_s=10)
- SRUN_KILLED              cluster=local_slurm train.fail_mode=kill train.fail_at_step=2 train.fail_rank=1
- SLURM_TIME_LIMIT         cluster=local_slurm cluster.time_min=1, rank 1 asleep (fail_mode=sleep)
- USR2_TIME_LIMIT          cluster=local_slurm cluster.time_min=1 cluster.signal_delay_s=50, a long run
- RESTART_ROW              fail_at_step=3 fail_rank=1 fail_attempt=1 max_restarts=1 checkpoint.every=2

CUDA_OOM and NCCL_WATCHDOG could not be provoked here (no GPU): they are written in the format
torch's CUDA caching allocator and ProcessGroupNCCL's watchdog print, with made-up numbers.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from launcher.doctor import FIXES
from launcher.status import Status
from unit.test_doctor import OOM_STARTUP, _run_dir  # noqa: F401 (fixtures and helpers shared with the pure tests)


@pytest.mark.timeout(120)
def test_doctor_command_imports_no_torch(tmp_path):
    rd = _run_dir(tmp_path / "run")
    rd.write_rank_error(0, OOM_STARTUP)
    rd.finish(Status.failed, failed_rank=0, error="RuntimeError: DefaultCPUAllocator: can't allocate memory")
    res = subprocess.run([sys.executable, "-X", "importtime", "-m", "launcher.cli.main", "doctor", str(rd.path),
                          "--json"], capture_output=True, text=True, timeout=100, cwd=tmp_path,
                         env={"LAUNCHER_RUNS": str(tmp_path / "runs"), "PATH": "/usr/bin:/bin"})
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout)
    assert out["kind"] == "oom_startup" and out["rank"] == 0 and out["fix"] == FIXES["oom_startup"]
    imported = {line.rsplit("|", 1)[-1].strip() for line in res.stderr.splitlines() if "|" in line}
    assert "launcher.doctor" in imported and "torch" not in imported and "deepspeed" not in imported
