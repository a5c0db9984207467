"""A Megatron-style GPT: learned positions, pre-LayerNorm blocks, tied output head.

Kept modular so tensor and pipeline parallelism can later split it along its seams:
``model.embedding`` (token + position embedding), ``model.blocks`` (a ModuleList of
decoder blocks), ``model.final_norm`` and ``model.head``.

Dropout draws from the default generator, unless an RNG tracker is attached (``recipes.gpt.rng.attach``):
then from its streams as the tensor-parallel model's dropout sites do with tp=1 (embedding and
residual dropouts: ``replicated``; attention probabilities: ``model_parallel``).
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from launcher.training.engines.contract import cross_entropy
from recipes.gpt import rng
from recipes.gpt.init import init_values

RECOMPUTE_MODES = ("none", "selective", "full")


def _mode(value: Any) -> str:
    return str(getattr(value, "value", value))


class Embedding(nn.Module):
    """Token + learned position embedding, then dropout."""

    def __init__(self, vocab_size: int, hidden_size: int, seq_len: int, dropout: float) -> None:
        super().__init__()
        self.word = nn.Embedding(vocab_size, hidden_size)
        self.position = nn.Embedding(seq_len, hidden_size)
        self.dropout = nn.Dropout(dropout)
        self.seq_len = seq_len
        self.rng: Optional[rng.RNGTracker] = None  # rng.attach

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        if length > self.seq_len:
            raise ValueError(f"sequence of {length} tokens exceeds model.seq_len={self.seq_len}")
        positions = torch.arange(length, device=tokens.device)
        return rng.dropout(self.dropout, self.word(tokens) + self.position(positions), self.rng, rng.REPLICATED)


class CausalSelfAttention(nn.Module):
    """Fused QKV projection, causal SDPA core, output projection."""

    def __init__(self, hidden_size: int, num_heads: int, dropout: float) -> None:
        super().__init__()
        if hidden_size % num_heads:
            raise ValueError(
                f"model.hidden_size={hidden_size} is not divisible by model.num_heads={num_heads}"
            )
        self.num_heads = num_heads
        self.head_dim = hidden_size // num_heads
        self.qkv = nn.Linear(hidden_size, 3 * hidden_size)
        self.proj = nn.Linear(hidden_size, hidden_size)
        self.attn_dropout = dropout
        self.resid_dropout = nn.Dropout(dropout)
        self.recompute_core = False  # set by GPT.set_recompute("selective")
        self.rng: Optional[rng.RNGTracker] = None  # rng.attach

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """softmax(q k^T / sqrt(d) + causal mask) v: the part selective recompute redoes."""
        p = self.attn_dropout if self.training else 0.0
        with rng.fork(self.rng if p > 0 else None, rng.MODEL_PARALLEL):
            return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        qkv = self.qkv(x).view(b, s, 3, self.num_heads, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each [b, heads, s, head_dim]
        if self.recompute_core and torch.is_grad_enabled():
            y = rng.checkpoint(self.core, q, k, v, tracker=self.rng)
        else:
            y = self.core(q, k, v)
        y = y.transpose(1, 2).reshape(b, s, h)
        return rng.dropout(self.resid_dropout, self.proj(y), self.rng, rng.REPLICATED)


class MLP(nn.Module):
    def __init__(self, hidden_size: int, ffn_hidden_size: int, dropout: float) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden_size, ffn_hidden_size)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(ffn_hidden_size, hidden_size)
        self.dropout = nn.Dropout(dropout)
        self.rng: Optional[rng.RNGTracker] = None  # rng.attach

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rng.dropout(self.dropout, self.fc2(self.act(self.fc1(x))), self.rng, rng.REPLICATED)


class Block(nn.Module):
    """Pre-LayerNorm decoder block: x + attn(ln1(x)), then + mlp(ln2(x))."""

    def __init__(self, hidden_size: int, num_heads: int, ffn_hidden_size: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(hidden_size)
        self.attn = CausalSelfAttention(hidden_size, num_heads, dropout)
        self.ln2 = nn.LayerNorm(hidden_size)
        self.mlp = MLP(hidden_size, ffn_hidden_size, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """GPT built from a ModelConfig-like object (attributes as in launcher.config.schema.ModelConfig).

    ``forward(tokens)`` returns logits [b, s, vocab]; ``forward(tokens, labels)`` returns
    the mean cross-entropy loss (fp32). ``seed``: the init's (``recipes.gpt.init``); None leaves the
    parameters as constructed (a sharded build initialises only its shard).
    """

    def __init__(self, config: Any, recompute: Any = "none", seed: Optional[int] = 0) -> None:
        super().__init__()
        self.num_layers = int(config.num_layers)
        self.hidden_size = int(config.hidden_size)
        self.vocab_size = int(config.vocab_size)
        self.seq_len = int(config.seq_len)
        self.tie_embeddings = bool(getattr(config, "tie_embeddings", True))
        dropout = float(getattr(config, "dropout", 0.0))

        self.embedding = Embedding(self.vocab_size, self.hidden_size, self.seq_len, dropout)
        self.blocks = nn.ModuleList(
            Block(self.hidden_size, int(config.num_heads), int(config.ffn_hidden_size), dropout)
            for _ in range(self.num_layers)
        )
        self.final_norm = nn.LayerNorm(self.hidden_size)
        self.head = nn.Linear(self.hidden_size, self.vocab_size, bias=False)
        if self.tie_embeddings:
            self.head.weight = self.embedding.word.weight
        if seed is not None:  # None: left as constructed (on the meta device, or for ZeRO-3 partitions)
            self._init_weights(int(seed))
        self.recompute = "none"
        self.rng: Optional[rng.RNGTracker] = None  # rng.attach: restored for full recompute
        self.set_recompute(recompute)

    def _init_weights(self, seed: int) -> None:
        """The shard-stable init of ``recipes.gpt.init`` (GPT-2 / Megatron: N(0, 0.02), output
        projections N(0, 0.02/sqrt(2L)), biases 0, norms 1): the values any sharded build gets too."""
        with torch.no_grad():
            for name, p in self.named_parameters():  # a tied head is the embedding's parameter
                p.copy_(init_values(seed, name, p.shape, self.num_layers))

    def set_recompute(self, mode: Any) -> None:
        """Activation recomputation: "none", "selective" (attention core) or "full" (blocks)."""
        mode = _mode(mode)
        if mode not in RECOMPUTE_MODES:
            raise ValueError(f"train.recompute must be one of {RECOMPUTE_MODES}, got {mode!r}")
        self.recompute = mode
        for block in self.blocks:
            block.attn.recompute_core = mode == "selective"

    def forward(self, tokens: torch.Tensor, labels: Optional[torch.Tensor] = None) -> torch.Tensor:
        x = self.embedding(tokens)
        full = self.recompute == "full" and torch.is_grad_enabled()
        for block in self.blocks:
            x = rng.checkpoint(block, x, tracker=self.rng) if full else block(x)
        logits = self.head(self.final_norm(x))
        if labels is None:
            return logits
        return cross_entropy(logits, labels)  # 16-bit logits: fp32 a chunk at a time, no fp32 copy of all


def count_parameters(model: nn.Module, trainable_only: bool = False) -> int:
    """Number of distinct parameters (a tied weight counts once)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)
