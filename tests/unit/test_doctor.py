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
from pathlib import Path

from launcher import doctor
from launcher.doctor import FIXES, KINDS, Diagnosis, Evidence, diagnose
from launcher.run.status import Status

REPO = Path(__file__).resolve().parents[2]

EXC_RANK1 = """Traceback (most recent call last):
  File "/tmp/dw/runs/20261129-165553-45dc/code/launcher/runtime/task.py", line 90, in run
  File "/tmp/dw/runs/20261129-165553-45dc/code/launcher/runtime/task.py", line 146, in _run_recipe
  File "/tmp/dw/runs/20261129-165553-45dc/code/recipes/gpt/train.py", line 70, in main
    raise RuntimeError(f"injected failure at step {step} on rank {ctx.rank}")
RuntimeError: injected failure at step 2 on rank 1
"""

_BACKWARD = """Traceback (most recent call last):
  File "/tmp/dw/cap/kill/20261129-165708-524e/code/launcher/runtime/task.py", line 112, in run
  File "/tmp/dw/cap/kill/20261129-165708-524e/code/launcher/runtime/task.py", line 188, in _run_recipe
  File "/tmp/dw/cap/kill/20261129-165708-524e/code/recipes/gpt/train.py", line 75, in main
  File "/tmp/dw/cap/kill/20261129-165708-524e/code/recipes/gpt/engines/ddp.py", line 60, in train_step
  File "/work/main/.venv/lib/python3.11/site-packages/torch/_tensor.py", line 623, in backward
  File "/work/main/.venv/lib/python3.11/site-packages/torch/autograd/__init__.py", line 395, in backward
  File "/work/main/.venv/lib/python3.11/site-packages/torch/autograd/graph.py", line 979, in _engine_run_backward
"""
PEER_CLOSED = _BACKWARD + (
    "RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
    "[127.0.0.1]:2446. This is typically caused by a remote worker crashing. Check the logs of the remote worker "
    "before reporting an error. GLHF!\n")
PEER_RESET = _BACKWARD + (
    "RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
    "[127.0.0.1]:25304: Connection reset by peer. This is typically caused by a remote worker hanging or bugs in the "
    "application. Check the logs of the remote worker before reporting an error. GLHF!\n")
GLOO_TIMEOUT = _BACKWARD + (
    "RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out "
    "waiting 8000ms for recv operation to complete\n")
WATCHDOG_ENDED = "submitit WARNING (2026-11-29 16:57:31,087) - Bypassing signal SIGCONT\n" \
                 "[watchdog] rank 1: rank_0 failed; ending this rank too\n"

