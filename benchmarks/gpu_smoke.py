"""GPU smoke of the product's GPU path on one GPU (~7 minutes on an H200): one JSON line per step.

    ./benchmarks/gpu_smoke.sh                 # on the GPU machine: setup, then every step
    ./benchmarks/gpu_smoke.sh --cpu           # every step that can run on CPU, with gpt_tiny (~2 min)
    ./benchmarks/gpu_smoke.sh --dry-run       # the plumbing: CUDA steps report "skipped" (~30 s)
    python benchmarks/gpu_smoke.py --only ddp_mfu,zero2   # some steps, with this Python

Each step runs in its own process under its own timeout (a hang or a CUDA crash ends that step only)
and prints one line ``{"step", "ok", "measured", "expected", ...}``: ``ok`` is true, false (``why``
says what went wrong) or null (skipped, ``why`` says why). The lines are also appended to
``$OUT/gpu_smoke.jsonl`` (else ``benchmarks/out/gpu_smoke.jsonl``), each step's output to
``<that dir>/gpu_smoke_logs/<step>.log``; the runs (checkpoints of many GB) go to a scratch dir under
$TMPDIR, deleted step by step. What each step measures and expects: docs/gpu.md.

This module is also the recipe of the launch steps (``recipe._target_=benchmarks.gpu_smoke.count_syncs``):
the GPT recipe with the host-device synchronisations of every step counted; it imports nothing heavy
at module level.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

REPO = Path(__file__).resolve().parent.parent
RESULT = "SMOKE_RESULT "  # the prefix of a step process's result line
H200_DENSE_BF16 = 989.0  # datasheet dense bf16 TFLOP/s of H100/H200 SXM (cluster.gpu.peak_tflops)
SYNC_TARGET = "benchmarks.gpu_smoke.count_syncs"
SYNC_FILE = "smoke_syncs.json"


@dataclass(frozen=True)
class Step:
    name: str
    timeout_s: int
    cuda_only: bool  # nothing to measure without CUDA (--cpu and --dry-run skip it)
    cpu_ok: bool  # --dry-run runs it too (quick and meaningful on CPU)
    what: str


# the environment first, then what only a GPU can show (a budget that runs out skips the rest)
STEPS: List[Step] = [
    Step("env", 90, False, True, "GPU, CUDA, NCCL, CUDA_VISIBLE_DEVICES, libraries"),
    Step("matmul_peak", 90, True, False, "bf16 matmul peak (benchmarks/matmul_peak.py)"),
    Step("flash_attention", 90, True, False, "the model's SDPA call runs on the flash backend"),
    Step("ddp_mfu", 300, False, False, "gpt_1b3 bf16 DDP through launch: MFU, host syncs per step"),
    Step("async_checkpoint_negative", 150, True, False, "the same with the writer's wait removed: must differ"),
    Step("no_cuda_refusal", 120, False, True, "a run promised GPUs with CUDA hidden is refused, never trains on CPU"),
    Step("async_checkpoint", 150, False, True, "async saves bitwise equal to a clone taken at the save"),
    Step("resume", 300, False, False, "a run failed at step 8 and resumed from step 6 equals an uninterrupted one"),
    Step("zero2", 240, False, False, "DeepSpeed ZeRO-2 bf16 through launch"),
    Step("megatron", 180, False, False, "megatron engine, tp=pp=dp=1, bf16, through launch"),
]


# ---------------------------------------------------------------------------------------- driver --

def out_dir() -> Path:
    return Path(os.environ["OUT"]) if os.environ.get("OUT") else REPO / "benchmarks" / "out"


def line(step: str, ok: Optional[bool], measured: Any, expected: Any, **extra: Any) -> Dict[str, Any]:
    return {"step": step, "ok": ok, "measured": measured, "expected": expected, **extra}


MIN_STEP_S = 30  # a step with less of the budget left than this is skipped, not started


def run_step(step: Step, mode: str, work: Path, logs: Path, context: Dict[str, Any],
             left_s: Optional[float] = None) -> Dict[str, Any]:
    """One step in its own process, bounded by its timeout and by what is ``left_s`` of the smoke's
    budget; its result line (or why there is none)."""
    if step.cuda_only and mode != "gpu":
        return line(step.name, None, None, step.what, why=f"skipped: needs CUDA ({mode} mode)")
    if mode == "dry-run" and not step.cpu_ok:
        return line(step.name, None, None, step.what,
                    why="skipped: dry run (runs on CPU with gpt_tiny under --cpu, on the GPU under the default mode)")
    timeout_s = step.timeout_s if left_s is None else int(min(step.timeout_s, left_s))
    if timeout_s < MIN_STEP_S:
        return line(step.name, None, None, step.what,
                    why=f"skipped: budget ({max(0, int(left_s or 0))} s of the smoke's budget left, --budget-s)")
    log = logs / f"{step.name}.log"
    env = dict(os.environ, PYTHONUNBUFFERED="1", SMOKE_CONTEXT=json.dumps(context),
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--step", step.name, "--mode", mode, "--work", str(work)]
    t0 = time.monotonic()
    with open(log, "w") as f:
        # its own session: a timeout ends the step's whole process tree (launch, its job), nothing else
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=str(REPO),
                                start_new_session=True)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
    seconds = round(time.monotonic() - t0, 1)
    text = log.read_text(errors="replace")
    found = [x[len(RESULT):] for x in text.splitlines() if x.startswith(RESULT)]
    if found:
        res = json.loads(found[-1])
    elif proc.returncode in (-9, 137) and seconds >= timeout_s:
        res = line(step.name, False, None, step.what, why=f"timed out after {timeout_s} s"
                   + (" (the smoke's budget)" if timeout_s < step.timeout_s else ""), tail=_tail(text))
    else:
        res = line(step.name, False, None, step.what, why=f"the step's process exited {proc.returncode} "
                   "without a result", tail=_tail(text))
    res["seconds"] = seconds
    return res


def _tail(text: str, n: int = 6) -> List[str]:
    return [x[-300:] for x in text.strip().splitlines()[-n:]]


def drive(args: argparse.Namespace) -> int:
    out = out_dir()
    logs = out / "gpu_smoke_logs"
    logs.mkdir(parents=True, exist_ok=True)
    results_file = out / "gpu_smoke.jsonl"
    scratch = Path(tempfile.mkdtemp(prefix="gpu_smoke_", dir=os.environ.get("SMOKE_SCRATCH")))
    only = set(args.only.split(",")) if args.only else None
    unknown = (only or set()) - {s.name for s in STEPS} - {"setup"}
    if unknown:
        sys.exit(f"gpu_smoke: unknown step(s) {sorted(unknown)}; steps: {[s.name for s in STEPS]}")
    results: List[Dict[str, Any]] = []

    def emit(res: Dict[str, Any]) -> None:
        text = json.dumps(res)
        print(text, flush=True)
        with open(results_file, "a") as f:
            f.write(text + "\n")
        results.append(res)

    if args.setup_json:  # the setup's line, made by gpu_smoke.sh
        emit(json.loads(Path(args.setup_json).read_text()))
    context: Dict[str, Any] = {}
    # the budget counts from gpu_smoke.sh's start (SMOKE_T0: its set-up and wheels included)
    start = float(os.environ.get("SMOKE_T0") or time.time())
    deadline = start + args.budget_s if args.budget_s else None
    try:
        for step in STEPS:
            if only and step.name not in only:
                continue
            work = scratch / step.name
            work.mkdir()
            left = None if deadline is None else deadline - time.time()
            res = run_step(step, args.mode, work, logs, context, left)
            emit(res)
            if step.name == "matmul_peak" and res.get("ok") is not None and res.get("measured"):
                context["matmul_tflops"] = res["measured"].get("bf16_matmul_tflops")
            shutil.rmtree(work, ignore_errors=True)  # gpt_1b3's checkpoint alone is ~21 GB
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    bad = [r["step"] for r in results if r.get("ok") is False]
    skipped = [r["step"] for r in results if r.get("ok") is None]
    print(f"gpu_smoke: {len(results) - len(bad) - len(skipped)} ok, {len(bad)} failed {bad}, "
          f"{len(skipped)} skipped {skipped}; lines in {results_file}, logs in {logs}", file=sys.stderr)
    return 1 if bad else 0


# ------------------------------------------------------------------------------- step processes --

def cuda_ready() -> Tuple[bool, str]:
    import torch

    if torch.version.cuda is None:
        return False, f"torch {torch.__version__} is a CPU build"
    if not torch.cuda.is_available():
        return False, f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU"
    return True, ""


def step_env(mode: str, work: Path) -> Dict[str, Any]:
    measured: Dict[str, Any] = {
        "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "unset"),
        "python": sys.version.split()[0], "executable": sys.executable,
        "dev_nvidia": sorted(p.name for p in Path("/dev").glob("nvidia[0-9]*")),
    }
    try:
        smi = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
        measured["nvidia_smi"] = smi.stdout.strip().splitlines() or smi.stderr.strip()[-200:]
    except (OSError, subprocess.TimeoutExpired) as e:
        measured["nvidia_smi"] = f"{type(e).__name__}: {e}"
    libs = {}
    for name in ("torch", "deepspeed", "hydra", "omegaconf", "submitit"):
        try:
            mod = __import__(name)
            libs[name] = getattr(mod, "__version__", "?")
        except Exception as e:  # noqa: BLE001 - any import failure is a finding to print
            libs[name] = f"import failed: {type(e).__name__}: {str(e)[:160]}"
    measured["libraries"] = libs
    expected = {"gpu": "NVIDIA H200 (1 device)", "torch": "a CUDA build, torch.cuda.is_available() true",
                "nccl": "a version", "CUDA_VISIBLE_DEVICES": "unset or 0 (GPU-/MIG- UUIDs: see docs/gpu.md)",
                "libraries": "all import (deepspeed failing voids zero2 only)"}
    try:
        import torch
    except ImportError as e:
        return line("env", False, measured, expected, why=f"no torch: {e}")
    measured.update(torch=torch.__version__, cuda=torch.version.cuda, cuda_available=torch.cuda.is_available(),
                    devices=torch.cuda.device_count() if torch.cuda.is_available() else 0)
    if torch.cuda.is_available():
        measured["gpu"] = torch.cuda.get_device_name(0)
        measured["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        measured["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
    if mode != "gpu":
        return line("env", True, measured, expected, why=f"{mode} mode: the GPU is not expected here")
    ready, why = cuda_ready()
    missing = [k for k, v in libs.items() if str(v).startswith("import failed") and k != "deepspeed"]
    ok = ready and not missing
    return line("env", ok, measured, expected,
                **({} if ok else {"why": "; ".join(filter(None, [why, missing and f"missing {missing}"]))}))


def step_matmul_peak(mode: str, work: Path) -> Dict[str, Any]:
    sys.path.insert(0, str(REPO / "benchmarks"))
    import torch
    from matmul_peak import measure

    ready, why = cuda_ready()
    expected = "H100/H200 SXM: 700-850 TFLOP/s (datasheet dense bf16 989); another GPU: its own peak"
    if not ready:
        return line("matmul_peak", False, None, expected, why=why)
    best = {n: round(measure(n), 1) for n in (4096, 8192, 16384)}
    tflops = max(best.values())
    gpu = torch.cuda.get_device_name(0)
    hopper = any(s in gpu for s in ("H100", "H200"))
    ok = (600 <= tflops <= 1000) if hopper else tflops > 0
    return line("matmul_peak", ok, {"gpu": gpu, "bf16_matmul_tflops": tflops, "by_size": best}, expected,
                **({} if ok else {"why": "outside the range for this GPU"}))


# ---- launch steps ----

def device_memory_gb() -> int:
    """The GPU's own memory, GiB rounded down (an H100 80 GB: 79; an H200: 140), as nvidia-smi reads it:
    no CUDA context is made in this process (the step's run has the GPU)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits", "-i", "0"],
                             capture_output=True, text=True, timeout=30).stdout.split()
        return int(int(out[0]) * 2 ** 20 // 2 ** 30)
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        import torch

        return int(torch.cuda.get_device_properties(0).total_memory // 2 ** 30)


# wandb.enabled=false: the lent GPU machines have no wandb and the smoke is about the GPU path
def common(mode: str) -> List[str]:
    if mode == "gpu":
        return ["cluster=local", "cluster.gpus_per_node=1", "cluster.use_gpus=true",
                f"cluster.gpu.memory_gb={device_memory_gb()}", f"cluster.gpu.peak_tflops={H200_DENSE_BF16:g}",
                "wandb.enabled=false"]
    return ["cluster=local", "cluster.gpus_per_node=1", "wandb.enabled=false"]


def launch(work: Path, name: str, overrides: List[str], env: Optional[Dict[str, str]] = None,
           timeout: float = 600, cli: Optional[List[str]] = None) -> Tuple[int, Optional[Path], str]:
    """`launch <overrides>` (or `launcher <cli>`) into its own runs root: (exit code, the run dir, output)."""
    root = work / name
    full_env = dict(os.environ, LAUNCHER_RUNS=str(root), PYTHONUNBUFFERED="1", **(env or {}))
    cmd = [sys.executable, "-m", "launcher.cli.main", *cli] if cli else [sys.executable, "-m", "launcher.app",
                                                                         *overrides]
    print("$", " ".join(cmd), flush=True)
    res = subprocess.run(cmd, capture_output=True, text=True, env=full_env, cwd=str(REPO), timeout=timeout)
    print(res.stdout[-4000:], res.stderr[-4000:], sep="\n", flush=True)
    runs = sorted(p.parent for p in root.glob("*/*/run.json"))
    return res.returncode, (runs[-1] if runs else None), res.stdout + res.stderr


def summary(run: Optional[Path]) -> Dict[str, Any]:
    """What a run recorded: status, engine and device (rank 0's log), MFU (median, the first 20% of
    steps skipped), peak GPU memory, losses, and the sync counts of count_syncs."""
    if run is None:
        return {"status": "no run dir"}
    st = json.loads((run / "status.json").read_text()) if (run / "status.json").exists() else {}
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()] \
        if (run / "metrics.jsonl").exists() else []
    tail = rows[len(rows) // 5:] or rows

    def med(key: str, scale: float = 1.0, digits: int = 3) -> Optional[float]:
        vals = [r[key] for r in tail if r.get(key) is not None]
        return round(statistics.median(vals) * scale, digits) if vals else None

    logs = glob.glob(str(run.parent / ".submitit" / "*_0_log.out"))  # rank 0's output, every attempt
    text = "".join(Path(p).read_text(errors="replace") for p in logs)
    engine = re.findall(r"engine=(.+?) params=", text)
    device = re.findall(r" device=(\S+)", text)
    summ = st.get("summary") or {}
    out = {"status": st.get("status"), "attempt": st.get("attempt"), "error": st.get("error"),
           "engine": engine[-1] if engine else None, "device": device[-1] if device else None,
           "steps": len(rows), "resumed_from": summ.get("resumed_from"),
           "tflops_per_gpu": med("tflops", digits=1), "mfu": med("mfu"), "step_s": med("step_time_s", digits=4),
           "data_wait_s": med("time_data_s", digits=4), "peak_gpu_GiB": med("peak_memory_bytes", 1 / 2 ** 30, 2),
           "first_loss": summ.get("first_loss"), "final_loss": summ.get("final_loss"),
           "checkpoint_blocked_s": summ.get("checkpoint_blocked_s")}
    if (run / SYNC_FILE).exists():
        out["syncs"] = json.loads((run / SYNC_FILE).read_text())
    return out


def step_no_cuda_refusal(mode: str, work: Path) -> Dict[str, Any]:
    """A run promised GPUs (cluster.use_gpus=true) that finds CUDA hidden: refused at start-up with the
    reason (launcher/runtime/env.py cuda_problem, raised as DeviceError by launcher/runtime/task.py
    _select_device), not restarted (launcher/runtime/restart_policy.py: kind "device"), never on CPU."""
    rc, run, output = launch(work, "runs", [*common(mode), "cluster.use_gpus=true", "model=gpt_tiny", "train.steps=2",
                                            "train.log_interval=0"], env={"CUDA_VISIBLE_DEVICES": "-1"})
    s = summary(run)
    err = str(s.get("error") or "")
    expected = {"launch_exit": "non-zero", "status": "failed", "attempt": 1, "steps": 0,
                "error": "DeviceError: cluster.use_gpus=true, but CUDA_VISIBLE_DEVICES='' hides every GPU ... "
                         "(a CPU build of torch: '... torch is a CPU build ...')"}
    measured = {"launch_exit": rc, "status": s.get("status"), "attempt": s.get("attempt"), "steps": s.get("steps"),
                "error": err[:400]}
    ok = (rc != 0 and s.get("status") == "failed" and "DeviceError" in err and s.get("steps") == 0
          and ("hides every GPU" in err or "CPU build" in err))
    why = {} if ok else {"why": "TRAINED ON CPU: a run promised GPUs completed without one"
                         if s.get("status") == "completed" else "not refused as expected",
                         "tail": _tail(output)}
    if ok and s.get("attempt") != 1:
        why = {"why": f"refused, but only at attempt {s.get('attempt')} (restarted a failure a restart cannot fix)"}
        ok = False
    return line("no_cuda_refusal", ok, measured, expected, **why)


def _launch_step(name: str, mode: str, work: Path, gpu_args: List[str], cpu_args: List[str], expected: Dict[str, Any],
                 check: Callable[[Dict[str, Any], Path], List[str]]) -> Dict[str, Any]:
    """One launch with the sync-counting recipe; ``check`` lists what differs from ``expected``."""
    args = gpu_args if mode == "gpu" else cpu_args
    rc, run, _ = launch(work, "runs", [*common(mode), *args, f"recipe._target_={SYNC_TARGET}"])
    s = summary(run)
    s["launch_exit"] = rc
    problems = []
    if rc != 0 or s.get("status") != "completed":
        problems.append(f"launch exit {rc}, status {s.get('status')}: {s.get('error')}")
    elif mode == "gpu" and not str(s.get("device") or "").startswith("cuda"):
        problems.append(f"trained on {s.get('device')}, not on the GPU")
    else:
        problems += check(s, run) if run is not None else ["no run dir"]
    return line(name, not problems, s, expected, **({"why": "; ".join(problems)} if problems else {}))


def step_ddp_mfu(mode: str, work: Path) -> Dict[str, Any]:
    ctx = json.loads(os.environ.get("SMOKE_CONTEXT") or "{}")
    matmul = ctx.get("matmul_tflops")
    expected = {"status": "completed", "engine": "DDPEngine...", "device": "cuda:0", "steps": 30,
                "tflops_per_gpu": ">= 0.5 x the measured matmul peak (the project's target; review: 300-450 on "
                                  "an H200)" + (f": >= {0.5 * matmul:.0f}" if matmul else ""),
                "mfu": "0.30-0.45 of 989", "data_wait_s": "~0", "peak_gpu_GiB": "45-75",
                "first_loss": "~10.8-10.9 (ln 50304 = 10.83), falling",
                "syncs": "per step: 1 flagged (the stats' .tolist()), 0 explicit synchronize"}

    def check(s: Dict[str, Any], run: Path) -> List[str]:
        p = []
        if mode == "gpu" and matmul and (s.get("tflops_per_gpu") or 0) < 0.5 * matmul:
            p.append(f"{s.get('tflops_per_gpu')} TFLOP/s is below 0.5 x the measured matmul peak {matmul}")
        if s.get("final_loss") is not None and s.get("first_loss") is not None and s["final_loss"] >= s["first_loss"]:
            p.append("the loss did not fall")
        return p

    return _launch_step(
        "ddp_mfu", mode, work,
        ["model=gpt_1b3", "precision=bf16", "parallelism.engine=ddp", "train.micro_batch_size=8",
         "train.global_batch_size=8", "train.steps=30", "train.log_interval=10", "optim.warmup_steps=5",
         "train.checkpoint.every=0"],
        ["model=gpt_tiny", "precision=fp32", "parallelism.engine=ddp", "train.steps=8", "train.log_interval=0",
         "optim.warmup_steps=2", "train.checkpoint.every=0"],
        expected, check)


def step_zero2(mode: str, work: Path) -> Dict[str, Any]:
    expected = {"status": "completed", "engine": "DeepSpeedEngine(zero=2,bf16...)", "device": "cuda:0",
                "overlap_comm": True, "syncs": "review: ~4-5 per step (DeepSpeed's overflow and norm checks)"}

    def check(s: Dict[str, Any], run: Path) -> List[str]:
        s["overlap_comm"] = (s.get("syncs") or {}).get("overlap_comm")  # count_syncs read the engine's config
        p = [] if "zero=2" in str(s.get("engine")) else [f"engine {s.get('engine')}, not ZeRO-2"]
        if mode == "gpu" and s["overlap_comm"] is not True:
            p.append(f"overlap_comm {s['overlap_comm']} on the GPU")
        return p

    return _launch_step(
        "zero2", mode, work,
        ["model=gpt_125m", "precision=bf16", "zero=2", "train.micro_batch_size=4", "train.global_batch_size=8",
         "train.steps=12", "train.log_interval=0", "train.checkpoint.every=0"],
        ["model=gpt_tiny", "precision=fp32", "zero=2", "train.steps=6", "train.log_interval=0",
         "train.checkpoint.every=0"],
        expected, check)


def step_megatron(mode: str, work: Path) -> Dict[str, Any]:
    expected = {"status": "completed", "engine": "MegatronEngine(dp=1 tp=1 pp=1...)", "device": "cuda:0",
                "syncs": "review: 1 per step (the stats' .item())"}

    def check(s: Dict[str, Any], run: Path) -> List[str]:
        return [] if str(s.get("engine") or "").startswith("Megatron") else [f"engine {s.get('engine')}"]

    return _launch_step(
        "megatron", mode, work,
        ["model=gpt_125m", "precision=bf16", "parallelism.engine=megatron", "parallelism.tp=1", "parallelism.pp=1",
         "train.micro_batch_size=4", "train.global_batch_size=8", "train.steps=12", "train.log_interval=0",
         "train.checkpoint.every=0"],
        ["model=gpt_tiny", "precision=fp32", "parallelism.engine=megatron", "parallelism.tp=1", "parallelism.pp=1",
         "train.steps=6", "train.log_interval=0", "train.checkpoint.every=0"],
        expected, check)


def _final_tensors(run: Path) -> Dict[str, Any]:
    import torch

    ckpt = run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()
    out: Dict[str, Any] = {}

    def walk(obj: Any, key: str) -> None:
        if torch.is_tensor(obj):
            out[key] = obj
        elif isinstance(obj, dict):
            for k, v in obj.items():
                walk(v, f"{key}/{k}")
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                walk(v, f"{key}/{i}")

    for f in sorted(ckpt.rglob("*.pt")):
        walk(torch.load(f, map_location="cpu", weights_only=False), str(f.relative_to(ckpt)))
    return out


def step_resume(mode: str, work: Path) -> Dict[str, Any]:
    """The same run twice: uninterrupted, and failing at step 8 of its first attempt (an exception;
    the runtime restarts it from the checkpoint after step 6, asynchronously saved). Every step's loss
    and every tensor of the final checkpoint must be bitwise equal."""
    import torch

    base = (["model=gpt_125m", "precision=bf16", "train.micro_batch_size=4", "train.global_batch_size=8"]
            if mode == "gpu" else ["model=gpt_tiny", "precision=fp32"])
    base = [*common(mode), *base, "parallelism.engine=ddp", "train.steps=12", "train.checkpoint.every=6",
            "train.checkpoint.async_save=true", "train.log_interval=0", "model.dropout=0.1", "seed=5",
            "train.deterministic=true"]  # flash attention's backward is not deterministic run to run
    rc_u, run_u, _ = launch(work, "uninterrupted", base)
    rc_i, run_i, _ = launch(work, "interrupted", [*base, "train.fail_at_step=8", "train.fail_attempt=1"])
    su, si = summary(run_u), summary(run_i)
    expected = {"uninterrupted": "completed, 12 steps", "interrupted": "completed, attempt 2, resumed_from 6",
                "losses_equal": True, "losses_equal_steps_1_6": True, "final_checkpoint_tensors_different": 0}
    measured: Dict[str, Any] = {"uninterrupted": {k: su.get(k) for k in ("status", "attempt", "steps", "device")},
                                "interrupted": {k: si.get(k) for k in ("status", "attempt", "resumed_from", "steps",
                                                                       "device", "error")}}
    if su.get("status") != "completed" or si.get("status") != "completed" or run_u is None or run_i is None:
        return line("resume", False, measured, expected, why=f"launch exits {rc_u}, {rc_i}: a run did not complete")
    lu = [json.loads(x)["loss"] for x in (run_u / "metrics.jsonl").read_text().splitlines()]
    li = [json.loads(x)["loss"] for x in (run_i / "metrics.jsonl").read_text().splitlines()]
    a, b = _final_tensors(run_u), _final_tensors(run_i)
    diff = sorted(k for k in a.keys() | b.keys()
                  if k not in a or k not in b or a[k].shape != b[k].shape or not torch.equal(a[k], b[k]))
    measured.update(losses_equal=lu == li, losses_equal_steps_1_6=lu[:6] == li[:6], loss_steps=len(lu),
                    tensors=len(a), final_checkpoint_tensors_different=len(diff), first_different=diff[:3])
    problems = []
    if si.get("attempt") != 2 or si.get("resumed_from") != 6:
        problems.append(f"attempt {si.get('attempt')}, resumed_from {si.get('resumed_from')}")
    if lu[:6] != li[:6]:  # the control: before the failure both runs did the same thing
        problems.append("steps 1-6 already differ, before any failure: this GPU's kernels are not deterministic "
                        "run to run (no torch.use_deterministic_algorithms), so bitwise resume is not testable here")
    elif lu != li or diff or len(a) < 10:
        problems.append("the resumed run differs from the uninterrupted one")
    if mode == "gpu" and not str(si.get("device") or "").startswith("cuda"):
        problems.append(f"ran on {si.get('device')}")
    return line("resume", not problems, measured, expected, **({"why": "; ".join(problems)} if problems else {}))


# ---- async checkpoint, in process ----

def step_async_checkpoint(mode: str, work: Path, negative: bool = False) -> Dict[str, Any]:
    """The product's Checkpointer saving a GPT (gpt_125m's shape on the GPU) asynchronously, 4 times;
    each save compared bitwise with a clone of the model's state taken at the save (in stream order).
    Right after each save ~0.15 s of matmuls are queued, so the device-to-host copies of the save wait
    behind them: a writer that did not wait for its copies would read unfinished pinned buffers.
    ``negative``: the writer thread's wait on its save's CUDA event is skipped (what a writer that did
    not wait for its copies would get): the saves must then differ, else the race window proves nothing."""
    import threading
    import types

    import torch

    from launcher.run.rundir import RunDir
    from launcher.training.checkpoint import Checkpointer
    from recipes.gpt.model import GPT

    name = "async_checkpoint_negative" if negative else "async_checkpoint"
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    if mode == "gpu" and not cuda:
        return line(name, False, None, "a CUDA device", why=cuda_ready()[1])
    if negative:  # the writer's waits on the device skipped: its save's event (and any synchronize)
        real_sync, real_event_sync = torch.cuda.synchronize, torch.cuda.Event.synchronize

        def no_wait_in_writer(device: Any = None) -> None:
            if threading.current_thread().name != "checkpoint-writer":
                real_sync(device)

        def no_event_wait_in_writer(event: Any) -> None:
            if threading.current_thread().name != "checkpoint-writer":
                real_event_sync(event)

        torch.cuda.synchronize = no_wait_in_writer
        torch.cuda.Event.synchronize = no_event_wait_in_writer
    big = dict(num_layers=12, hidden_size=768, num_heads=12, ffn_hidden_size=3072, vocab_size=50304, seq_len=1024)
    tiny = dict(num_layers=2, hidden_size=64, num_heads=4, ffn_hidden_size=256, vocab_size=512, seq_len=64)
    m = types.SimpleNamespace(**(big if cuda else tiny), tie_embeddings=True, dropout=0.0)
    torch.manual_seed(0)
    model = GPT(m, seed=0).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.randint(0, m.vocab_size, (8 if cuda else 2, m.seq_len), device=dev)
    heavy = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16) if cuda else None
    saves = 4
    cfg = types.SimpleNamespace(train=types.SimpleNamespace(
        checkpoint=types.SimpleNamespace(every=2, keep=saves + 1, async_save=True), steps=10 ** 6,
        fail_at_step=None, fail_rank=0, fail_mode="exception", fail_attempt=None))

    class Engine:  # the ddp engine's shape of files: model and optimizer in one file
        def save_native(self, path: Path) -> None:
            pass

        def optimizers(self) -> List[Any]:
            return [opt]

        def checkpoint_files(self) -> Dict[str, Any]:
            return {"model.pt": {"model": model.state_dict(), "optimizer": opt.state_dict()}}

    rd = RunDir(work / "run")
    rd.path.mkdir(parents=True)
    ctx = types.SimpleNamespace(rundir=rd, rank=0, world_size=1, attempt=1, heartbeat=lambda *a: None)
    ck = Checkpointer(cfg, ctx, Engine())
    refs: Dict[int, Dict[str, Any]] = {}
    returned_ms = []
    for step in range(1, 2 * saves + 1):
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cuda):
            loss = model(data, labels=data)
        loss.backward()
        opt.step()  # waits (the Checkpointer's pre-hook) for the copy of a save in flight
        opt.zero_grad(set_to_none=True)
        if ck.due(step):
            refs[step] = {k: v.detach().clone() for k, v in model.state_dict().items()}
            t0 = time.perf_counter()
            ck.save(step, [])
            returned_ms.append((time.perf_counter() - t0) * 1e3)
            for _ in range(100 if cuda else 0):  # ~0.15 s of matmuls queued ahead of the save's copies
                heavy = (heavy @ heavy).div_(8192 ** 0.5)
    ck.finish()
    bad = total = 0
    for step, ref in refs.items():
        saved = torch.load(rd.checkpoint_dir(step) / "model.pt", weights_only=True)["model"]
        for k, v in ref.items():
            total += 1
            bad += int(not torch.equal(saved[k], v.cpu()))
    measured = {"device": str(dev), "saves": len(refs), "tensors_compared": total, "mismatched": bad,
                "save_returned_ms_max": round(max(returned_ms), 1), "loop_blocked_s": round(ck.blocked_s, 3)}
    if negative:
        ok = bad > 0
        return line(name, ok, measured, {"mismatched": "> 0 (0: the race window was too short: no evidence)"},
                    **({} if ok else {"why": "the control did not differ: the positive step proves nothing"}))
    ok = bad == 0 and total > 0
    return line(name, ok, measured, {"mismatched": 0, "saves": saves},
                **({} if ok else {"why": "a saved tensor differs from the state at its save"}))


