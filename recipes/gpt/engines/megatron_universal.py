"""The megatron engine's layout-independent state (launcher.training.universal): each full parameter and
its Adam moments under the single-process model's names, saved linked to the engine's own shard files
(``universal_pieces``: each rank's part, no gather) or gathered per pipeline stage (``universal_state``),
and loaded on any layout (``load_universal``: each rank cuts its shards from the full tensors)."""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from launcher.training import universal


class LayoutFreeState:
    """Mixed into MegatronEngine: reads its mesh, stage, optimizer, ZeRO stage, loss scaler and the
    aliases of tied parameters."""

    # ------------------------------------------------------------------------------ any layout
    #
    # universal/ (launcher.training.universal) holds each full parameter and its Adam moments under the
    # single-process model's names. At a save each rank names its own shards in its shard files
    # (``universal_pieces``; each shard's place in the full parameter is its ``init_spec``: rows, cols).
    # Where they cannot be linked, each pipeline stage assembles its own parameters whole on its
    # (dp 0, tp 0) rank from the tensor-parallel shards, so no rank holds more than its stage. The load
    # reads each stage's tensors whole and cuts this rank's shards from them; fp16's loss scaler as
    # every engine names it.
    # ZeRO-1: each parameter's moments from the data-parallel rank its partition gave them to.

    universal_owned = True  # each owner rank checks its own stage's tensors (universal.verify)

    def _unique_params(self) -> List[nn.Parameter]:
        return list(dict.fromkeys(self.stage.parameters()))

    def _tp_specs(self) -> List[List[Tuple[Any, Any]]]:
        """Per parameter of this stage, every tp rank's (rows, cols) (one exchange, then kept)."""
        if getattr(self, "_specs", None) is None:
            mine = [tuple((getattr(p, "init_spec", None) or (None, None, None, None))[2:])
                    for p in self._unique_params()]
            every: List[Any] = [None] * self.tp
            if self.tp > 1:
                dist.all_gather_object(every, mine, group=self.mesh.tp_group)
            else:
                every = [mine]
            self._specs = [[every[r][i] for r in range(self.tp)] for i in range(len(mine))]
        return self._specs

    def _whole(self, t: torch.Tensor, shape: Tuple[int, ...], specs: List[Tuple[Any, Any]]) -> torch.Tensor:
        """The full tensor from every tp rank's shard ``t`` (a collective over tp): on tp rank 0."""
        if self.tp == 1 or all(rows is None and cols is None for rows, cols in specs):
            return t.detach().cpu()
        parts = [torch.empty_like(t) for _ in range(self.tp)]
        dist.all_gather(parts, t.detach().contiguous(), group=self.mesh.tp_group)
        full = torch.zeros(shape, dtype=t.dtype, device=t.device)
        for (rows, cols), part in zip(specs, parts):
            full[(slice(None) if rows is None else rows, *(() if cols is None else (cols,)))] = part
        return full.cpu()

    def _holds_moments(self) -> Callable[[nn.Parameter], bool]:
        """Whether this rank's tp group holds a parameter's Adam moments: ZeRO-0, data-parallel rank 0's
        (the replicas hold the same); ZeRO-1, the data-parallel rank its partition gave it to (the same
        partition on every tp rank: their shards are the same sizes)."""
        if self.zero == 1:
            owner = self.optimizer._param_to_rank
            return lambda p: p.requires_grad and owner.get(p) == self.dp_rank
        return lambda p: p.requires_grad and self.dp_rank == 0

    def _adam(self) -> torch.optim.Optimizer:
        return self.optimizer.optim if self.zero == 1 else self.optimizer  # ZeRO-1: its partition's AdamW

    def universal_state(self) -> Optional[Dict[str, Any]]:
        from recipes.gpt.parallel.tensor_parallel import source

        scaler = universal.with_scaler(self.scaler)  # every rank holds the same: written once
        model: Dict[str, Any] = {}
        optim: Dict[str, Any] = {}
        holds, adam = self._holds_moments(), self._adam()
        owner = self.mesh.tp_rank == 0  # of what its tp group gathers
        for p, specs in zip(self._unique_params(), self._tp_specs()):
            name, shape = source(p)
            if self.dp_rank == 0:  # the weights: data-parallel rank 0's (the replicas hold the same)
                weight = self._whole(p, shape, specs)
                for alias in self._aliases.get(name, [name]) if owner else ():
                    model[alias] = weight
            if holds(p):
                st = adam.state.get(p) or {}
                if "exp_avg" not in st:  # not stepped yet: the state AdamW starts from
                    st = {"step": torch.zeros((), dtype=torch.float32), "exp_avg": torch.zeros_like(p),
                          "exp_avg_sq": torch.zeros_like(p)}
                moments = {k: self._whole(st[k], shape, specs) for k in ("exp_avg", "exp_avg_sq")}
                if owner:
                    optim[name] = {**moments,
                                   "step": torch.as_tensor(st["step"], dtype=torch.float32).detach().cpu()}
        return {"model": model, "optim": optim, **scaler}

    def universal_pieces(self) -> Optional[Dict[str, Any]]:
        """``universal_state``'s names, each this rank's own part (no collective): a tensor-parallel
        shard as a ``universal.Piece`` (its place in the full tensor), a replicated tensor whole from
        tp rank 0. Linked to the shard files at a save (launcher.training.universal_links); where they
        cannot be (None: moments not stepped yet), the checkpointer gathers ``universal_state`` instead."""
        from recipes.gpt.parallel.tensor_parallel import source

        model: Dict[str, Any] = {}
        optim: Dict[str, Any] = {}
        holds, adam = self._holds_moments(), self._adam()
        for p in self._unique_params():
            name, shape = source(p)
            rows, cols = (p.init_spec[2], p.init_spec[3]) if hasattr(p, "init_spec") else (None, None)
            if rows is None and cols is None and self.mesh.tp_rank != 0:  # (its tp replicas hold the same)
                continue
            def part(t: torch.Tensor, shape: Tuple[int, ...] = shape, rows: Any = rows, cols: Any = cols) -> Any:
                return universal.Piece(t, shape, rows, cols) if rows is not None or cols is not None else t
            if self.dp_rank == 0:
                for alias in self._aliases.get(name, [name]):
                    model[alias] = part(p)
            if holds(p):
                st = adam.state.get(p) or {}
                if "exp_avg" not in st:  # not stepped yet: no file holds its moments (the gathered form is written)
                    return None
                optim[name] = {"exp_avg": part(st["exp_avg"]), "exp_avg_sq": part(st["exp_avg_sq"]),
                               "step": torch.as_tensor(st["step"], dtype=torch.float32).detach().cpu()}
        return {"model": model, "optim": optim, **universal.with_scaler(self.scaler)}

    def load_universal(self, path: Any) -> None:
        import torch.distributed.checkpoint as dcp

        from recipes.gpt.parallel.tensor_parallel import cut, source

        params, holds, adam = self._unique_params(), self._holds_moments(), self._adam()
        target: Dict[str, Any] = {"model": {}, "optim": {}, **universal.with_scaler(self.scaler)}
        loading_scaler = universal.scaler_target(target, path)
        for p in params:  # every rank its stage's tensors, whole (DCP reads them from whatever ranks wrote them)
            name, shape = source(p)
            target["model"][name] = torch.empty(shape, dtype=torch.float32)
            if holds(p):
                target["optim"][name] = {"exp_avg": torch.empty(shape, dtype=torch.float32),
                                         "exp_avg_sq": torch.empty(shape, dtype=torch.float32),
                                         "step": torch.empty((), dtype=torch.float32)}
        dcp.load(target, checkpoint_id=str(path))
        if loading_scaler:
            universal.set_scaler(self.scaler, target[universal.SCALER])
        # AdamW keeps its step on the device where it is fused or capturable, on the host otherwise
        step_on_device = any(g.get("fused") or g.get("capturable") for g in adam.param_groups)
        with torch.no_grad():
            for p in params:
                name, _ = source(p)
                rows, cols = (p.init_spec[2], p.init_spec[3]) if hasattr(p, "init_spec") else (None, None)
                p.copy_(cut(target["model"][name], rows, cols).to(p.device, p.dtype))
                if holds(p):
                    saved = target["optim"][name]
                    adam.state[p] = {
                        "step": saved["step"].clone().to(p.device if step_on_device else "cpu"),
                        "exp_avg": cut(saved["exp_avg"], rows, cols).to(p.device, p.dtype).contiguous(),
                        "exp_avg_sq": cut(saved["exp_avg_sq"], rows, cols).to(p.device, p.dtype).contiguous()}