OOM_STARTUP = """Traceback (most recent call last):
  File "/tmp/dw/cap/oomstart/20261129-165752-01e8/code/launcher/runtime/task.py", line 112, in run
  File "/tmp/dw/cap/oomstart/20261129-165752-01e8/code/launcher/runtime/task.py", line 188, in _run_recipe
  File "/tmp/dw/cap/oomstart/20261129-165752-01e8/code/recipes/gpt/train.py", line 68, in main
  File "/tmp/dw/cap/oomstart/20261129-165752-01e8/code/recipes/gpt/engines/__init__.py", line 20, in build_engine
  File "/tmp/dw/cap/oomstart/20261129-165752-01e8/code/recipes/gpt/engines/ddp.py", line 30, in __init__
  File "/work/main/.venv/lib/python3.11/site-packages/torch/nn/parallel/distributed.py", line 1066, in __init__
  File "/work/main/.venv/lib/python3.11/site-packages/torch/distributed/utils.py", line 315, in _sync_module_states
  File "/work/main/.venv/lib/python3.11/site-packages/torch/distributed/utils.py", line 326, in _sync_params_and_buffers
RuntimeError: [enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried to \
allocate 203907072 bytes. Error code 12 (Cannot allocate memory)
"""
OOM_STEP = """Traceback (most recent call last):
  File "/tmp/dw/cap/oomstep/20261129-165804-f9fe/code/launcher/runtime/task.py", line 112, in run
  File "/tmp/dw/cap/oomstep/20261129-165804-f9fe/code/launcher/runtime/task.py", line 188, in _run_recipe
  File "/tmp/dw/cap/oomstep/20261129-165804-f9fe/code/recipes/gpt/train.py", line 105, in main
  File "/tmp/dw/cap/oomstep/20261129-165804-f9fe/code/recipes/gpt/engines/ddp.py", line 61, in train_step
  File "/work/main/.venv/lib/python3.11/site-packages/torch/_tensor.py", line 623, in backward
  File "/work/main/.venv/lib/python3.11/site-packages/torch/autograd/__init__.py", line 395, in backward
  File "/work/main/.venv/lib/python3.11/site-packages/torch/autograd/graph.py", line 979, in _engine_run_backward
RuntimeError: [enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried to \
allocate 67108864 bytes. Error code 12 (Cannot allocate memory)
"""
PYTHON_MEMORY_ERROR = """Traceback (most recent call last):
  File "<string>", line 1, in <module>
MemoryError
"""
CUDA_OOM = """Traceback (most recent call last):
  File "/runs/S/code/recipes/gpt/train.py", line 105, in main
  File "/runs/S/code/recipes/gpt/engines/ddp.py", line 59, in train_step
  File "/venv/lib/python3.11/site-packages/torch/nn/modules/module.py", line 1789, in _call_impl
  File "/runs/S/code/recipes/gpt/model.py", line 88, in forward
torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.10 GiB of \
which 1.05 GiB is free.
"""

EADDRINUSE = """Traceback (most recent call last):
  File "/tmp/dw/cap/port/20261129-165735-e0a9/code/launcher/runtime/task.py", line 112, in run
  File "/tmp/dw/cap/port/20261129-165735-e0a9/code/launcher/runtime/task.py", line 162, in _run_recipe
  File "/work/main/.venv/lib/python3.11/site-packages/torch/distributed/c10d_logger.py", line 83, in wrapper
  File "/work/main/.venv/lib/python3.11/site-packages/torch/distributed/c10d_logger.py", line 97, in wrapper
  File "/work/main/.venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 1892, in \
init_process_group
  File "/work/main/.venv/lib/python3.11/site-packages/torch/distributed/rendezvous.py", line 280, in \
_env_rendezvous_handler
  File "/work/main/.venv/lib/python3.11/site-packages/torch/distributed/rendezvous.py", line 199, in _create_c10d_store
torch.distributed.DistNetworkError: The server socket has failed to listen on any local network address. port: \
51129, useIpv6: false, code: -98, name: EADDRINUSE, message: address already in use
"""
TCPSTORE_CLIENT_TIMEOUT = """[E1129 17:03:02.319047497 TCPStore.cpp:328] [c10d] TCP client failed to connect/validate \
to host 127.0.0.1:38287 - timed out (try=1, timeout=3000ms): The client socket has timed out after 3000ms while trying \
to connect to (127.0.0.1, 38287).
Traceback (most recent call last):
  File "<string>", line 5, in <module>
torch.distributed.DistNetworkError: The client socket has timed out after 3000ms while trying to connect to \
(127.0.0.1, 38287).
"""

HANG_JSON = {"frames": {"0": "torch/autograd/graph.py:979 in _engine_run_backward",
                        "1": "recipes/gpt/train.py:55 in inject_fault"},
             "no_stack": [], "step": 2, "stuck_ranks": [0, 1], "timeout_s": 5.0, "waiting": {}}
HANG_MESSAGE = ("hang: no step finished for 5 s after step 2: rank 0 stuck in torch/autograd/graph.py:979 in "
                "_engine_run_backward; rank 1 stuck in recipes/gpt/train.py:55 in inject_fault")
