"""The DeepSpeed config JSON, generated from the composed run config (never hand-maintained).

Pure: no torch / deepspeed import, so it can run (and be tested) anywhere, including on the
login node. ``recipes.gpt.engines.deepspeed`` passes the result to ``deepspeed.initialize`` and
archives it as ``<run_dir>/deepspeed_config.json``.

Mapping (run config key -> DeepSpeed key):

    train.global_batch_size            -> train_batch_size
    train.micro_batch_size             -> train_micro_batch_size_per_gpu
    global / (micro * dp)              -> gradient_accumulation_steps
    optim.grad_clip (0 = off)          -> gradient_clipping (0.0 = off in DeepSpeed too)
    zero.stage                         -> zero_optimization.stage
    zero.offload_optimizer             -> zero_optimization.offload_optimizer {device: cpu, pin_memory: false}
    zero.offload_params                -> zero_optimization.offload_param     {device: cpu, pin_memory: false}
    precision.dtype == fp16            -> fp16.enabled, with precision.loss_scale (0 = dynamic),
                                          initial_scale_power, loss_scale_window, hysteresis, min_loss_scale
    precision.dtype == bf16            -> bf16.enabled
    model.hidden_size (h)              -> ZeRO-3 bucket sizes and persistence threshold (see below)

The optimizer and the learning-rate schedule are NOT in the DeepSpeed config: the engine passes
its own (client) optimizer and the shared step loop sets the lr every step.
"""
from __future__ import annotations

from typing import Any, Dict

# Gradient reduce / parameter all-gather buckets for ZeRO-1/2, in elements (DeepSpeed's own
# default is 5e8; 2e8 is the value its tutorials and Megatron-DeepSpeed use: 400 MB in 16-bit).
BUCKET_ELEMENTS = 200_000_000
# Steps between DeepSpeed's own progress prints: the step loop prints and logs metrics itself.
STEPS_PER_PRINT = 1_000_000_000

DTYPES = ("fp32", "fp16", "bf16")


def _str(value: Any) -> str:
    """Enum member or plain string -> the string."""
    return str(getattr(value, "value", value))


def grad_accum_steps(global_batch: int, micro_batch: int, dp: int) -> int:
    per_step = micro_batch * dp
    if global_batch < 1 or micro_batch < 1 or dp < 1 or global_batch % per_step:
        raise ValueError(
            f"train.global_batch_size={global_batch} is not a positive multiple of "
            f"train.micro_batch_size*dp = {micro_batch}*{dp} = {per_step}"
        )
    return global_batch // per_step


def zero_section(cfg: Any) -> Dict[str, Any]:
    """``zero_optimization``: stage, offload and bucket sizes."""
    z = cfg.zero
    stage = int(z.stage)
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"zero.stage must be 0, 1, 2 or 3, got {stage}")
    offload_optimizer, offload_params = bool(z.offload_optimizer), bool(z.offload_params)
    if (offload_optimizer or offload_params) and stage == 0:
        raise ValueError("zero.offload_optimizer / zero.offload_params need zero.stage >= 1")
    if offload_params and stage != 3:
        raise ValueError("zero.offload_params needs zero.stage=3")
    section: Dict[str, Any] = {"stage": stage}
    if stage == 0:
        return section
    section.update(
        allgather_partitions=True,
        allgather_bucket_size=BUCKET_ELEMENTS,
        reduce_scatter=True,
        reduce_bucket_size=BUCKET_ELEMENTS,
        contiguous_gradients=True,
        # overlap needs separate CUDA streams; DeepSpeed's defaults: off for 1/2, on for 3
        overlap_comm=stage == 3,
    )
    if offload_optimizer:
        # pin_memory false: pinned host memory is a CUDA-only benefit, and it is locked RAM the
        # node's other processes lose; turn it on by hand when host RAM is plentiful.
        section["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
    if stage == 3:
        h = int(cfg.model.hidden_size)
        # The sizes HuggingFace's "auto" ZeRO-3 settings derive from the hidden size:
        # - params with fewer than 10*h elements (biases, norms) stay whole on every rank
        #   (all-gathering them costs more latency than the memory they save); every weight
        #   matrix and the embedding are partitioned,
        # - prefetch 0.9*h^2 elements ahead, reduce gradients in h^2 buckets (a 4096-wide
        #   model: 15M / 16.7M elements).
        section.update(
            reduce_bucket_size=h * h,
            stage3_prefetch_bucket_size=int(0.9 * h * h),
            stage3_param_persistence_threshold=10 * h,
            stage3_max_live_parameters=1_000_000_000,
            stage3_max_reuse_distance=1_000_000_000,
            stage3_gather_16bit_weights_on_model_save=False,
        )
        if offload_params:
            section["offload_param"] = {"device": "cpu", "pin_memory": False}
    return section


def deepspeed_config(cfg: Any, dp: int) -> Dict[str, Any]:
    """The DeepSpeed config dict for run config ``cfg`` on ``dp`` data-parallel ranks."""
    tr, prec = cfg.train, cfg.precision
    dtype = _str(prec.dtype)
    if dtype not in DTYPES:
        raise ValueError(f"precision.dtype must be one of {DTYPES}, got {dtype!r}")
    gbs, mbs = int(tr.global_batch_size), int(tr.micro_batch_size)
    grad_clip = float(cfg.optim.grad_clip)
    if grad_clip < 0:
        raise ValueError(f"optim.grad_clip must be >= 0 (0 = off), got {grad_clip}")
    config: Dict[str, Any] = {
        "train_batch_size": gbs,
        "train_micro_batch_size_per_gpu": mbs,
        "gradient_accumulation_steps": grad_accum_steps(gbs, mbs, int(dp)),
        "gradient_clipping": grad_clip,
        "zero_optimization": zero_section(cfg),
        "fp16": {"enabled": False},
        "bf16": {"enabled": dtype == "bf16"},
        "steps_per_print": STEPS_PER_PRINT,
        "wall_clock_breakdown": False,
    }
    if dtype == "fp16":
        config["fp16"] = {
            "enabled": True,
            "loss_scale": float(prec.loss_scale),  # 0 = dynamic
            "initial_scale_power": int(prec.initial_scale_power),
            "loss_scale_window": int(prec.loss_scale_window),
            "hysteresis": int(prec.hysteresis),
            "min_loss_scale": float(prec.min_loss_scale),
        }
    if bool(cfg.zero.offload_optimizer):
        # ZeRO-Offload steps the optimizer on the host: DeepSpeed's vectorised DeepSpeedCPUAdam
        # (the engine passes one, same param groups and hyper-parameters as torch AdamW).
        config["zero_force_ds_cpu_optimizer"] = True
    return config
