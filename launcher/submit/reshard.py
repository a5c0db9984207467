"""Resuming a run on another layout, the login side (pure: no torch): which layout changes a new
attempt may make, checked before anything queues. The node side (the load, the bitwise check, the
record) is launcher.training.universal.

A change of dp, tp, pp, ZeRO stage, engine or node count reshards: the job loads the checkpoint's
``universal/`` state (every engine in ``RESHARDS`` writes it) under its own placement. The global
batch stays what it was unless ``train.global_batch_size`` is changed on purpose (recorded), so the
same samples make each step and the loss curve goes on as if nothing moved. Refused: DeepSpeed at
ZeRO-0 in bf16 (its own master copy, unpartitioned), whose checkpoints are not layout-independent.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Optional, Tuple

from launcher.config.errors import ConfigError, ConfigErrors
from launcher.config.layout import RESHARD_DEEPSPEED_STAGES, RESHARD_KEYS, UNIVERSAL_DIR, has_universal, moved

RESHARDS = ("ddp", "fsdp", "deepspeed", "megatron")  # engines whose checkpoints hold universal/ and load one
SUMMARY = ("engine", "dp", "tp", "pp", "zero", "nodes", "world_size", "micro_batch_size", "grad_accum",
           "global_batch_size")

__all__ = ["RESHARDS", "RESHARD_KEYS", "check", "engine_problem", "moved", "summary"]


def summary(layout: Dict[str, Any]) -> Dict[str, Any]:
    """What restarts.jsonl keeps of a layout."""
    return {k: layout[k] for k in SUMMARY if k in layout}


def engine_problem(engine: Optional[str], zero: int, dtype: Optional[str] = None) -> Optional[Tuple[str, str]]:
    """(what, fix) where a layout on ``engine`` (in precision ``dtype``) writes or loads no layout-independent
    state; else None."""
    if engine not in RESHARDS:
        return (f"engine {engine}, whose checkpoints load only on their own layout",
                f"resharding runs between engines {', '.join(RESHARDS)}; keep the archived layout on {engine}")
    if engine == "deepspeed" and zero not in RESHARD_DEEPSPEED_STAGES and dtype != "fp32":
        return (f"DeepSpeed ZeRO-{zero}{f' in {dtype}' if dtype else ''} (its own fp32 master copy, "
                "unpartitioned), whose checkpoints load only on their own layout",
                "DeepSpeed reshards at ZeRO stage "
                f"{', '.join(map(str, RESHARD_DEEPSPEED_STAGES[:-1]))} or {RESHARD_DEEPSPEED_STAGES[-1]} "
                "(offloaded or not), and at ZeRO-0 in fp32: set zero.stage")
    return None


def check(run_id: str, old: Dict[str, Any], new: Dict[str, Any], changed: Dict[str, Any],
          checkpoint: Optional[Path], dtypes: Tuple[Optional[str], Optional[str]] = (None, None)) -> None:
    """Refuse (ConfigErrors naming the changed keys and the fix) a layout change this run cannot be
    resumed with; ``checkpoint``: the one the job will load (None: it starts from step 0); ``dtypes``:
    precision.dtype saved and resumed with."""
    keys = ", ".join(sorted(changed)) or "layout"
    what = ", ".join(f"{k} {a} -> {b}" for k, (a, b) in moved(old, new).items())
    errs = []
    for side, lay, dtype in (("saved on", old, dtypes[0]), ("resumed on", new, dtypes[1])):
        found = engine_problem(lay.get("engine"), int(lay.get("zero") or 0), dtype)
        if found:
            errs.append(ConfigError(keys, f"{run_id} would be {side} {found[0]} ({what})", found[1]))
    if old.get("global_batch_size") != new.get("global_batch_size") and "train.global_batch_size" not in changed:
        errs.append(ConfigError(keys, f"changes the global batch of {run_id} ({old.get('global_batch_size')} -> "
                                f"{new.get('global_batch_size')}): the steps after the checkpoint would not be "
                                "the same training", f"keep train.global_batch_size={old.get('global_batch_size')} "
                                "(gradient accumulation absorbs the new dp), or set train.global_batch_size "
                                "explicitly to change it on purpose"))
    if checkpoint is not None and not has_universal(checkpoint):
        errs.append(ConfigError(keys, f"the checkpoint {checkpoint.name} of {run_id} has no layout-independent "
                                f"state ({UNIVERSAL_DIR}/: saved with train.checkpoint.universal=false, or by a loop's "
                                "Checkpoint whose objects are not one module and its optimizer, or hold "
                                "per_rank ones)",
                                "resume it on its archived layout"))
    if errs:
        raise ConfigErrors(errs, f"({run_id} on another layout: {what})")