HANG_STACK_1 = """# rank 1, no step finished for 5 s (last finished step: 2)
Current thread 0x00007f91605e96c0 (most recent call first):
  File "/tmp/dw/cap/hang/20261129-165924-bce0/code/launcher/runtime/watchdog.py", line 67 in _hang
  File "/tmp/dw/cap/hang/20261129-165924-bce0/code/launcher/runtime/watchdog.py", line 58 in _run
  File "/root/.pyenv/versions/3.11.7/lib/python3.11/threading.py", line 982 in run

Thread 0x00007f9169a2db80 (most recent call first):
  File "/tmp/dw/cap/hang/20261129-165924-bce0/code/recipes/gpt/train.py", line 55 in inject_fault
  File "/tmp/dw/cap/hang/20261129-165924-bce0/code/recipes/gpt/train.py", line 100 in main
  File "/tmp/dw/cap/hang/20261129-165924-bce0/code/launcher/runtime/task.py", line 188 in _run_recipe
  File "/tmp/dw/cap/hang/20261129-165924-bce0/code/launcher/runtime/task.py", line 112 in run
  File "/work/main/.venv/lib/python3.11/site-packages/submitit/core/submission.py", line 55 in process_job
"""  # noqa: E501 (a faulthandler dump, verbatim)

# a second hang run (train.hang_timeout_s=10, fail_at_step=2): rank 0 waits in DDP's forward (bucket rebuild)
HANG_JSON_2 = {"frames": {"0": "recipes/gpt/engines/ddp.py:60 in train_step",
                          "1": "recipes/gpt/train.py:55 in inject_fault"},
               "no_stack": [], "step": 1, "stuck_ranks": [0, 1], "timeout_s": 10.0, "waiting": {}}
HANG_STACK_0 = """# rank 0, no step finished for 10 s (last finished step: 1)
Current thread 0x00007f7bc99e96c0 (most recent call first):
  File "/tmp/pytest-of-root/pytest-58/test_hang0/runs/20261129-170823-169b/code/launcher/runtime/watchdog.py", line 67 in _hang
  File "/root/.pyenv/versions/3.11.7/lib/python3.11/threading.py", line 1002 in _bootstrap

Thread 0x00007f7bd2dcfb80 (most recent call first):
  File "/work/main/.venv/lib/python3.11/site-packages/torch/nn/parallel/distributed.py", line 1775 in _pre_forward
  File "/work/main/.venv/lib/python3.11/site-packages/torch/nn/parallel/distributed.py", line 1886 in forward
  File "/work/main/.venv/lib/python3.11/site-packages/torch/nn/modules/module.py", line 1789 in _call_impl
  File "/work/main/.venv/lib/python3.11/site-packages/torch/nn/modules/module.py", line 1778 in _wrapped_call_impl
  File "/tmp/pytest-of-root/pytest-58/test_hang0/runs/20261129-170823-169b/code/recipes/gpt/engines/ddp.py", line 60 in train_step
  File "/tmp/pytest-of-root/pytest-58/test_hang0/runs/20261129-170823-169b/code/recipes/gpt/train.py", line 105 in main
  File "/tmp/pytest-of-root/pytest-58/test_hang0/runs/20261129-170823-169b/code/launcher/runtime/task.py", line 191 in _run_recipe
  File "/work/main/.venv/lib/python3.11/site-packages/submitit/core/submission.py", line 55 in process_job
"""  # noqa: E501 (a faulthandler dump, verbatim)

SRUN_KILLED = """srun: error: node1: task 1: Killed
srun: launch/slurm: _step_signal: Terminating StepId=251.0
slurmstepd-node1: error: *** STEP 251.0 ON node1 CANCELLED AT 2026-11-29T17:00:31 ***
srun: error: node1: task 0: Terminated
srun: Force Terminated StepId=251.0
"""
SLURM_TIME_LIMIT = """slurmstepd-node1: error: *** STEP 250.0 ON node1 CANCELLED AT 2026-11-29T17:01:50 DUE TO TIME \
LIMIT ***
slurmstepd-node1: error: *** JOB 250 ON node1 CANCELLED AT 2026-11-29T17:01:50 DUE TO TIME LIMIT ***
srun: Job step aborted: Waiting up to 4 seconds for job step to finish.
"""
USR2_TIME_LIMIT = "time limit signal, checkpoint saved after step 1176; restart budget spent"
NCCL_WATCHDOG = ("[rank0]:[E1129 02:07:08.408271257 ProcessGroupNCCL.cpp:607] [Rank 0] Watchdog caught collective "
                 "operation timeout: WorkNCCL(SeqNum=12, OpType=ALLREDUCE, NumelIn=1024, NumelOut=1024, "
                 "Timeout(ms)=600000) ran for 600061 milliseconds before timing out.\n")
