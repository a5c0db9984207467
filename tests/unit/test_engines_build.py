"""launcher.training.engines' contract defaults and the layout-independent construction (pure: one
process, no process group)."""
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch import nn

from launcher.training.engines import ModelContract, contract_for, plain_contract
from launcher.training.engines.build import build_model, params_on_meta

VOCAB = 32


class Block(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(h), nn.Linear(h, h)

    def forward(self, x):
        return x + self.fc(self.norm(x))


class LossNet(nn.Module):
    """forward(tokens, labels) -> the loss; blocks in a ModuleList (and a smaller one beside it)."""

    def __init__(self, layers=2, h=8):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, h)
        self.blocks = nn.ModuleList(Block(h) for _ in range(layers))
        self.tiny = nn.ModuleList([nn.Linear(h, 1)])
        self.head = nn.Linear(h, VOCAB)
        self.register_buffer("scale", torch.arange(h, dtype=torch.float32))

    def forward(self, tokens, labels=None):
        x = self.emb(tokens)
        for b in self.blocks:
            x = b(x)
        logits = self.head(x)
        return logits if labels is None else F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1)) + 1.0


class LogitsNet(LossNet):
    def forward(self, tokens):  # no labels: the engines score the logits
        return super().forward(tokens)


class RawParam(LossNet):
    """A parameter of its own that nothing re-initialises from meta."""

    def __init__(self):
        super().__init__()
        self.gain = nn.Parameter(torch.randn(8))


def _batch():
    g = torch.Generator().manual_seed(0)
    t = torch.randint(0, VOCAB, (2, 5), generator=g)
    return t, torch.roll(t, -1, 1)


def _tiny_llama(layers=2):
    transformers = pytest.importorskip("transformers")
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=layers, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=16))


def test_plain_defaults_loss_from_forward_or_from_logits():
    model = LossNet()
    c = contract_for(model)
    assert c.name == "plain" and c.blocks(model) == list(model.blocks)  # the largest ModuleList
    tokens, labels = _batch()
    assert torch.equal(c.loss(model, (tokens, labels)), model(tokens, labels=labels))
    logits_model = LogitsNet()
    want = F.cross_entropy(logits_model(tokens).reshape(-1, VOCAB), labels.reshape(-1))
    assert torch.allclose(contract_for(logits_model).loss(logits_model, (tokens, labels)), want)


def test_a_models_own_contract_and_a_given_one_win():
    mine = dataclasses.replace(plain_contract(LossNet()), blocks=lambda m: [m.head], name="mine")

    class Own(LossNet):
        def launcher_contract(self):
            return mine

    assert contract_for(Own()) is mine
    given = ModelContract(loss=lambda m, b: m(*b), blocks=lambda m: [], name="given")
    assert contract_for(Own(), given) is given

    class Wrong(LossNet):
        def launcher_contract(self):
            return {"loss": None}

    with pytest.raises(TypeError, match="not a launcher.training.engines.ModelContract"):
        contract_for(Wrong())


def test_hf_causal_lm_default():
    model = _tiny_llama()
    c = contract_for(model)
    assert c.name == "hf_causal_lm" and c.blocks(model) == list(model.model.layers)
    tokens, labels = _batch()
    want = F.cross_entropy(model(input_ids=tokens).logits.reshape(-1, VOCAB), labels.reshape(-1))
    assert torch.allclose(c.loss(model, (tokens, labels)), want)


def test_meta_construction_keeps_buffers_real():
    with params_on_meta():
        model = _tiny_llama()
    assert all(p.is_meta for p in model.parameters())
    real = dict(_tiny_llama().named_buffers())
    for name, buf in model.named_buffers():  # the rotary inv_freq, computed by the constructor
        assert not buf.is_meta and torch.equal(buf, real[name]), name


