"""The planner's pure estimators against exact counts, published figures and DeepSpeed's own estimators."""
from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from launcher.app import CONF_DIR
from recipes.gpt.plan import comm as comm_mod
from recipes.gpt.plan.flops import model_flops_per_token, narayanan_flops_per_step, step_flops, training_flops_per_token
from recipes.gpt.plan.memory import (
    deepspeed_zero2_estimate,
    deepspeed_zero3_estimate,
    layer_activation_bytes,
    layout_memory,
    model_state_bytes,
    model_state_bytes_per_rank,
    zero_paper_bytes,
)
from recipes.gpt.plan.params import largest_layer_params, param_count, param_count_formula, stage_params
from recipes.gpt.plan.search import enumerate_layouts, search
from recipes.gpt.plan.spec import GIB, ClusterSpec, LayoutSpec
from recipes.gpt.plan.timing import bubble_fraction
from recipes.gpt.schema import GPTRunConfig as RunConfig, ModelSpec

# the GPT's model configs (one with a _target_ is a module for recipe=lm, conf/model/hf_llama_tiny.yaml)
MODELS = sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml") if "_target_" not in OmegaConf.load(p))
GPT_175B = ModelSpec("gpt_175b", 96, 12288, 96, 49152, 50304, 2048)
A100 = ClusterSpec("a100_80g", 128, 8, memory_bytes=80 * GIB, peak_flops=312e12, intra_bw=300e9, inter_bw=25e9)


def model_spec(name: str) -> ModelSpec:
    base = OmegaConf.merge(OmegaConf.structured(RunConfig().model), OmegaConf.load(CONF_DIR / "model" / f"{name}.yaml"))
    return ModelSpec.from_cfg(base)


def run_cfg(**sections):
    tiny = OmegaConf.load(CONF_DIR / "model" / "gpt_tiny.yaml")
    over = {"cluster": {"name": "unit", "nodes": 1, "gpus_per_node": 2}, "model": tiny,
            "recipe": {"_target_": "recipes.gpt.train.main"}}
    for k, v in sections.items():
        over[k] = {**over.get(k, {}), **v}
    return OmegaConf.merge(OmegaConf.structured(RunConfig), over)


# ---- parameters -------------------------------------------------------------------------------------


def test_exact_param_count_matches_the_real_gpt_tiny():
    from recipes.gpt.model import GPT, count_parameters

    for tie in (True, False):
        cfg = OmegaConf.load(CONF_DIR / "model" / "gpt_tiny.yaml")
        cfg.tie_embeddings = tie
        assert param_count(ModelSpec.from_cfg(cfg)) == count_parameters(GPT(cfg))
    assert param_count(model_spec("gpt_tiny")) == 136_960


@pytest.mark.parametrize("name", MODELS)
def test_exact_param_count_of_every_model_config(name):
    """Big configs are not instantiated: exact count = usual formula + final norm (+ untied head),
    the formula's (1 + 13/(12h)) term generalised for f != 4h."""
    m = model_spec(name)
    l, h, f, v, s = m.num_layers, m.hidden_size, m.ffn_hidden_size, m.vocab_size, m.seq_len
    exact = param_count(m)
    independent = (v + s) * h + l * (2 * h + 3 * h * h + 3 * h + h * h + h + 2 * h + h * f + f + f * h + h) + 2 * h
    assert exact == independent + (0 if m.tie_embeddings else v * h)
    if f == 4 * h and m.tie_embeddings:
        assert exact == param_count_formula(l, h, v, s) + 2 * h
        assert param_count_formula(l, h, v, s) == round(12 * l * h * h * (1 + 13 / (12 * h) + (v + s) / (12 * l * h)))


def test_published_sizes():
    assert param_count(model_spec("gpt_175b")) == 174_604_836_864  # "175B"
    assert param_count(model_spec("gpt_1b3")) == 1_315_819_520  # "1.3B"
    assert param_count(model_spec("gpt_125m")) == 125_262_336  # "125M"
    # llama_7b is LLaMA-7B's shape run as our block: its published 6,738,415,616 parameters, less the
    # third (gate) MLP matrix per layer, plus learned positions, biases and LayerNorm (not RMSNorm) shifts
    h, f, l = 4096, 11008, 32
    llama = 6_738_415_616 - l * h * f + 2048 * h + l * (7 * h + f) + h
    assert param_count(model_spec("llama_7b")) == llama == 5_305_237_504