RESTART_ROW = {"time": "2026-11-29T17:00:11+00:00", "attempt": 2, "reason": "failure",
               "detail": "rank 1: RuntimeError: injected failure at step 3 on rank 1", "failed_step": None,
               "failed_rank": 1, "from_step": 2, "nodes": ["vm"], "job_id": "19544"}


def failed(**kw) -> Evidence:
    base = dict(run_id="r", status={"status": "failed"}, world_size=2, started=[0, 1], last_step=1, steps=6,
                config={"train.micro_batch_size": 4, "model.seq_len": 64, "train.recompute": "none",
                        "zero.stage": 0, "parallelism.tp": 1, "parallelism.pp": 1, "cluster.time_min": 1})
    base.update(kw)
    return Evidence(**base)


def check(d: Diagnosis, kind: str, rank=None, *words: str) -> None:
    text = d.summary + "\n" + "\n".join(d.detail)
    assert d.kind == kind, (d.kind, text)
    assert d.fix == FIXES[kind]
    if rank is not None:
        assert d.rank == rank, (d.rank, text)
    for w in words:
        assert w in text, (w, text)


# ---- exception ---------------------------------------------------------------------------------------
def test_a_resume_that_fell_back_past_a_corrupt_checkpoint_is_listed():
    row = {"attempt": 2, "resumed_from": "step_00000006", "from_step": 6,
           "rejected": {"step_00000008": ["checkpoints/step_00000008/state.pt changed (sha256 differs)"]}}
    ev = failed(status={"status": "failed", "failed_rank": 1, "error": "RuntimeError: injected failure at step 2 on "
                        "rank 1"}, errors={1: EXC_RANK1}, error_order=[1], fallbacks=[row])
    d = diagnose(ev)
    check(d, "exception", 1, "attempt 2 resumed from step_00000006, past a checkpoint that failed verification: "
          "checkpoints/step_00000008/state.pt changed")


def test_exception_names_the_frame_and_message():
    ev = failed(status={"status": "failed", "failed_rank": 1, "error": "RuntimeError: injected failure at step 2 on "
                        "rank 1"}, errors={1: EXC_RANK1, 0: PEER_CLOSED}, error_order=[1, 0])
    d = diagnose(ev)
    check(d, "exception", 1, "RuntimeError: injected failure at step 2 on rank 1", "recipes/gpt/train.py:70 in main")
    assert "launcher reproduce" in d.fix


def test_a_device_error_is_the_nodes_and_the_ledger_line_is_shown():
    ecc = EXC_RANK1.replace("RuntimeError: injected failure at step 2 on rank 1",
                            "RuntimeError: CUDA error: uncorrectable ECC error encountered")
    ev = failed(status={"status": "failed", "failed_rank": 1}, errors={1: ecc, 0: PEER_CLOSED}, error_order=[1, 0])
    ev.nodes = ["node node3: cuda_error in this run; the node ledger says excluded: left out of every later "
                "submission (2 event(s); `launcher nodes`)"]
    d = diagnose(ev)
    check(d, "node_fault", 1, "uncorrectable ECC error")
    assert "node ledger" in d.fix and any(line.startswith("node node3: ") and "excluded" in line for line in d.detail)