def step_flash_attention(mode: str, work: Path) -> Dict[str, Any]:
    """The model's attention (recipes/gpt/model.py CausalSelfAttention: F.scaled_dot_product_attention,
    causal) at gpt_1b3's shape under bf16 autocast: forward and backward with only the flash backend
    allowed, then the kernels the default dispatch picks (profiler)."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.profiler import ProfilerActivity, profile

    from recipes.gpt.model import CausalSelfAttention

    expected = {"flash_only": "forward+backward run, output bfloat16",
                "default_kernels": "a flash (flash_fwd/flash_bwd) or cuDNN attention kernel, not only "
                                   "efficient/math ones"}
    ready, why = cuda_ready()
    if not ready:
        return line("flash_attention", False, None, expected, why=why)
    attn = CausalSelfAttention(2048, 16, 0.0).cuda()
    x = torch.randn(4, 2048, 2048, device="cuda", requires_grad=True)
    measured: Dict[str, Any] = {}
    try:
        with torch.autocast("cuda", dtype=torch.bfloat16), sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            y = attn(x)
        y.float().sum().backward()
        torch.cuda.synchronize()
        measured["flash_only"] = f"ok, output {y.dtype}"
    except RuntimeError as e:
        measured["flash_only"] = f"failed: {str(e)[:300]}"
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = attn(x)
        y.float().sum().backward()
        torch.cuda.synchronize()
    keys = sorted({e.key for e in prof.key_averages()})
    attention = [k[:100] for k in keys if any(s in k.lower() for s in ("flash", "fmha", "cudnn", "attention",
                                                                       "efficient"))]
    measured["default_kernels"] = attention[:6]
    fused = any(s in k.lower() for k in attention for s in ("flash", "cudnn", "fmha"))
    ok = measured["flash_only"].startswith("ok") and fused
    return line("flash_attention", ok, measured, expected,
                **({} if ok else {"why": "no flash/cuDNN attention kernel in the default dispatch"
                   if not fused else "the flash backend refused the model's call"}))


def step_process(name: str, mode: str, work: Path) -> None:
    fn = {"env": step_env, "matmul_peak": step_matmul_peak, "no_cuda_refusal": step_no_cuda_refusal,
          "flash_attention": step_flash_attention, "ddp_mfu": step_ddp_mfu,
          "async_checkpoint": step_async_checkpoint,
          "async_checkpoint_negative": lambda m, w: step_async_checkpoint(m, w, negative=True),
          "resume": step_resume, "zero2": step_zero2, "megatron": step_megatron}[name]
    what = next(s.what for s in STEPS if s.name == name)
    try:
        res = fn(mode, work)
    except Exception as e:  # noqa: BLE001 - the step's one line says what broke
        import traceback

        traceback.print_exc()
        res = line(name, False, None, what, why=f"{type(e).__name__}: {str(e)[:400]}")
    print(RESULT + json.dumps(res), flush=True)


# --------------------------------------------------------------------- the sync-counting recipe --

def count_syncs(cfg: Any, ctx: Any) -> Dict[str, Any]:
    """recipes.gpt.train.main, counting from step 3 on every host-device synchronisation per loop
    iteration (a step, its metrics, the stop check, a save): the ones torch's sync debug mode flags
    (.item(), a copy to pageable host memory, ...) and explicit torch.cuda.synchronize calls, each with
    the first recipes/ or launcher/ frame that made it. Rank 0 writes them to <run>/smoke_syncs.json."""
    import traceback
    import warnings

    import torch

    from recipes.gpt import train

    flagged: Dict[int, int] = {}
    explicit: Dict[int, int] = {}
    sites: Dict[str, int] = {}
    st: Dict[str, Any] = {"step": None, "on": False}
    orig_beat, orig_show, orig_sync = ctx.heartbeat, warnings.showwarning, torch.cuda.synchronize

    def site() -> str:
        frames = [f for f in traceback.extract_stack()[:-2] if "/recipes/" in f.filename or "/launcher/" in f.filename]
        return f"{'/'.join(frames[-1].filename.split('/')[-3:])}:{frames[-1].lineno}" if frames else "?"

    def show(message, category, filename, lineno, file=None, line=None):  # noqa: ANN001
        if st["on"] and "synchroniz" in str(message):
            flagged[st["step"]] = flagged.get(st["step"], 0) + 1
            where = "flagged " + site()
            sites[where] = sites.get(where, 0) + 1
            return
        orig_show(message, category, filename, lineno, file, line)

    def sync(device: Any = None) -> None:
        if st["on"]:
            explicit[st["step"]] = explicit.get(st["step"], 0) + 1
            where = "synchronize " + site()
            sites[where] = sites.get(where, 0) + 1
        orig_sync(device)

    def beat(step: Optional[int] = None) -> None:
        orig_beat(step)
        if step is None:
            return
        if step == 3 and torch.cuda.is_available():
            warnings.filterwarnings("always", message=".*synchroniz")
            warnings.showwarning = show
            torch.cuda.synchronize = sync
            torch.cuda.set_sync_debug_mode("warn")
            st["on"] = True
        st["step"] = step + 1  # what follows belongs to the next loop iteration

    built: Dict[str, Any] = {}
    orig_build = train.build_engine

    def build(*a: Any, **k: Any) -> Any:  # the engine's DeepSpeed config, as given to DeepSpeed
        engine = built["engine"] = orig_build(*a, **k)
        return engine

    ctx.heartbeat, train.build_engine = beat, build
    try:
        return train.main(cfg, ctx)
    finally:
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode(0)
        warnings.showwarning, torch.cuda.synchronize, train.build_engine = orig_show, orig_sync, orig_build
        if ctx.rank == 0:
            last = int(cfg.train.steps)  # its iteration holds the final save: not a steady step
            steady = [s for s in range(5, last)]
            per = {"flagged": [flagged.get(s, 0) for s in steady], "explicit": [explicit.get(s, 0) for s in steady]}
            result = {"counted": bool(st["on"]), "steps_counted": len(steady),
                      "flagged_per_step": statistics.median(per["flagged"]) if steady and st["on"] else None,
                      "explicit_per_step": statistics.median(per["explicit"]) if steady and st["on"] else None,
                      "sites": sites}
            ds = getattr(built.get("engine"), "config", None)
            if isinstance(ds, dict):
                result["overlap_comm"] = ds.get("zero_optimization", {}).get("overlap_comm")
            if not torch.cuda.is_available():
                result["why"] = "on CPU nothing synchronises with a device: not counted"
            (Path(ctx.rundir.path) / SYNC_FILE).write_text(json.dumps(result))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=("gpu", "cpu", "dry-run"), default="gpu")
    ap.add_argument("--dry-run", action="store_const", const="dry-run", dest="mode")
    ap.add_argument("--cpu", action="store_const", const="cpu", dest="mode")
    ap.add_argument("--only", help="comma-separated step names")
    ap.add_argument("--budget-s", type=float, default=float(os.environ.get("SMOKE_BUDGET_S", 450)),
                    help="the whole smoke's seconds (default 450: done within 8 minutes with the set-up); a "
                         "step is cut to what is left, and skipped ('skipped: budget') when under 30 s is; 0: none")
    ap.add_argument("--setup-json", help=argparse.SUPPRESS)
    ap.add_argument("--step", help=argparse.SUPPRESS)  # inside a step's process
    ap.add_argument("--work", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.step:
        sys.path.insert(0, str(REPO))
        step_process(args.step, args.mode, Path(args.work))
        return 0
    return drive(args)


if __name__ == "__main__":
    sys.exit(main())