@pytest.mark.parametrize("make", [LossNet, _tiny_llama], ids=["plain", "hf"])
def test_initial_values_depend_on_seed_and_name_only(make):
    """Each parameter's values are a function of (seed, its module's name): the same on every build,
    whatever the units are handed to (an engine sharding them), and the same in a deeper model for the
    parameters both have; another seed changes them. Nothing is left uninitialised."""
    taken = []
    a, _, first = build_model(lambda: make(2), 7, take=lambda unit, name: taken.append(name))
    b, _, _ = build_model(lambda: make(2), 7)
    deeper, _, _ = build_model(lambda: make(3), 7)
    other, _, _ = build_model(lambda: make(2), 8)
    assert first and taken[-1] == "" and len(taken) == 3  # two blocks, then the root
    pa, pd, po = dict(a.named_parameters()), dict(deeper.named_parameters()), dict(other.named_parameters())
    for name, p in b.named_parameters():
        assert not p.is_meta and bool(torch.isfinite(p).all()), name
        assert torch.equal(p, pa[name]) and torch.equal(p, pd[name]), name
    weights = [n for n, p in pa.items() if p.numel() > 1 and p.detach().std() > 0]  # (not norms, biases)
    assert weights and all(not torch.equal(pa[n], po[n]) for n in weights)


def test_hf_init_is_its_own_init_weights():
    model, _, _ = build_model(_tiny_llama, 3)
    std = model.config.initializer_range
    assert torch.equal(model.model.norm.weight, torch.ones(16))
    assert abs(float(model.model.layers[0].mlp.up_proj.weight.detach().std()) - std) < 0.3 * std


def test_a_parameter_no_init_covers_builds_the_model_for_real(capsys):
    said = []
    a, _, shard_first = build_model(RawParam, 5, log=said.append)
    b, _, _ = build_model(RawParam, 5, log=said.append)
    assert not shard_first and "<root> (RawParam)" in said[0] and "reset_parameters()" in said[0]
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))  # seeded: every layout agrees
    assert all(not p.is_meta for p in a.parameters())


def test_gpt_contract_builds_the_gpts_own_weights():
    from recipes.gpt.engines.base import gpt_contract
    from recipes.gpt.model import GPT

    cfg = OmegaConf.create({"seed": 3, "train": {"recompute": "none"}, "model": dict(
        num_layers=2, hidden_size=16, num_heads=2, ffn_hidden_size=32, vocab_size=VOCAB, seq_len=8)})
    model, _, shard_first = build_model(lambda: GPT(cfg.model, seed=None), 3, gpt_contract(cfg))
    want = GPT(cfg.model, seed=3).state_dict()
    assert shard_first and model.head.weight is model.embedding.word.weight
    assert all(torch.equal(v, want[k]) for k, v in model.state_dict().items())


def test_ddp_engine_in_one_process_trains_and_resumes_from_its_files(tmp_path):
    """The DDP engine without a process group (one process): steps, eval, and its checkpoint file
    loaded into a fresh engine continues bitwise."""
    from launcher.config.layout import Layout
    from launcher.config.schema import RunConfig
    from launcher.training.engines import build_engine

    cfg = OmegaConf.merge(OmegaConf.structured(RunConfig), {"seed": 2, "optim": {"lr": 1e-2}})
    ctx = type("Ctx", (), {"layout": Layout(dp=1, engine="ddp"), "world_size": 1, "rank": 0, "device": "cpu",
                           "is_main": True})()
    batches = [_batch(), _batch()]
    eng = build_engine(cfg, ctx, LossNet)
    first = eng.train_step(batches, 1e-2)[0]
    torch.save(eng.checkpoint_files()["model.pt"], tmp_path / "model.pt")
    again = build_engine(cfg, ctx, LossNet)
    again.load_checkpoint(tmp_path)
    losses = [e.train_step(batches, 1e-2)[0] for e in (eng, again)]
    assert losses[0] == losses[1] < first
    assert all(torch.equal(v, again.local_state()[k]) for k, v in eng.local_state().items())
    assert eng.eval_loss(batches) == again.eval_loss(batches)