def test_a_peer_that_saw_the_connection_drop_is_never_the_cause():
    # rank 0's error was recorded first and status.json names it: still rank 1's exception is the cause
    ev = failed(status={"status": "failed", "failed_rank": 0}, errors={1: EXC_RANK1, 0: PEER_CLOSED},
                error_order=[0, 1])
    check(diagnose(ev), "exception", 1, "recipes/gpt/train.py:70 in main")


# ---- out of memory -----------------------------------------------------------------------------------
def test_oom_while_building_the_engine_is_startup():
    d = diagnose(failed(errors={0: OOM_STARTUP, 1: OOM_STARTUP}, error_order=[0, 1], last_step=0))
    check(d, "oom_startup", 0, "build_engine", "DefaultCPUAllocator", "also out of memory: rank 1")
    assert "zero=1|2|3" in d.fix and "launcher plan --search" in d.fix and "parallelism.tp" in d.fix


def test_oom_in_backward_is_step():
    d = diagnose(failed(errors={0: OOM_STEP}, last_step=0,
                        config={"train.micro_batch_size": 64, "model.seq_len": 512, "train.recompute": "none"}))
    check(d, "oom_step", 0, "backward", "recipes/gpt/engines/ddp.py:61 in train_step", "train.micro_batch_size=64")
    assert "train.micro_batch_size" in d.fix and "train.recompute" in d.fix and "sequence_parallel" in d.fix


def test_cuda_oom_in_forward_is_step():
    check(diagnose(failed(errors={1: CUDA_OOM})), "oom_step", 1, "forward", "torch.OutOfMemoryError")


def test_memory_error_without_frames_is_decided_by_the_steps_done():
    assert diagnose(failed(logs={0: PYTHON_MEMORY_ERROR}, last_step=0)).kind == "oom_startup"
    assert diagnose(failed(logs={0: PYTHON_MEMORY_ERROR}, last_step=3)).kind == "oom_step"


def test_scheduler_out_of_memory():
    assert diagnose(failed(scheduler="OUT_OF_MEMORY", last_step=0)).kind == "oom_startup"
    assert diagnose(failed(scheduler="OUT_OF_MEMORY", last_step=7)).kind == "oom_step"
    # the ranks' own record, when there is one, decides
    assert diagnose(failed(scheduler="OUT_OF_MEMORY", errors={0: OOM_STEP}, last_step=0)).kind == "oom_step"


DISK_FULL = """Traceback (most recent call last):
  File "/runs/S/code/recipes/gpt/train.py", line 90, in main
    ckpt.save(step)
  File "/runs/S/code/launcher/training/checkpoint.py", line 210, in save
    torch.save(state, path)
OSError: [Errno 28] No space left on device
"""


def test_a_full_disk_is_its_own_class_not_unknown():
    d = diagnose(failed(errors={0: DISK_FULL}, last_step=12))
    check(d, "disk_full", 0, "No space left on device")
    assert "submit.runs_root" in d.fix and "launcher resume RUN" in d.fix
    # from the status alone (no rank recorded it), and in a log
    assert diagnose(failed(status={"status": "failed", "error": "OSError: [Errno 122] Disk quota exceeded"})).kind \
        == "disk_full"


def test_a_job_that_died_writing_nothing_on_a_full_disk_is_disk_full():
    """The batch script's log and the rank's first record are on the full file system too: the job ended
    with no word anywhere. The run dir's free space says what happened; with room left it stays unknown."""
    ended = dict(status={"state": "pending"}, scheduler="FAILED", scheduler_ended=True)
    d = diagnose(Evidence(run_id="r", free_bytes=0, **ended))
    assert d.kind == "disk_full" and "0 bytes free" in " ".join(d.detail), d
    assert diagnose(Evidence(run_id="r", free_bytes=50 << 30, **ended)).kind == "unknown"


def test_oom_phase_from_frames():
    assert doctor.oom_phase(OOM_STARTUP, 5)[0] == "startup"
    assert doctor.oom_phase(OOM_STEP, 0)[0] == "step"
    optim = ('Traceback (most recent call last):\n  File "/c/recipes/gpt/engines/ddp.py", line 70, in train_step\n'
             '  File "/v/site-packages/torch/optim/adamw.py", line 200, in step\n'
             '  File "/v/site-packages/torch/optim/adam.py", line 150, in _init_group\n'
             'torch.OutOfMemoryError: CUDA out of memory.\n')
    assert doctor.oom_phase(optim, 0)[0] == "startup"  # the optimizer state is a model state


