"""The DeepSpeed config JSON, generated from the composed run config (never hand-maintained).

Pure: no torch / deepspeed import, so it can run (and be tested) anywhere, including on the
login node. The deepspeed engines (``launcher.training.engines.deepspeed`` for any model, and a
recipe's own) pass the result to ``deepspeed.initialize`` and archive it in the run dir.

Batch split, ZeRO stage and offload come from the run's ``Layout`` (``launcher.config.layout``), which the
launcher resolved and checked against the rule table (``RULES``) before the job started; nothing
the rules cover is checked again here. Mapping (layout field / run config key -> DeepSpeed key):

    layout.global_batch_size           -> train_batch_size
    layout.micro_batch_size            -> train_micro_batch_size_per_gpu
    layout.grad_accum                  -> gradient_accumulation_steps
    optim.grad_clip (0 = off)          -> gradient_clipping (0.0 = off in DeepSpeed too)
    layout.zero                        -> zero_optimization.stage
    layout.offload_optimizer           -> zero_optimization.offload_optimizer {device: cpu, pin_memory: on GPUs}
    layout.offload_params              -> zero_optimization.offload_param     {device: cpu, pin_memory: on GPUs}
    device (cuda / cpu)                -> zero_optimization.overlap_comm (on GPUs; ZeRO-3 always)
    precision.dtype == fp16            -> fp16.enabled, with precision.loss_scale (0 = dynamic),
                                          initial_scale_power, loss_scale_window, hysteresis, min_loss_scale
    precision.dtype == bf16            -> bf16.enabled
    model.hidden_size (h)              -> ZeRO-3 bucket sizes and persistence threshold (see below; a
                                          model without that key: the engine passes its width)

The optimizer and the learning-rate schedule are NOT in the DeepSpeed config: the engine passes
its own (client) optimizer and the shared step loop sets the lr every step.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, Optional

from launcher.config.schema import enum_value

if TYPE_CHECKING:
    from launcher.config.layout import Layout
    from launcher.config.schema import RunConfig

# Gradient reduce / parameter all-gather buckets for ZeRO-1/2, in elements (DeepSpeed's own
# default is 5e8; 2e8 is the value its tutorials and Megatron-DeepSpeed use: 400 MB in 16-bit).
BUCKET_ELEMENTS = 200_000_000
# Steps between DeepSpeed's own progress prints: the step loop prints and logs metrics itself.
STEPS_PER_PRINT = 1_000_000_000

DTYPES = ("fp32", "fp16", "bf16")


def zero_section(cfg: RunConfig, layout: Layout, device_type: str = "cpu",
                 hidden_size: Optional[int] = None) -> Dict[str, Any]:
    """``zero_optimization``: stage, offload and bucket sizes. On GPUs the gradient reduction
    overlaps the backward (overlap_comm, its own CUDA stream) and offloaded state moves through
    pinned host memory; on CPU neither exists. ``hidden_size``: the model's width for ZeRO-3's
    sizes (None: ``cfg.model.hidden_size``)."""
    gpu = device_type == "cuda"
    stage = int(layout.zero)
    offload_optimizer, offload_params = bool(layout.offload_optimizer), bool(layout.offload_params)
    section: Dict[str, Any] = {"stage": stage}
    if stage == 0:
        return section
    section.update(
        allgather_partitions=True,
        allgather_bucket_size=BUCKET_ELEMENTS,
        reduce_scatter=True,
        reduce_bucket_size=BUCKET_ELEMENTS,
        contiguous_gradients=True,
        # overlap needs separate CUDA streams (DeepSpeed's own defaults: off for 1/2, on for 3)
        overlap_comm=gpu or stage == 3,
    )
    if offload_optimizer:
        # pinned host memory: asynchronous copies at full PCIe speed (a CUDA-only benefit)
        section["offload_optimizer"] = {"device": "cpu", "pin_memory": gpu}
    if stage == 3:
        h = int(cfg.model.hidden_size if hidden_size is None else hidden_size)
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
            section["offload_param"] = {"device": "cpu", "pin_memory": gpu}
    return section


def build_ds_config(cfg: RunConfig, layout: Layout, device_type: str = "cpu",
                     hidden_size: Optional[int] = None) -> Dict[str, Any]:
    """The DeepSpeed config dict for run config ``cfg`` run with ``layout`` on ``device_type``
    ("cuda" or "cpu"); ``hidden_size``: see ``zero_section``."""
    prec = cfg.precision
    dtype = enum_value(prec.dtype)
    if dtype not in DTYPES:
        raise ValueError(f"precision.dtype must be one of {DTYPES}, got {dtype!r}")
    grad_clip = float(cfg.optim.grad_clip)
    if grad_clip < 0:
        raise ValueError(f"optim.grad_clip must be >= 0 (0 = off), got {grad_clip}")
    config: Dict[str, Any] = {
        "train_batch_size": int(layout.global_batch_size),
        "train_micro_batch_size_per_gpu": int(layout.micro_batch_size),
        "gradient_accumulation_steps": int(layout.grad_accum),
        "gradient_clipping": grad_clip,
        "zero_optimization": zero_section(cfg, layout, device_type, hidden_size),
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
    if bool(layout.offload_optimizer):
        # ZeRO-Offload steps the optimizer on the host: DeepSpeed's vectorised DeepSpeedCPUAdam
        # (the engine passes one, same param groups and hyper-parameters as torch AdamW).
        config["zero_force_ds_cpu_optimizer"] = True
    return config