def _one_process(cfg_overrides, make):
    from launcher.config.layout import Layout
    from launcher.config.schema import RunConfig
    from launcher.training.engines import build_engine

    cfg = OmegaConf.merge(OmegaConf.structured(RunConfig), {"seed": 2, "optim": {"lr": 1e-2}, **cfg_overrides})
    ctx = type("Ctx", (), {"layout": Layout(dp=1, engine="ddp"), "world_size": 1, "rank": 0, "device": "cpu",
                           "is_main": True})()
    return build_engine(cfg, ctx, make)


@pytest.mark.parametrize("make", [LossNet, _tiny_llama], ids=["plain", "hf"])
def test_full_recompute_of_the_blocks_changes_no_value(make):
    """train.recompute=full: each block's forward runs again in its backward; the step's loss, the
    weights and Adam's state after it are bitwise those without recompute."""
    plain, again = (_one_process({"train": {"recompute": r}}, make) for r in ("none", "full"))
    recomputed = []
    for block in again.contract.blocks(again.model):  # (the block's own hooks wrap its call, run once)
        inner = next(m for m in block.modules() if m is not block and list(m.parameters(recurse=False)))
        inner.register_forward_hook(lambda *_: recomputed.append(1))
    losses = [e.train_step([_batch()], 1e-2) for e in (plain, again)]
    assert losses[0] == losses[1]
    assert len(recomputed) == 2 * len(again.contract.blocks(again.model))  # forward, then again in backward
    assert all(torch.equal(v, again.local_state()[k]) for k, v in plain.local_state().items())


def test_selective_recompute_needs_the_models_own_support():
    with pytest.raises(ValueError, match="train.recompute=selective"):
        _one_process({"train": {"recompute": "selective"}}, LossNet)


def test_adamw_is_fused_on_cuda_parameters_only():
    """Fused AdamW where every parameter is a floating CUDA tensor; on the CPU torch's default
    (foreach) as before."""
    from types import SimpleNamespace

    from launcher.training.engines.engine import adamw, fused_kwargs, on_cuda

    def fake(device, floating=True):
        return SimpleNamespace(device=torch.device(device), is_floating_point=lambda: floating)

    assert on_cuda([fake("cuda:0"), fake("cuda:0")])
    assert not on_cuda([fake("cuda:0"), fake("cpu")])
    assert not on_cuda([fake("cuda:0", floating=False)])
    assert not on_cuda([])
    assert fused_kwargs(True) == {"fused": True} and fused_kwargs(False) == {}
    optim = OmegaConf.create({"name": "adamw", "lr": 1e-3, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8,
                              "weight_decay": 0.1})
    assert not adamw(LossNet(), optim).defaults.get("fused")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_cross_entropy_in_chunks_matches_the_fp32_copy(dtype, monkeypatch):
    """16-bit logits: the loss and its gradient by chunks of rows (no fp32 copy of all logits) equal
    F.cross_entropy on the fp32 copy to fp32 rounding (the gradient to the logits' own rounding); an
    ignored label counts nowhere. fp32 logits: F.cross_entropy itself, bitwise."""
    from launcher.training.engines import contract

    monkeypatch.setattr(contract, "CHUNK_BYTES", 4 * VOCAB * 3)  # 3 rows a chunk: 10 rows in 4 chunks
    g = torch.Generator().manual_seed(1)
    base = (torch.randn(2, 5, VOCAB, generator=g) * 3).to(dtype)
    labels = torch.randint(0, VOCAB, (2, 5), generator=g)
    labels[1, 2] = contract.IGNORE_INDEX
    got_in, ref_in = base.clone().requires_grad_(), base.clone().requires_grad_()
    got = contract.cross_entropy(got_in, labels)
    ref = F.cross_entropy(ref_in.float().reshape(-1, VOCAB), labels.reshape(-1))
    got.backward()
    ref.backward()
    assert got.dtype == torch.float32 and got_in.grad.dtype == dtype
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_in.grad.float(), ref_in.grad.float(), rtol=1e-2, atol=1e-4)
    assert torch.all(got_in.grad[1, 2] == 0)
    x = torch.randn(2, 5, VOCAB, generator=g)
    assert torch.equal(contract.cross_entropy(x, labels), F.cross_entropy(x.reshape(-1, VOCAB), labels.reshape(-1)))