# ---- collectives, rendezvous, killed ranks -----------------------------------------------------------
def test_gloo_collective_timeout_names_the_rank_waited_for():
    d = diagnose(failed(errors={0: GLOO_TIMEOUT}, logs={1: WATCHDOG_ENDED}))
    check(d, "collective_timeout", 1, "rank 0 timed out", "waiting for rank 1", "Timed out waiting 8000ms",
          "recipes/gpt/engines/ddp.py:60 in train_step")
    assert "train.dist_timeout_s" in d.fix and "NCCL_DEBUG=INFO" in d.fix


def test_nccl_watchdog_timeout_in_the_logs():
    d = diagnose(failed(world_size=2, logs={0: NCCL_WATCHDOG, 1: "[gpt] step 10/100\n"}))
    check(d, "collective_timeout", 1, "rank 0 timed out", "waiting for rank 1", "WorkNCCL")


def test_port_in_use_is_rendezvous():
    d = diagnose(failed(errors={0: EADDRINUSE}, master="vm:51129", config={"cluster.master_port": 51129}))
    check(d, "rendezvous", 0, "EADDRINUSE", "vm:51129", "cluster.master_port=51129")
    assert "cluster.master_port" in d.fix and "nc -vz" in d.fix


def test_client_connect_timeout_is_rendezvous():
    check(diagnose(failed(logs={1: TCPSTORE_CLIENT_TIMEOUT})), "rendezvous", 1, "timed out after 3000ms")


def test_killed_rank_locally_is_the_silent_one():
    d = diagnose(failed(errors={0: PEER_RESET}, logs={0: "...", 1: "submitit INFO - Loading pickle\n"}))
    check(d, "killed_rank", 1, "rank 1 died", "Connection reset by peer")
    assert "dmesg" in d.fix


def test_killed_rank_on_slurm_from_srun():
    d = diagnose(failed(errors={0: PEER_RESET}, logs={0: SRUN_KILLED}))
    check(d, "killed_rank", 1, "SIGKILL", "srun: error: node1: task 1: Killed")


def test_killed_rank_is_not_the_peer_srun_killed_after_it_recorded_the_symptom():
    both = SRUN_KILLED.replace("task 1: Killed", "task 0: Killed\nsrun: error: node1: task 1: Killed")
    d = diagnose(failed(errors={0: PEER_RESET}, logs={0: both}))
    check(d, "killed_rank", 1, "task 1: Killed")


def test_killed_rank_without_any_error_file():
    check(diagnose(failed(logs={0: SRUN_KILLED})), "killed_rank", 1, "task 1: Killed")


def test_killed_rank_the_step_teardown_recorded_with_no_word_from_any_rank():
    """NCCL's way: no rank error, no srun line in the logs; the batch script's teardown failed the run."""
    error = ("a rank died without a word: srun exit 137 (SIGKILL); restart budget spent (3 restarts, "
             "train.max_restarts=3)")
    d = diagnose(failed(status={"status": "failed", "error": error, "exit_code": 137}, logs={0: "", 1: ""}))
    check(d, "killed_rank", None, "srun exit 137 (SIGKILL)")


# ---- hang --------------------------------------------------------------------------------------------
def test_hang_names_the_stuck_rank_and_where():
    d = diagnose(failed(status={"status": "failed", "failed_rank": 1, "error": HANG_MESSAGE}, hang=HANG_JSON,
                        errors={0: HANG_MESSAGE, 1: HANG_MESSAGE}, stacks={1: HANG_STACK_1}, last_step=2))
    # rank 0 is inside torch's backward (DDP's all-reduce): it waits; rank 1 sleeps in the program's code
    check(d, "hang", 1, "rank 1 stuck in recipes/gpt/train.py:55 in inject_fault", "after step 2",
          "rank 0 waits in torch", "stacks: rank 1: recipes/gpt/train.py:55 in inject_fault")
    assert "train.hang_timeout_s" in d.fix and "NCCL_DEBUG=INFO" in d.fix


