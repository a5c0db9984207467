"""Recording dropout masks (test-only), in one process or inside a real launched job.

``record_masks(model, fn)`` runs ``fn()`` and returns every mask drawn on the way, keyed by site:
``<module>`` for each ``nn.Dropout`` (the kept positions: output != 0), ``attn.<i>`` for the i-th
attention core with dropout (the kept attention probabilities [b, heads, s, s]: drawn, from the same
generator state, exactly as the CPU SDPA kernel draws them; ``sdpa_mask_is_exact`` checks that).

``main(cfg, ctx)`` is a recipe (``recipe._target_=dropout_probe.main``): it builds the run's engine,
records the masks of one training-mode forward of its model, and on rank 0 those of the single-process
GPT with the same seed and an RNG tracker of dp=pp=tp rank 0; each rank saves them as
``<run dir>/probe/masks_rank<r>.pt`` ({"tp_rank", "sequence_parallel", "masks", "single"}).
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Callable, Dict, Iterator, List

import torch
import torch.nn.functional as F
from torch import nn

TOKENS_SEED = 5


@contextlib.contextmanager
def _recording_sdpa(out: List[torch.Tensor]) -> Iterator[None]:
    real = F.scaled_dot_product_attention

    def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kw):
        if dropout_p > 0:
            assert q.device.type == "cpu", "the mask is recorded as the CPU kernel draws it"
            state = torch.get_rng_state()
            out.append(F.dropout(torch.ones((*q.shape[:-1], k.shape[-2]), dtype=q.dtype), dropout_p) != 0)
            torch.set_rng_state(state)
        return real(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kw)

    F.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = real


def record_masks(model: nn.Module, fn: Callable[[], object]) -> Dict[str, torch.Tensor]:
    masks: Dict[str, torch.Tensor] = {}
    attn: List[torch.Tensor] = []
    hooks = []
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Dropout):
            hooks.append(mod.register_forward_hook(
                lambda m, i, o, name=name: masks.__setitem__(name, (o != 0).detach().cpu())))
    try:
        with _recording_sdpa(attn):
            fn()
    finally:
        for h in hooks:
            h.remove()
    masks.update({f"attn.{i}": m for i, m in enumerate(attn)})
    return masks


def sdpa_mask_is_exact(p: float = 0.25) -> bool:
    """The recorded attention mask is the one SDPA applied: out == (softmax(qk^T/sqrt(d) + causal) * keep
    / (1-p)) v, for an SDPA call with dropout on this machine's CPU kernel."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 8, 4, generator=g) for _ in range(3))
    got: List[torch.Tensor] = []
    torch.manual_seed(1)
    with _recording_sdpa(got):
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
    (keep,) = got
    scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(torch.ones(8, 8, dtype=torch.bool).triu(1), float("-inf"))
    want = (scores.softmax(-1) * keep / (1 - p)) @ v
    return bool(torch.allclose(out, want, atol=1e-6)) and 0 < float(keep.float().mean()) < 1


def tokens_for(cfg) -> torch.Tensor:
    b = int(cfg.train.micro_batch_size)
    g = torch.Generator().manual_seed(TOKENS_SEED)
    return torch.randint(0, int(cfg.model.vocab_size), (b, int(cfg.model.seq_len)), generator=g)


def main(cfg, ctx) -> dict:
    from recipes.gpt import rng
    from recipes.gpt.engines import build_engine
    from recipes.gpt.model import GPT

    engine = build_engine(cfg, ctx)
    tokens = tokens_for(cfg).to(ctx.device)
    stage = engine.stage.train()
    masks = record_masks(stage, lambda: stage(tokens))
    single = None
    if ctx.rank == 0:
        model = GPT(cfg.model, seed=int(cfg.seed)).to(ctx.device).train()
        rng.attach(model, rng.dropout_tracker(int(cfg.seed), 0, 0, 0, ctx.device))
        single = record_masks(model, lambda: model(tokens))
    out = Path(ctx.rundir.path) / "probe"
    out.mkdir(exist_ok=True)
    torch.save({"tp_rank": engine.mesh.tp_rank, "sequence_parallel": engine.sequence_parallel, "masks": masks,
                "single": single}, out / f"masks_rank{ctx.rank}.pt")
    return {}
