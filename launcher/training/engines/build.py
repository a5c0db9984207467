"""Building a model the same way on every layout: parameters on the meta device first, then each unit
(each block, then the rest of the model) materialised and initialised by itself, and handed to the
engine (FSDP2 shards it, ZeRO-3 partitions it) before the next one exists.

Every module that owns parameters is initialised by the contract's ``init`` (or its own
``reset_parameters``) on the CPU, with torch's RNG seeded by (run seed, the module's name): a
parameter's values are a function of (seed, name, element) only, whatever the layout, the order units
are built in, or which rank keeps which shard. The single process, DDP, FSDP2 and ZeRO 0-3 all build
through here, so they start from the same weights.

Buffers are built for real in the constructor (``params_on_meta`` moves only parameters to meta):
their values (a rotary embedding's inv_freq) come from the constructor, not from an init. A module
whose parameters nothing re-initialises (no ``reset_parameters``, no contract init: its parameters are
still NaN afterwards) cannot be built this way: the whole model is then constructed for real on every
rank from the run seed (the same values on every layout, said in the job's log with the modules).
"""
from __future__ import annotations

import contextlib
import random
from typing import Callable, Dict, Iterator, List, Optional, Set, Tuple

import torch
from torch import nn

from launcher.config.seeding import derive_seed
from launcher.training.engines.contract import ModelContract, contract_for

Unit = Callable[[nn.Module, str], None]  # shard(unit, name): the engine takes a materialised unit


class NotReinitialisable(Exception):
    """Parameters no init covers (``modules``: "name (Type)")."""

    def __init__(self, modules: List[str]) -> None:
        self.modules = modules
        super().__init__(", ".join(modules))

    def __reduce__(self):  # pickled back as it was (a job's result may carry it)
        return (NotReinitialisable, (self.modules,))


@contextlib.contextmanager
def params_on_meta() -> Iterator[None]:
    """Modules constructed inside register their parameters on the meta device (no memory, no init
    compute); buffers stay real."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: Optional[nn.Parameter]) -> None:
        register(module, name, param)
        if param is not None and not param.is_meta:
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def _walk(module: nn.Module, prefix: str, skip: Set[int], seen: Set[int]) -> Iterator[Tuple[str, nn.Module]]:
    """(name, module) of ``module``'s subtree in pre-order, without the subtrees in ``skip`` (by id)."""
    if id(module) in seen:
        return
    seen.add(id(module))
    yield prefix, module
    for name, child in module.named_children():
        if id(child) not in skip:
            yield from _walk(child, f"{prefix}.{name}" if prefix else name, skip, seen)


def units(model: nn.Module, contract: ModelContract) -> List[Tuple[str, nn.Module, Set[int]]]:
    """(name, unit, subtrees it excludes) in build order: each block, then the model without them."""
    names = {id(m): n for n, m in model.named_modules()}
    blocks = contract.blocks(model)
    out = [(names[id(b)], b, set()) for b in blocks]
    out.append(("", model, {id(b) for b in blocks}))
    return out


def init_seed(seed: int, module_name: str) -> int:
    return derive_seed(int(seed), "init", module_name or "<root>")


class Materializer:
    """Materialises the meta parameters of one unit at a time on the CPU and initialises them.
    Tied parameters (one Parameter in two modules) are materialised once."""

    def __init__(self, model: nn.Module, contract: ModelContract, seed: int) -> None:
        self.model, self.contract, self.seed = model, contract, int(seed)
        self.real: Dict[int, Tuple[nn.Parameter, nn.Parameter]] = {}  # id(meta) -> (meta, real)

    def unit(self, name: str, module: nn.Module, skip: Set[int]) -> None:
        fresh: List[Tuple[str, nn.Module, List[nn.Parameter]]] = []
        for mname, m in _walk(module, name, skip, set()):
            new = []
            for pname, p in list(m._parameters.items()):
                if p is None or not p.is_meta:
                    continue
                if id(p) not in self.real:
                    q = nn.Parameter(torch.full(p.shape, float("nan"), dtype=p.dtype), requires_grad=p.requires_grad)
                    self.real[id(p)] = (p, q)
                    new.append(q)
                m._parameters[pname] = self.real[id(p)][1]
            if new:
                fresh.append((mname, m, new))
        missing = []
        with torch.no_grad():
            for mname, m, _ in fresh:
                torch.manual_seed(init_seed(self.seed, mname))
                if self.contract.init is not None:
                    self.contract.init(self.model, m, mname)
                elif hasattr(m, "reset_parameters"):
                    m.reset_parameters()
            for mname, m, new in fresh:  # checked after all: a parent's init may set its children's
                if any(not bool(torch.isfinite(q).all()) for q in new):
                    missing.append(f"{mname or '<root>'} ({type(m).__name__})")
        if missing:
            raise NotReinitialisable(missing)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed & 0xFFFFFFFF)
    except ImportError:
        pass
    torch.manual_seed(seed)


def build_model(model_fn: Callable[[], nn.Module], seed: int, contract: Optional[ModelContract] = None,
                take: Optional[Unit] = None, log: Callable[[str], None] = print
                ) -> Tuple[nn.Module, ModelContract, bool]:
    """The model of ``model_fn`` built unit by unit (see the module doc); ``take(unit, name)`` is called
    for every unit once it is materialised (blocks first, the root last, name ""). Returns (model, its
    contract, whether it was built shard-first: False when it had to be constructed for real)."""
    with params_on_meta():
        model = model_fn()
    contract = contract_for(model, contract)
    try:
        mat = Materializer(model, contract, seed)
        for name, unit, skip in units(model, contract):
            mat.unit(name, unit, skip)
            if take is not None:
                take(unit, name)
        return model, contract, True
    except NotReinitialisable as e:
        log(f"[engines] {type(model).__name__}: the parameters of {e} are set by no init (no reset_parameters(), "
            "and the model's contract gives no init): the model is constructed for real on every rank, whole, "
            f"seeded with the run seed {seed} (the same weights on every layout, but not built shard-first). "
            "Give those modules a reset_parameters() or the model a launcher_contract() with an init "
            "(docs/training-api.md)")
    seed_everything(int(seed))
    model = model_fn()
    contract = contract_for(model, contract)
    if take is not None:
        for name, unit, _ in units(model, contract):
            take(unit, name)
    return model, contract, False


def apply_recompute(model: nn.Module, contract: ModelContract, mode: str) -> None:
    """``train.recompute``: "full" recomputes every block's forward in its backward (the block's
    ``forward`` runs under non-reentrant ``torch.utils.checkpoint``; FSDP2's and DeepSpeed's hooks stay
    around the block's call), unless the contract says the model does that itself; "selective" needs the
    model's own support (which attention core to recompute): refused where the engines would do it."""
    if mode == "none" or not contract.recompute_blocks:
        return
    if mode != "full":
        raise ValueError(f"train.recompute={mode}: the engines recompute whole blocks only (full) for "
                         f"{type(model).__name__}; use train.recompute=full or none, or a contract with "
                         "recompute_blocks=False for a model that recomputes by itself")
    from torch.utils.checkpoint import checkpoint

    for block in contract.blocks(model):
        forward = block.forward
        block.forward = lambda *args, _f=forward, **kwargs: checkpoint(_f, *args, use_reentrant=False, **kwargs)