def test_hang_reads_the_stacks_where_hang_json_names_the_program_frame():
    # hang.json gives rank 0 its program frame; its stack shows it inside DDP's forward: it waits
    d = diagnose(failed(hang=HANG_JSON_2, stacks={0: HANG_STACK_0, 1: HANG_STACK_1}, last_step=1))
    check(d, "hang", 1, "rank 1 stuck in recipes/gpt/train.py:55 in inject_fault", "rank 0 waits in torch",
          "torch/nn/parallel/distributed.py:1775 in _pre_forward")
    assert "rank 0 stuck" not in d.summary


def test_hang_with_a_rank_waiting_in_a_collective_and_one_without_stack():
    h = {"step": 7, "timeout_s": 60, "stuck_ranks": [3], "waiting": {"0": "all_reduce", "1": "all_reduce",
                                                                     "2": "all_reduce"}, "frames": {}, "no_stack": [3]}
    d = diagnose(failed(world_size=4, hang=h))
    check(d, "hang", 3, "rank 3 left no stack", "rank 0 waits in all_reduce")


# ---- the scheduler -----------------------------------------------------------------------------------
def test_time_limit_from_the_scheduler_and_slurmstepd():
    d = diagnose(failed(status={"status": "running"}, scheduler="TIMEOUT", logs={0: SLURM_TIME_LIMIT}))
    check(d, "time_limit", None, "cluster.time_min=1", "DUE TO TIME LIMIT")
    assert "cluster.time_min" in d.fix and "train.max_restarts" in d.fix


def test_time_limit_from_the_run_own_record():
    d = diagnose(failed(status={"status": "timeout", "error": USR2_TIME_LIMIT}, last_step=1176))
    check(d, "time_limit", None, "checkpoint saved after step 1176")
    d = diagnose(failed(status={"status": "timeout", "error": "job ended without recording an outcome (scheduler "
                                                              "state TIMEOUT)"}))
    check(d, "time_limit", None, "TIMEOUT")


def test_node_failure_and_preemption():
    check(diagnose(failed(scheduler="NODE_FAIL", status={"status": "failed", "hosts": ["node3"]})),
          "node_failure", None, "node3")
    check(diagnose(failed(status={"status": "failed", "error": "job ended without recording an outcome (scheduler "
                                                               "state NODE_FAIL)"})), "node_failure")
    check(diagnose(failed(scheduler="PREEMPTED")), "preempted")
    # the run's own restart records: it was preempted, requeued, and could not start again
    pre = dict(RESTART_ROW, reason="preempted", detail="preempted signal, checkpoint saved after step 4")
    check(diagnose(failed(restarts=[pre])), "preempted", None, "1 restart: preempted")


# ---- restarts, live runs, nothing recorded ----------------------------------------------------------
def test_completed_after_a_restart_says_why_it_restarted():
    attempt1 = Evidence(errors={1: EXC_RANK1, 0: PEER_CLOSED}, error_order=[1, 0])
    d = diagnose(Evidence(status={"status": "completed", "attempt": 2}, last_step=6, steps=6,
                          restarts=[RESTART_ROW], attempts={1: attempt1}))
    check(d, "completed", None, "completed 6 steps after 1 restart: failure [exception]",
          "rank 1: RuntimeError: injected failure at step 3", "resumed from step 2")