def _module_split(model, tp: int):
    """Per-tp-rank parameter count of every module of a real GPT, by the Megatron split rules."""
    col = ("attn.qkv", "mlp.fc1")
    row = ("attn.proj", "mlp.fc2")
    out = {}
    for name, p in model.named_parameters():
        n = p.numel()
        if name.startswith("embedding.word") or name.startswith("head"):
            n //= tp
        elif any(name.endswith(c + ".weight") or name.endswith(c + ".bias") for c in col):
            n //= tp
        elif any(name.endswith(r + ".weight") for r in row):
            n //= tp
        out[name] = n
    return out


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (4, 1), (1, 2), (2, 2)])
def test_per_rank_params_against_the_real_modules(tp, pp, tie):
    from recipes.gpt.model import GPT

    cfg = OmegaConf.load(CONF_DIR / "model" / "gpt_tiny.yaml")
    cfg.tie_embeddings = tie
    model = GPT(cfg)
    split = _module_split(model, tp)
    L = model.num_layers // pp
    first = sum(n for k, n in split.items() if k.startswith("embedding.")) + sum(
        n for k, n in split.items() if k.startswith("blocks.") and int(k.split(".")[1]) < L)
    last = sum(n for k, n in split.items() if k.startswith("blocks.") and int(k.split(".")[1]) >= model.num_layers - L)
    last += sum(n for k, n in split.items() if k.startswith("final_norm") or k.startswith("head"))
    if tie and pp > 1:
        last += split["embedding.word.weight"]  # the last stage's copy of the tied word embedding
    got = stage_params(ModelSpec.from_cfg(cfg), tp, pp)
    if pp == 1:
        assert got.first == got.last == first + last - sum(
            n for k, n in split.items() if k.startswith("blocks."))  # blocks counted once
    else:
        assert (got.first, got.last) == (first, last)


def test_largest_layer_matches_deepspeeds_model_to_params():
    from deepspeed.runtime.zero.stage3 import model_to_params

    from recipes.gpt.model import GPT

    for name in ("gpt_tiny",):
        cfg = OmegaConf.load(CONF_DIR / "model" / f"{name}.yaml")
        for tie in (True, False):
            cfg.tie_embeddings = tie
            total, largest = model_to_params(GPT(cfg))
            m = ModelSpec.from_cfg(cfg)
            assert (param_count(m), largest_layer_params(m)) == (total, largest)


# ---- model states ---------------------------------------------------------------------------------

# Table 1 of Rajbhandari et al. 2020 (ZeRO), 7.5B model, K = 12: GB per device for P_os, P_os+g, P_os+g+p.
ZERO_TABLE_1 = {
    1: (120, 120, 120),
    4: (52.5, 41.3, 30),
    16: (35.6, 21.6, 7.5),
    64: (31.4, 16.6, 1.88),
    256: (30.4, 15.4, 0.47),
    1024: (30.1, 15.1, 0.12),
}


def _printed_equal(value: float, printed: float) -> bool:
    """value rounds to the printed figure (within half a unit of its last digit)."""
    text = repr(float(printed)).rstrip("0").rstrip(".")
    decimals = len(text.split(".")[1]) if "." in text else 0
    return abs(value - printed) <= 0.5 * 10 ** -decimals + 1e-9


@pytest.mark.parametrize("nd", sorted(ZERO_TABLE_1))
def test_zero_paper_table_1(nd):
    psi = 7_500_000_000
    paper = ZERO_TABLE_1[nd]
    formula = zero_paper_bytes(psi, nd, k=12)
    assert formula["baseline"] == 120e9
    ours = [sum(model_state_bytes(psi, nd, z, (2, 2, 12)).values()) / 1e9 for z in (1, 2, 3)]
    for got, f, printed in zip(ours, (formula["os"], formula["os+g"], formula["os+g+p"]), paper):
        assert got == pytest.approx(f / 1e9, abs=1e-6)  # the planner's path == the paper's formulas
        assert _printed_equal(got, printed), (nd, got, printed)
    assert sum(model_state_bytes(psi, nd, 0, (2, 2, 12)).values()) == 120e9


def test_zero_paper_numbers_spelled_out():
    psi = 7_500_000_000
    assert zero_paper_bytes(psi, 64) == {"baseline": 120e9, "os": 31.40625e9, "os+g": 16.640625e9, "os+g+p": 1.875e9}


