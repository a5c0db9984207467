"""The GPT on the ddp engine (tp = pp = 1, no ZeRO: the layouts the launcher's rules give it): the
generic ``DDPEngine`` of ``launcher.training.engines`` with the GPT built whole on every rank (seeded
before construction, its construction's memory measured for the plan's calibration) and the GPT's own
evaluation numerics (``mean_over``), as recipes/gpt/engines/fsdp.py hands the generic FSDP engine the
GPT's init."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, List, Optional, Tuple

import torch
from torch import nn

from launcher.training.engines import ddp
from launcher.training.engines.contract import ModelContract
from launcher.training.engines.engine import Batch
from recipes.common.memory import BuildMeter
from recipes.gpt.engines.base import build_model, evaluating, gpt_contract, mean_over

if TYPE_CHECKING:
    from recipes.gpt.schema import GPTRunConfig


class DDPEngine(ddp.DDPEngine):
    def __init__(self, cfg: GPTRunConfig, ctx: Any) -> None:
        super().__init__(cfg, ctx, contract=gpt_contract(cfg))

    def build(self, cfg: GPTRunConfig, ctx: Any, model_fn: Optional[Callable[[], nn.Module]],
              contract: Optional[ModelContract]) -> Tuple[nn.Module, ModelContract, bool]:
        self.build_meter = BuildMeter(self.device).start()  # what the model's construction uses
        model = build_model(cfg, self.dp_rank).to(self.device)
        self.build_meter.stop()
        return model, contract, False

    def eval_loss(self, batches: List[Batch]) -> float:
        loss_sum = torch.zeros((), device=self.device, dtype=torch.float32)
        with evaluating(self.model):  # the module itself: DDP's hooks and buffer syncs stay out of it
            for tokens, labels in batches:
                with self.autocast():
                    loss = self.model(tokens.to(self.device), labels=labels.to(self.device))
                loss_sum += loss.float()
        return mean_over(loss_sum, len(batches), world=self.world)