def test_restart_budget_spent_at_a_restart_reads_the_last_attempt():
    ev = failed(status={"status": "failed", "attempt": 3, "error": "restart budget spent: 2 restarts "
                        "(train.max_restarts=1); last stop: scheduler"},
                errors={0: "Traceback (most recent call last):\nRuntimeError: restart budget spent: 2 restarts\n"},
                attempts={2: Evidence(errors={0: PEER_RESET})}, logs={1: ""},
                config={"train.max_restarts": 1}, restarts=[RESTART_ROW, dict(RESTART_ROW, attempt=3,
                                                                                reason="scheduler")])
    d = diagnose(ev)
    check(d, "killed_rank", 1, "restart budget spent (train.max_restarts=1)", "2 restarts: failure")


def test_live_runs_have_nothing_to_diagnose():
    assert diagnose(Evidence(status={"status": "running"}, last_step=3, steps=10)).kind == "running"
    assert diagnose(Evidence(status={"status": "pending"})).kind == "pending"
    d = diagnose(Evidence(status={"status": "requeued", "stop": {"reason": "time_limit", "detail": "time limit signal, "
                                                                 "checkpoint saved after step 9"}}))
    check(d, "pending", None, "requeued after time_limit")
    assert diagnose(Evidence(status={"status": "running"}, scheduler="RUNNING", scheduler_ended=False)).kind == \
        "running"
    assert diagnose(Evidence(status={"status": "requeued"}, scheduler="PREEMPTED", scheduler_ended=False)).kind == \
        "pending"
    # the run dir says running, but the scheduler says the job is gone: diagnose it
    assert diagnose(Evidence(status={"status": "running"}, scheduler="EXITED", errors={1: EXC_RANK1})).kind == \
        "exception"


def test_cancelled_and_unknown():
    check(diagnose(failed(status={"status": "cancelled", "error": "cancelled by user"})), "cancelled")
    d = diagnose(failed(status={"status": "failed", "error": "job ended without recording an outcome (scheduler "
                                                             "state FAILED)"}, logs={0: "[gpt] step 5/10\n"}))
    check(d, "unknown", None, "scheduler state FAILED", "rank 0 log ends: [gpt] step 5/10")


def test_every_kind_has_a_fix_and_a_row_in_the_docs():
    assert set(FIXES) == set(KINDS)
    doc = (REPO / "docs" / "doctor.md").read_text()
    for kind in KINDS:
        assert f"`{kind}`" in doc, kind


def test_traceback_reading():
    assert doctor.exception_line(EADDRINUSE).startswith("torch.distributed.DistNetworkError: The server socket")
    assert doctor.exception_line(PYTHON_MEMORY_ERROR) == "MemoryError"
    assert doctor.raising_frame(OOM_STEP) == ("torch/autograd/graph.py:979 in _engine_run_backward, called from "
                                              "recipes/gpt/engines/ddp.py:61 in train_step")
    assert doctor.raising_frame(EXC_RANK1) == "recipes/gpt/train.py:70 in main"


# ---- gather: a run dir written through RunDir ---------------------------------------------------------
def _run_dir(path: Path):
    from launcher.run.rundir import RunDir

    rd = RunDir(path)
    rd.write_config({"train": {"steps": 6, "micro_batch_size": 4}, "model": {"seq_len": 64}})
    rd.write_run({"run_id": "s-0", "sweep_id": "s", "index": 0, "layout": {"world_size": 2}})
    for r in (0, 1):
        rd.write_rank(r, {"rank": r, "master_addr": "vm", "master_port": 51129})
    return rd


def test_gather_reads_the_run_dir(tmp_path):
    rd = _run_dir(tmp_path / "run")
    rd.write_rank_error(1, EXC_RANK1)
    rd.write_rank_error(0, PEER_CLOSED)
    rd.set_status(Status.failed, failed_rank=1, error="RuntimeError: injected failure at step 2 on rank 1")
    ev = doctor.gather(rd)
    assert ev.run_id == "s-0" and ev.world_size == 2 and ev.started == [0, 1] and ev.master == "vm:51129"
    assert set(ev.errors) == {0, 1} and ev.error_order == [1, 0] and ev.config["train.micro_batch_size"] == 4
    json.dumps(ev.to_json())
    check(diagnose(ev), "exception", 1, "recipes/gpt/train.py:70 in main")