DS_CASES = [
    # total params, largest layer params, gpus per node, nodes
    (7_500_000_000, 210_000_000, 8, 8),
    (1_315_819_520, 103_022_592, 8, 1),
    (174_604_836_864, 618_135_552, 8, 128),
    (6_738_415_616, 131_072_000, 4, 3),
    (136_960, 32_768, 2, 1),
]


@pytest.mark.parametrize("total,largest,gpn,nodes", DS_CASES)
def test_deepspeed_zero2_estimator_same_inputs_same_outputs(total, largest, gpn, nodes):
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    for offload in (True, False):
        for factor in (1.5, 1.0):
            assert deepspeed_zero2_estimate(total, gpn, nodes, offload, factor) == \
                estimate_zero2_model_states_mem_needs(total, gpn, nodes, offload, factor)


@pytest.mark.parametrize("total,largest,gpn,nodes", DS_CASES)
def test_deepspeed_zero3_estimator_same_inputs_same_outputs(total, largest, gpn, nodes):
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

    for offload in (True, False):
        for offload_params in (True, False):
            for zero_init in (True, False):
                ours = deepspeed_zero3_estimate(total, largest, gpn, nodes, offload, offload_params, zero_init, 1.5)
                theirs = estimate_zero3_model_states_mem_needs(total, largest, gpn, nodes, offload, offload_params,
                                                               zero_init, 1.5)
                assert ours == theirs


