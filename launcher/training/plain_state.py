"""A module's state and its optimizer's by parameter name, as torch.distributed.checkpoint's
get_state_dict gives them, for a module DCP names as the module itself does: without DCP's walk of the
module for each name (launcher.training.universal.module_state takes it where it applies)."""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch

# what makes DCP's get_state_dict name a module's state otherwise than the module does (its _get_fqns):
# a wrapper's child module of these names, or a class with _fqn_modifiers
_RENAMING = frozenset({"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"})


def plain_state(model: torch.nn.Module, optimizer: Any) -> Optional[Tuple[Dict[str, Any], Dict[str, Any]]]:
    """What ``get_state_dict(model, optimizer)`` returns (the same names, the same tensor objects) for
    a module DCP names as the module itself does (plain, or the one DDP wraps: DCP drops DDP's
    ``module.``) and an optimizer whose state exists, built without DCP's per-name module walk (~9 ms
    for a 124M-parameter model: the first save's cost with the universal form on). None where DCP renames or
    shards (FSDP, torch.compile, activation checkpointing, a DTensor) or would create the state:
    DCP's own then."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    from torch.nn.parallel import DistributedDataParallel

    from launcher.training.async_save import is_dtensor

    if not isinstance(optimizer, torch.optim.Optimizer) or not optimizer.state:
        return None
    inner = model.module if isinstance(model, DistributedDataParallel) else model
    for m in inner.modules():
        if isinstance(m, (DistributedDataParallel, FullyShardedDataParallel, FSDPModule)) \
                or not _RENAMING.isdisjoint(m._modules) or hasattr(type(m), "_fqn_modifiers"):
            return None
    named = dict(inner.named_parameters())  # (shared parameters once, by their first name: as DCP)
    if any(is_dtensor(t) for t in (*named.values(), *inner.buffers())):
        return None
    msd = inner.state_dict()
    if any(torch.is_tensor(v) and v.is_meta for v in msd.values()):
        return None
    osd = optimizer.state_dict()
    index = {p: i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
    fqn = {index[p]: name for name, p in named.items() if p in index}
    if any(k not in fqn for k in osd["state"]):
        return None
    return msd, {"state": {fqn[k]: v for k, v in osd["state"].items()}}
