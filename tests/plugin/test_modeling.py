"""The model: equivalence with Llama and Qwen3, the QK-MAP properties, cache, padding, dtypes, backends."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

import qkmap_hf
from qkmap_hf import QKMapConfig, QKMapForCausalLM, qkmap_features
from qkmap_hf.modeling.modeling_qkmap import QKMapAttention
from tests.utils import kl_per_token, tiny_config_kwargs, written_out_features

MODES = ("standard", "qk_norm", "qk_map")


def make_model(mode: str = "qk_map", attn: str = "eager", seed: int = 0, **overrides) -> QKMapForCausalLM:
    torch.manual_seed(seed)
    config = QKMapConfig(qk_mode=mode, **tiny_config_kwargs(**overrides))
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn).eval()
    model.generation_config.eos_token_id = None  # random weights: never stop early, compare full sequences
    # Random (not unit) gains and norm weights, so the tests see every parameter at work.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("query_gain", "key_gain", "norm.weight")):
                param.mul_(1 + 0.3 * torch.randn_like(param))
    return model


def ids(batch: int = 2, length: int = 12, vocab: int = 256, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


# --- 1 and 2: the baselines are the same code path as the reference models ---------------------------


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_standard_mode_reproduces_llama(attn):
    kwargs = tiny_config_kwargs(
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
    )
    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(**kwargs)).eval()
    llama.config._attn_implementation = attn
    model = QKMapForCausalLM(QKMapConfig(qk_mode="standard", **kwargs)).eval()
    model.config._attn_implementation = attn
    result = model.load_state_dict(llama.state_dict(), strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    x = ids()
    with torch.no_grad():
        diff = (llama(x).logits - model(x).logits).abs().max().item()
    assert diff <= 1e-5
    prompt = x[:1, :5]
    reference = llama.generate(prompt, max_new_tokens=20, do_sample=False, pad_token_id=0)
    ours = model.generate(prompt, max_new_tokens=20, do_sample=False, pad_token_id=0)
    assert torch.equal(reference, ours)


def test_qk_norm_mode_reproduces_qwen3():
    kwargs = tiny_config_kwargs(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, head_dim=16)
    torch.manual_seed(0)
    qwen = Qwen3ForCausalLM(Qwen3Config(**kwargs, tie_word_embeddings=False)).eval()
    with torch.no_grad():  # non-trivial norm weights so a missing or misplaced norm shows
        for name, param in qwen.named_parameters():
            if "q_norm" in name or "k_norm" in name:
                param.copy_(1 + 0.5 * torch.randn_like(param))
    model = QKMapForCausalLM(QKMapConfig(qk_mode="qk_norm", **kwargs)).eval()
    model.config._attn_implementation = qwen.config._attn_implementation
    result = model.load_state_dict(qwen.state_dict(), strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    x = ids()
    with torch.no_grad():
        diff = (qwen(x).logits - model(x).logits).abs().max().item()
    assert diff <= 1e-5


# --- 3: the QK-MAP properties ------------------------------------------------------------------------


@pytest.mark.parametrize("num_frequencies,sharing", [(1, "channel"), (3, "channel"), (2, "head")])
def test_feature_norm_is_fixed_over_six_decades(num_frequencies, sharing):
    config = QKMapConfig(
        qk_mode="qk_map", qkmap_num_frequencies=num_frequencies, qkmap_frequency_sharing=sharing, **tiny_config_kwargs()
    )
    model = QKMapForCausalLM(config)
    feature_map = model.model.layers[0].self_attn.qk_map
    m = config.resolved_qkmap_input_dim
    position_ids = torch.arange(9).unsqueeze(0)
    cos, sin = model.model.rotary_emb(torch.empty(0), position_ids)
    base = torch.randn(1, config.num_attention_heads, 9, m, dtype=torch.float64).float()
    norms = []
    for scale in torch.logspace(-3, 3, 13):
        features, _ = feature_map(base * scale, base[:, : config.num_key_value_heads] * scale, cos, sin)
        norms.append(features.pow(2).sum(-1))
    norms = torch.stack(norms)
    expected = num_frequencies * m
    assert torch.allclose(norms, torch.full_like(norms, expected), rtol=1e-5)


@pytest.mark.parametrize("mode", MODES)
def test_logits_depend_only_on_relative_position(mode):
    model = make_model(mode)
    x = ids(batch=1, length=10)
    positions = torch.arange(10).unsqueeze(0)
    with torch.no_grad():
        base = model(x, position_ids=positions).logits
        shifted = model(x, position_ids=positions + 37).logits
    assert (base - shifted).abs().max().item() < 1e-4


def attention_after_scaling_queries(model: QKMapForCausalLM, factor: float) -> torch.Tensor:
    scaled = copy.deepcopy(model)
    with torch.no_grad():
        scaled.model.layers[0].self_attn.q_proj.weight.mul_(factor)
    out = scaled(ids(batch=1, length=16), output_attentions=True)
    return out.attentions[0]


def test_qkmap_is_sensitive_to_query_scale_and_qk_norm_is_not():
    changes = {}
    for mode in ("qk_norm", "qk_map"):
        model = make_model(mode)
        with torch.no_grad():
            reference = attention_after_scaling_queries(model, 1.0)
            scaled = attention_after_scaling_queries(model, 3.0)
        changes[mode] = (reference - scaled).abs().sum(-1).max().item()  # total variation per query row
    assert changes["qk_norm"] < 1e-4
    assert changes["qk_map"] > 1e-2


# --- 4: cache, padding, dtypes -----------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("cache_implementation", ["dynamic", "static"])
def test_cached_generation_matches_recompute(mode, cache_implementation):
    model = make_model(mode, attn="sdpa", qkmap_input_dim=None)
    prompt = ids(batch=1, length=6)
    with torch.no_grad():
        cached = model.generate(
            prompt, max_new_tokens=24, do_sample=False, pad_token_id=0, cache_implementation=cache_implementation
        )
        tokens = prompt
        for _ in range(24):  # recompute the whole sequence for each token, no cache anywhere
            next_token = model(tokens, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            tokens = torch.cat([tokens, next_token], dim=1)
    assert torch.equal(cached, tokens)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_left_padded_batch_equals_each_sequence_alone(mode, attn):
    model = make_model(mode, attn=attn)
    long, short = ids(1, 11, seed=2)[0], ids(1, 6, seed=3)[0]
    pad = 0
    batch = torch.stack([long, torch.cat([torch.full((5,), pad), short])])
    mask = torch.stack([torch.ones(11, dtype=torch.long), torch.cat([torch.zeros(5), torch.ones(6)]).long()])
    with torch.no_grad():
        padded = model(batch, attention_mask=mask).logits
        alone_long = model(long[None]).logits[0]
        alone_short = model(short[None]).logits[0]
        assert (padded[0] - alone_long).abs().max().item() < 1e-5
        assert (padded[1, 5:] - alone_short).abs().max().item() < 1e-5
        generated = model.generate(batch, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=pad)
        for row, sequence in enumerate((long, short)):
            single = model.generate(sequence[None], max_new_tokens=8, do_sample=False, pad_token_id=pad)
            assert torch.equal(generated[row, -8:], single[0, -8:])


@pytest.mark.parametrize("mode", MODES)
def test_bfloat16_logits_close_to_float32(mode):
    model = make_model(mode)
    x = ids(batch=2, length=32)
    with torch.no_grad():
        kl = kl_per_token(model(x).logits, copy.deepcopy(model).to(torch.bfloat16)(x).logits)
    # Stated tolerance: per-token KL(fp32 || bf16) below 1e-3 nats on a random tiny model.
    assert kl.max().item() < 1e-3
    if mode == "qk_map":
        assert (
            copy.deepcopy(model).to(torch.bfloat16).model.layers[0].self_attn.qk_map.log_frequency.dtype
            == torch.bfloat16
        )


def test_phases_are_computed_in_float32():
    """Large phases (omega * z ~ 100) in bf16 would be off by ~0.5 rad; float32 phases keep bf16 round-off only."""
    z = (torch.randn(1, 4, 8, 16) * 100).to(torch.bfloat16)  # exactly representable inputs
    frequency = torch.full((2, 1, 16), 1.37)
    gain = torch.ones(2, 2, 16)
    cos, sin = torch.ones(1, 8, 16), torch.zeros(1, 8, 16)
    reference = qkmap_features(z.float(), frequency, gain, cos, sin)
    low = qkmap_features(z, frequency, gain, cos, sin)
    assert low.dtype == torch.bfloat16
    assert (low.float() - reference).abs().max().item() < 1e-2  # bf16 output rounding only
    bf16_phase = z * frequency.to(torch.bfloat16).view(1, 2, 1, 1, 16).repeat_interleave(2, 1).view(1, 4, 1, 16)
    naive = torch.cat([bf16_phase.cos(), bf16_phase.sin()], -1).float()
    assert (naive - reference).abs().max().item() > 0.1  # what the float32 phase math protects against


# --- backends, training features -----------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["wide", "compact"])
def test_sdpa_equals_eager_and_pads_values_only_when_widths_differ(layout, monkeypatch):
    """sdpa's own kernels (the fused CPU attention off: tests/plugin/test_fused_attention.py covers it)."""
    input_dim = None if layout == "wide" else 8  # head_dim 16: wide keys are 32 wide, compact 16
    eager = make_model("qk_map", attn="eager", qkmap_input_dim=input_dim, qkmap_fused_attention=False)
    sdpa = copy.deepcopy(eager)
    sdpa.set_attn_implementation("sdpa")
    widths = []
    original = torch.nn.functional.scaled_dot_product_attention

    def spy(query, key, value, *args, **kwargs):
        widths.append((query.shape[-1], key.shape[-1], value.shape[-1]))
        return original(query, key, value, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    x = ids()
    with torch.no_grad():
        diff = (eager(x).logits - sdpa(x).logits).abs().max().item()
    assert diff < 1e-5
    assert widths and all(q == k == v for q, k, v in widths)
    assert widths[0][0] == (32 if layout == "wide" else 16)


@pytest.mark.parametrize("cache_implementation", ["dynamic", "static"])
def test_single_token_decode_skips_value_padding_and_equals_eager(cache_implementation, monkeypatch):
    """Decoding over wider keys takes single_query_attention (no padded value cache), GQA and left padding included."""
    eager = make_model("qk_map", attn="eager")  # 4 query heads over 2 key heads; keys 32 wide, values 16
    sdpa = copy.deepcopy(eager)
    sdpa.set_attn_implementation("sdpa")
    query_lengths = []
    original = torch.nn.functional.scaled_dot_product_attention

    def spy(query, key, value, *args, **kwargs):
        query_lengths.append(query.shape[-2])
        return original(query, key, value, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    prompt = ids(batch=2, length=9)
    mask = torch.ones_like(prompt)
    mask[1, :3] = 0
    settings = dict(
        attention_mask=mask,
        max_new_tokens=6,
        do_sample=False,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
        cache_implementation=cache_implementation,
    )
    with torch.no_grad():
        expected, got = eager.generate(prompt, **settings), sdpa.generate(prompt, **settings)
    assert torch.equal(expected.sequences, got.sequences)
    assert max((a - b).abs().max().item() for a, b in zip(expected.logits, got.logits, strict=True)) < 1e-4
    assert query_lengths and all(length > 1 for length in query_lengths)  # only the prefill reached sdpa


def test_flash_attention_refuses_widths_it_cannot_take():
    model = make_model(
        "qk_map", head_dim=128, hidden_size=256, num_attention_heads=2, num_key_value_heads=1, qkmap_num_frequencies=2
    )
    attention: QKMapAttention = model.model.layers[0].self_attn
    values = torch.zeros(1, 1, 4, 128)
    with pytest.raises(ValueError, match="qkmap_input_dim"):
        attention.pad_values_for_kernel(values, "flash_attention_2")
    assert attention.pad_values_for_kernel(values, "sdpa").shape[-1] == 512
    assert attention.pad_values_for_kernel(values, "eager").shape[-1] == 128


@pytest.mark.parametrize("mode", MODES)
def test_output_attentions_are_distributions(mode):
    model = make_model(mode)
    out = model(ids(batch=2, length=9), output_attentions=True, output_hidden_states=True)
    assert len(out.attentions) == 2 and out.attentions[0].shape == (2, 4, 9, 9)
    assert torch.allclose(out.attentions[0].sum(-1), torch.ones(2, 4, 9), atol=1e-5)
    assert torch.all(out.attentions[0].triu(1) == 0)  # causal
    assert len(out.hidden_states) == 3


@pytest.mark.parametrize("mode", ["qk_norm", "qk_map"])
def test_gradient_checkpointing_gives_the_same_gradients(mode):
    model = make_model(mode).train()
    checkpointed = copy.deepcopy(model)
    # transformers 5.24 renamed the switch (and its kwargs argument); older 5.x only has the first name.
    if hasattr(checkpointed, "activation_checkpointing_enable"):
        checkpointed.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        checkpointed.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert all(layer.gradient_checkpointing for layer in checkpointed.model.layers)
    x = ids(batch=2, length=10)
    grads = []
    for candidate in (model, checkpointed):
        candidate.zero_grad()
        candidate(x, labels=x).loss.backward()
        grads.append({n: p.grad.clone() for n, p in candidate.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    assert any("qk_map" in n or "q_norm" in n for n in grads[0])
    for name in grads[0]:
        assert torch.allclose(grads[0][name], grads[1][name], atol=1e-6), name


def test_qkmap_parameters_receive_gradients():
    model = make_model("qk_map").train()
    x = ids()
    model(x, labels=x).loss.backward()
    feature_map = model.model.layers[0].self_attn.qk_map
    for param in (feature_map.log_frequency, feature_map.query_gain, feature_map.key_gain):
        assert param.grad is not None and param.grad.abs().sum() > 0


def test_frozen_frequencies_stay_frozen():
    model = make_model("qk_map", qkmap_learnable_frequencies=False)
    assert not model.model.layers[0].self_attn.qk_map.log_frequency.requires_grad


@pytest.mark.slow
def test_torch_compile_of_the_forward_matches_eager():
    model = make_model("qk_map", attn="sdpa")
    x = ids(batch=1, length=16)
    with torch.no_grad():
        reference = model(x).logits
        compiled = torch.compile(model.forward, fullgraph=True)
        assert (compiled(input_ids=x).logits - reference).abs().max().item() < 1e-4


def test_device_map_keeps_decoder_layers_whole(tmp_path):
    from accelerate import infer_auto_device_map

    model = make_model("qk_map")
    model.save_pretrained(tmp_path)
    assert set(model._no_split_modules) == {"QKMapDecoderLayer"}
    layer_bytes = sum(p.numel() * 4 for p in model.model.layers[0].parameters())
    device_map = infer_auto_device_map(
        model,
        max_memory={"cpu": int(layer_bytes * 1.5), "disk": 10**9},
        no_split_module_classes=model._no_split_modules,
    )
    assert "disk" in device_map.values()  # the budget forced a split ...
    assert not any(key.count(".") > 2 and key.startswith("model.layers.") for key in device_map)  # ... between layers
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, device_map="auto", attn_implementation="eager")
    x = ids()
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, model(x).logits)


# --- init ------------------------------------------------------------------------------------------


def test_native_init_is_a_geometric_grid_with_unit_gains():
    config = QKMapConfig(qk_mode="qk_map", qkmap_min_frequency=0.1, qkmap_max_frequency=3.0, **tiny_config_kwargs())
    feature_map = QKMapForCausalLM(config).model.layers[1].self_attn.qk_map
    omega = feature_map.frequency()[0].flatten()
    ratios = omega[1:] / omega[:-1]
    assert math.isclose(omega[0].item(), 0.1, rel_tol=1e-5) and math.isclose(omega[-1].item(), 3.0, rel_tol=1e-5)
    assert torch.allclose(ratios, ratios.mean().expand_as(ratios), rtol=1e-4)
    assert torch.equal(feature_map.query_gain, torch.ones_like(feature_map.query_gain))


@pytest.mark.parametrize("parametrization", ["absolute", "inverse_frequency"])
@pytest.mark.parametrize("num_frequencies", [1, 2])
def test_exact_init_reproduces_standard_attention(parametrization, num_frequencies):
    common = tiny_config_kwargs()
    standard = make_model("standard")
    exact = QKMapForCausalLM(
        QKMapConfig(
            qk_mode="qk_map",
            qkmap_init="exact",
            qkmap_gain_parametrization=parametrization,
            qkmap_num_frequencies=num_frequencies,
            **common,
        )
    ).eval()
    result = exact.load_state_dict(standard.state_dict(), strict=False)
    assert all("qk_map" in key for key in result.missing_keys) and not result.unexpected_keys
    x = ids(batch=2, length=24)
    with torch.no_grad():
        kl = kl_per_token(standard(x).logits, exact(x).logits)
    assert kl.max().item() < 1e-6


def test_loaded_weights_are_not_reinitialised(tmp_path):
    model = make_model("qk_map")
    with torch.no_grad():
        model.model.layers[0].self_attn.qk_map.log_frequency.add_(0.25)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_sequence_classification_head():
    config = QKMapConfig(qk_mode="qk_map", num_labels=3, pad_token_id=0, **tiny_config_kwargs())
    model = qkmap_hf.QKMapForSequenceClassification(config).eval()
    out = model(ids(batch=2, length=7), labels=torch.tensor([0, 2]))
    assert out.logits.shape == (2, 3) and torch.isfinite(out.loss)


@pytest.mark.slow
def test_feature_map_is_one_graph_for_torch_compile():
    torch._dynamo.reset()
    z = torch.randn(2, 4, 8, 16)
    frequency, gain = torch.rand(2, 2, 16) + 0.1, torch.rand(2, 4, 16)
    cos, sin = torch.rand(1, 8, 16), torch.rand(1, 8, 16)
    explanation = torch._dynamo.explain(qkmap_features)(z, frequency, gain, cos, sin)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1
    compiled = torch.compile(qkmap_features, fullgraph=True)
    assert torch.allclose(
        compiled(z, frequency, gain, cos, sin), qkmap_features(z, frequency, gain, cos, sin), atol=1e-5
    )


@pytest.mark.slow  # compiles flex attention's kernel (5-11 s)
def test_flex_attention_equals_eager_with_wide_keys():
    eager = make_model("qk_map", attn="eager")  # keys 32 wide, values 16: flex takes them unpadded
    flex = copy.deepcopy(eager)
    flex.set_attn_implementation("flex_attention")
    x = ids()
    mask = torch.ones_like(x)
    mask[1, :3] = 0
    with torch.no_grad():
        diff = (eager(x, attention_mask=mask).logits - flex(x, attention_mask=mask).logits)[mask.bool()]
    assert diff.abs().max().item() < 1e-5


@pytest.mark.parametrize("num_frequencies,sharing", [(1, "channel"), (2, "channel"), (3, "head")])
def test_fused_feature_map_equals_the_written_out_formula(num_frequencies, sharing):
    config = QKMapConfig(
        qk_mode="qk_map", qkmap_num_frequencies=num_frequencies, qkmap_frequency_sharing=sharing, **tiny_config_kwargs()
    )
    model = QKMapForCausalLM(config)
    feature_map = model.model.layers[0].self_attn.qk_map
    with torch.no_grad():
        feature_map.query_gain.normal_()
        feature_map.key_gain.normal_()
    cos, sin = model.model.rotary_emb(torch.empty(0), torch.arange(5, 12).unsqueeze(0))
    q = torch.randn(2, config.num_attention_heads, 7, config.resolved_qkmap_input_dim)
    k = torch.randn(2, config.num_key_value_heads, 7, config.resolved_qkmap_input_dim)
    with torch.no_grad():
        fused_q, fused_k = feature_map(q, k, cos, sin)
        omega = feature_map.frequency()
        omega_full = omega.expand(-1, -1, config.resolved_qkmap_input_dim)
        tables = cos.double(), sin.double()
        expected_q = written_out_features(q.double(), omega_full.double(), feature_map.query_gain.double(), *tables)
        expected_k = written_out_features(k.double(), omega_full.double(), feature_map.key_gain.double(), *tables)
    assert (fused_q.double() - expected_q).abs().max().item() < 1e-5
    assert (fused_k.double() - expected_k).abs().max().item() < 1e-5


def test_fixed_parameters_stay_frozen_after_from_pretrained(tmp_path):
    # transformers' loader wraps every loaded float tensor as a trainable Parameter; a frozen omega, frozen gains or
    # the input norm's calibrated reference scale must not start training after a save/load round trip.
    config = QKMapConfig(
        qkmap_learnable_frequencies=False, qkmap_input_norm=True, qkmap_gain_treatment="frozen", **tiny_config_kwargs()
    )
    QKMapForCausalLM(config).save_pretrained(tmp_path)
    loaded = QKMapForCausalLM.from_pretrained(tmp_path)
    attention = loaded.model.layers[0].self_attn
    frozen = [attention.qk_map.log_frequency, attention.qk_map.query_gain, attention.qk_map.key_gain]
    frozen += [attention.q_norm.reference_scale, attention.k_norm.reference_scale]
    assert not any(p.requires_grad for p in frozen)
    assert attention.q_proj.weight.requires_grad and attention.q_norm.weight.requires_grad