@pytest.mark.parametrize("name,gpn,nodes", [("gpt_1b3", 8, 1), ("llama_7b", 8, 2), ("gpt_175b", 8, 64)])
def test_layout_memory_against_deepspeed_on_our_models(name, gpn, nodes):
    """Our ZeRO-2/3 GPU figure for a deepspeed layout decomposes into DeepSpeed's estimate plus what it
    leaves out: ZeRO-2 the reduce bucket; ZeRO-3 the 16-bit gradient shard."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    m = model_spec(name)
    P, n = param_count(m), gpn * nodes
    z2 = layout_memory(m, LayoutSpec(dp=n, zero=2, dtype="bf16"))
    _, ds2 = estimate_zero2_model_states_mem_needs(P, gpn, nodes, cpu_offload=False)
    assert z2.params + z2.grads + z2.optimizer + z2.buffers - min(5e8, P) * 2 == pytest.approx(ds2, abs=64)
    z3 = layout_memory(m, LayoutSpec(dp=n, zero=3, dtype="bf16"))
    _, ds3, _ = estimate_zero3_model_states_mem_needs(P, largest_layer_params(m), gpn, nodes, cpu_offload=False,
                                                      cpu_offload_params=False)
    assert z3.params + z3.grads + z3.optimizer + z3.buffers - z3.grads == pytest.approx(ds3, abs=64)
    z3o = layout_memory(m, LayoutSpec(dp=n, zero=3, dtype="bf16", offload_optimizer=True, offload_params=True))
    _, ds3o, _ = estimate_zero3_model_states_mem_needs(P, largest_layer_params(m), gpn, nodes)
    assert z3o.params + z3o.optimizer + z3o.buffers == ds3o
    assert z3o.cpu == pytest.approx((2 + 4 + 12) * P / n, abs=64)  # DeepSpeed's 18 bytes per param on CPU


def test_model_state_bytes_per_rank_is_exact_for_fp32_adamw():
    """A real AdamW step (the recipe's optimizer) on gpt_tiny: bytes of params, grads, exp_avg + exp_avg_sq."""
    import torch

    from launcher.training.engines.engine import adamw, optimizer_state_bytes, tensor_bytes
    from recipes.gpt.model import GPT

    cfg = run_cfg()
    model = GPT(cfg.model)
    opt = adamw(model, cfg.optim)
    for p in model.parameters():  # what backward leaves (values do not matter for the byte count)
        p.grad = torch.zeros_like(p)
    opt.step()
    measured = {
        "params": tensor_bytes(model.parameters()),
        "grads": tensor_bytes(p.grad for p in model.parameters()),
        "optimizer": optimizer_state_bytes(opt),
    }
    assert model_state_bytes_per_rank(cfg) == measured == {"params": 547_840, "grads": 547_840, "optimizer": 1_095_680}


@pytest.mark.parametrize(
    "sections,expected",
    [
        # gpt_tiny: 136,960 params; dp = 2 (1 node x 2)
        ({}, {"params": 4 * 136_960, "grads": 4 * 136_960, "optimizer": 8 * 136_960}),
        ({"precision": {"dtype": "bf16"}}, {"params": 4 * 136_960, "grads": 4 * 136_960, "optimizer": 8 * 136_960}),
        # DeepSpeed keeps an fp32 master copy at ZeRO >= 1 even in fp32 (measured: 6 B/param at dp=2)
        ({"zero": {"stage": 1}}, {"params": 4 * 136_960, "grads": 4 * 136_960, "optimizer": 12 * 68_480}),
        ({"zero": {"stage": 2}, "precision": {"dtype": "bf16"}},
         {"params": 2 * 136_960, "grads": 2 * 68_480, "optimizer": 12 * 68_480}),
        ({"zero": {"stage": 3}, "precision": {"dtype": "bf16"}, "cluster": {"gpus_per_node": 3},
          "train": {"global_batch_size": 12}},  # a whole layout: dp 3 x micro batch 4
         {"params": 2 * 45_654, "grads": 2 * 45_654, "optimizer": 12 * 45_654}),  # ceil(136960 / 3)
        ({"zero": {"stage": 3, "offload_optimizer": True, "offload_params": True}, "precision": {"dtype": "bf16"}},
         {"params": 0, "grads": 0, "optimizer": 0}),  # offloaded optimizer takes the grad partitions along
    ],
)
def test_model_state_bytes_per_rank_zero_and_precision(sections, expected):
    assert model_state_bytes_per_rank(run_cfg(**sections)) == expected


def test_model_state_bytes_per_rank_tp_pp():
    """tp=2, pp=2 on 4 ranks of gpt_tiny (h 64, f 256, V 512, s 64, 2 layers), megatron, fp32."""
    cfg = run_cfg(parallelism={"tp": 2, "pp": 2}, cluster={"gpus_per_node": 4})
    h, f, v, s = 64, 256, 512, 64
    layer = (4 * h * h + 2 * h * f + 3 * h + f) // 2 + 6 * h
    first = layer + v * h // 2 + s * h
    last = layer + 2 * h + v * h // 2
    assert model_state_bytes_per_rank(cfg, stage=0) == {"params": 4 * first, "grads": 4 * first, "optimizer": 8 * first}
    assert model_state_bytes_per_rank(cfg, stage=1)["params"] == 4 * last
    assert model_state_bytes_per_rank(cfg)["params"] == 4 * max(first, last)


# ---- activations ------------------------------------------------------------------------------------


@pytest.mark.parametrize("t", [1, 2, 8])
def test_activations_match_korthikanti(t):
    """Korthikanti et al. 2022, Table 2: per layer, 16-bit, with dropout, without a fused attention."""
    m = ModelSpec("gpt3", 96, 12288, 96, 4 * 12288, 50304, 2048, dropout=0.1)
    s, b, h, a = 2048, 1, 12288, 96
    sbh = s * b * h

    def act(**kw):
        return layer_activation_bytes(m, b, t, e=2, fused_attention=False, **kw)[0]

    assert act() == sbh * (10 + 24 / t + 5 * a * s / (h * t))
    assert act(sequence_parallel=t > 1) == pytest.approx(sbh * (34 + 5 * a * s / h) / t, abs=1)
    assert act(recompute="selective") == sbh * (10 + 24 / t)
    assert act(recompute="selective", sequence_parallel=t > 1) == pytest.approx(sbh * 34 / t, abs=1)
    assert act(recompute="full") == 2 * sbh
    if t == 1:
        assert act() == sbh * (34 + 5 * a * s / h)  # 114 s b h for GPT-3: 5.6 GiB per layer at b = 1


def test_fused_attention_keeps_no_s_squared_term():
    m = model_spec("gpt_1b3")
    fused, _ = layer_activation_bytes(m, 1, fused_attention=True)
    s, h, a = m.seq_len, m.hidden_size, m.num_heads
    # LN1/LN2 and qkv/fc1 inputs, q k v + proj input, GELU + fc2 inputs, fp32 log-sum-exp
    assert fused == s * h * (2 * 2 + 2 * 2) + s * h * 4 * 2 + s * m.ffn_hidden_size * 2 * 2 + 4 * a * s


def test_first_1f1b_stage_holds_p_micro_batches():
    m = model_spec("gpt_1b3")
    stored, _ = layer_activation_bytes(m, 1, 1, e=2)
    for pp, accum, in_flight in ((4, 8, 4), (4, 2, 2), (2, 16, 2)):
        mem = layout_memory(m, LayoutSpec(dp=1, pp=pp, micro_batch_size=1, grad_accum=accum, dtype="bf16"))
        assert mem.stage == "first"
        assert mem.activations == in_flight * (m.num_layers // pp) * stored
    # p in flight of l/p layers: the first stage holds a whole model's worth for one micro-batch
    full = layout_memory(m, LayoutSpec(dp=1, pp=4, micro_batch_size=1, grad_accum=8, dtype="bf16"))
    assert full.activations == m.num_layers * stored


def test_full_recompute_keeps_inputs_plus_one_working_layer():
    m = model_spec("gpt_1b3")
    stored, full = layer_activation_bytes(m, 2, recompute="full", e=2)
    assert stored == 2 * m.seq_len * m.hidden_size * 2
    mem = layout_memory(m, LayoutSpec(dp=1, micro_batch_size=2, recompute="full", dtype="bf16", engine="deepspeed"))
    logits = m.seq_len * 2 * m.vocab_size * (2 + 4) + m.seq_len * 2 * m.hidden_size * 4
    assert mem.activations == m.num_layers * stored + (full - stored) + logits


# ---- FLOPs, communication, bubble ------------------------------------------------------------------


def test_flops_match_narayanan_and_the_hand_count():
    m = GPT_175B
    assert step_flops(m, 1536, "none") == pytest.approx(narayanan_flops_per_step(m, 1536, False), rel=1e-12)
    assert step_flops(m, 1536, "full") == pytest.approx(narayanan_flops_per_step(m, 1536, True), rel=1e-12)
    # what MFU divides by (the recipes call model_flops_per_token): 6 N_matmul + 12 l h s, counted by
    # hand: N_matmul = l (qkv 3h^2 + proj h^2 + fc1 hf + fc2 fh) + head V h
    l, h, f, v, s = 96, 12288, 49152, 50304, 2048
    n_matmul = l * (3 * h * h + h * h + h * f + f * h) + v * h
    assert model_flops_per_token(m) == training_flops_per_token(m) == 6.0 * n_matmul + 12.0 * l * h * s
    assert model_flops_per_token(m) == 1_076_376_895_488  # exact: every term is an integer < 2^53
    n = param_count(m)
    # 6N + 12 l h s: N counts matmul weights (the head's V*h once, no position embedding or biases)
    assert training_flops_per_token(m) == pytest.approx(6 * n + 12 * 96 * 12288 * 2048, rel=1e-3)
    assert training_flops_per_token(m, "selective") - training_flops_per_token(m) == 4 * 96 * 12288 * 2048
    assert step_flops(m, 1536) == pytest.approx(3.39e18, rel=2e-3)


def test_comm_volume_zero_stages_paper_ratios():
    """ZeRO paper sec. 7: DP all-reduce 2Psi, ZeRO-1/2 2Psi (reduce-scatter + all-gather), ZeRO-3 3Psi."""
    m = model_spec("gpt_1b3")
    sp = stage_params(m)
    vol = [comm_mod.comm_volume(m, LayoutSpec(dp=64, zero=z, dtype="bf16", engine="deepspeed"), sp).dp
           for z in range(4)]
    psi_bytes = 2 * 63 / 64 * param_count(m)  # one ring pass over the 16-bit model
    assert vol == pytest.approx([2 * psi_bytes, 2 * psi_bytes, 2 * psi_bytes, 3 * psi_bytes])
    # ZeRO-2 reduce-scatters every micro-batch, ZeRO-3 all-gathers twice and reduce-scatters every micro-batch
    z2 = comm_mod.comm_volume(m, LayoutSpec(dp=64, zero=2, grad_accum=4, dtype="bf16"), sp).dp
    z3 = comm_mod.comm_volume(m, LayoutSpec(dp=64, zero=3, grad_accum=4, dtype="bf16"), sp).dp
    assert (z2, z3) == pytest.approx((5 * psi_bytes, 12 * psi_bytes))


def test_comm_volume_tp_and_pp():
    m = GPT_175B
    lay = LayoutSpec(dp=16, tp=8, pp=8, micro_batch_size=1, grad_accum=96, dtype="bf16")
    v = comm_mod.comm_volume(m, lay, stage_params(m, 8, 8))
    A = 2048 * 12288 * 2
    per_mb_tp = 12 * 4 * 2 * 7 / 8 * A + 2 * 7 / 8 * A + 3 * 2 * 7 / 8 * 2048 * 4
    assert v.tp == pytest.approx(96 * per_mb_tp)
    assert v.pp == pytest.approx(96 * 2 * A + 50304 * 12288 / 8 * 2)
    sp = comm_mod.comm_volume(m, lay.with_(sequence_parallel=True), stage_params(m, 8, 8))
    assert sp.tp == v.tp and sp.pp == pytest.approx(96 * 2 * A / 8 + 50304 * 12288 / 8 * 2)


def test_bubble():
    assert bubble_fraction(1, 8) == 0
    assert bubble_fraction(4, 12) == 3 / 15
    assert bubble_fraction(8, 96) == pytest.approx(7 / 103)


# ---- search -----------------------------------------------------------------------------------------


def test_search_gpt_175b_on_1024_a100s():
    ranked = search(GPT_175B, A100, 1536, "bf16")
    assert len(ranked) == len(list(enumerate_layouts(GPT_175B, A100, 1536, "bf16"))) > 1000
    feasible = [e for e in ranked if e.feasible]
    assert feasible and ranked[: len(feasible)] == feasible  # feasible first
    times = [e.step_time_s for e in feasible]
    assert times == sorted(times)
    best = ranked[0]
    # the published recipe's neighbourhood: 8-way TP inside the node, pipeline across nodes
    assert best.layout.tp == 8 and best.layout.pp >= 2 and best.layout.engine == "megatron"
    assert 0.35 < best.timing.mfu < 0.65
    assert best.memory.total <= A100.usable_bytes
    # every layout carries its full estimate, infeasible ones too, with a reason
    worst = ranked[-1]
    assert not worst.feasible and worst.reasons and "GiB" in worst.reasons[0] and worst.timing.step_time_s > 0
    # the plain data-parallel layouts of 175B cannot fit 80 GB
    assert not any(e.feasible for e in ranked if e.layout.tp == 1 and e.layout.pp == 1 and e.layout.zero < 3)


def test_enumeration_obeys_the_engine_rules():
    m = model_spec("gpt_1b3")
    c = ClusterSpec("x", 2, 8)
    lays = list(enumerate_layouts(m, c, 64))
    assert all(l.world_size == 16 and l.global_batch_size == 64 for l in lays)
    assert all(l.tp <= 8 and m.num_heads % l.tp == 0 and m.num_layers % l.pp == 0 for l in lays)
    assert all(l.zero <= 1 for l in lays if l.tp > 1 or l.pp > 1)
    assert all(not l.sequence_parallel for l in lays if l.tp == 1)
    assert {l.engine for l in lays if l.tp == l.pp == 1 and l.zero} == {"deepspeed"}
    assert {l.engine for l in lays if l.tp == l.pp == 1 and not l.zero} == {"ddp"}
    assert {l.engine for l in lays if l.tp > 1 or l.pp > 1} == {"megatron"}
    assert len(set(lays)) == len(lays)


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (2, 2), (4, 2)])
@pytest.mark.parametrize("tied", [True, False])
def test_stage_tensor_sizes_add_up_to_stage_params(tp, pp, tied):
    from recipes.gpt.plan.params import stage_params, stage_tensor_sizes
    from recipes.gpt.schema import ModelSpec

    m = ModelSpec(name="t", num_layers=4, hidden_size=64, num_heads=4, ffn_hidden_size=256, vocab_size=512, seq_len=64,
                  tie_embeddings=tied)
    sp = stage_params(m, tp, pp)
    totals = [sum(map(sum, stage_tensor_sizes(m, tp, pp, st))) for st in range(pp)]
    assert totals[0] == sp.first and totals[-1] == sp.last


def test_greedy_partition_like_zero_redundancy_optimizer():
    from recipes.gpt.plan.params import greedy_partition

    # largest first to the emptiest rank; the sizes carry over to the next parameter group
    assert greedy_partition([[5, 3, 2], [4]], 2) == [9, 5]  # 5->r0, 3->r1, 2->r1, then 4->r0 (tie: lowest)
    assert greedy_partition([[10, 1, 1, 1]], 3) == [10, 2, 1]
    assert sum(greedy_partition([[7, 7, 3], [2, 2]], 4)) == 21
