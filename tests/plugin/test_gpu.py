"""GPU checks (bf16, sdpa, cache) that run where a CUDA device exists: benchmarks/gpu_check.sh runs them.

On CPU-only machines (CI) they check the same properties on the CPU, so they are never skipped.
"""

from __future__ import annotations

import os

import pytest
import torch
from transformers import AutoModelForCausalLM

from qkmap_hf import QKMapConfig, qkmap_features
from tests.plugin.test_feature_map import decoding_feature_map, random_inputs, uncached_features
from tests.utils import kl_per_token, tiny_config_kwargs, written_out_features

DEVICE = os.environ.get("QKMAP_TEST_DEVICE", "cuda" if torch.cuda.is_available() else "cpu")


CONFIGS = {
    "standard": {},
    "qk_norm": {},
    "qk_map": {},
    "qk_map_constant_cos": {"qkmap_cos_block": "constant"},  # issue 24's control: an extra constant path
    "qk_map_gains_normalized": {"qkmap_gain_treatment": "normalized"},  # issue 19: gains normalized per row
}


@pytest.mark.parametrize(
    "name",
    [
        name if name in ("standard", "qk_norm", "qk_map") else pytest.param(name, marks=pytest.mark.slow)
        for name in CONFIGS
    ],
)
def test_bf16_sdpa_close_to_fp32_and_cache_consistent(name):
    torch.manual_seed(0)
    mode = name if name in ("standard", "qk_norm") else "qk_map"
    config = QKMapConfig(qk_mode=mode, **CONFIGS[name], **tiny_config_kwargs(eos_token_id=None))
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(DEVICE).eval()
    ids = torch.randint(3, 256, (2, 64), device=DEVICE)
    with torch.no_grad():
        reference = model(ids).logits
        low = model.to(torch.bfloat16)
        kl = kl_per_token(reference, low(ids).logits).max().item()
        assert kl < 1e-3
        cached = low.generate(ids[:1, :8], max_new_tokens=16, do_sample=False, pad_token_id=0)
        assert cached.shape[1] == 24
    if mode == "qk_map":
        assert low.model.layers[0].self_attn.qk_map.log_frequency.dtype == torch.bfloat16


def test_feature_map_backward_on_device_equals_the_formula():
    inputs = random_inputs(4, 2, 2, 6)
    on_device = [t.detach().float().to(DEVICE).requires_grad_(t.requires_grad) for t in inputs]
    features = qkmap_features(*on_device)
    expected = written_out_features(*inputs)
    weights = torch.randn(expected.shape, dtype=torch.float64)
    got = torch.autograd.grad((features * weights.float().to(DEVICE)).sum(), on_device[:3])
    want = torch.autograd.grad((expected * weights).sum(), inputs[:3])
    assert (features.double().cpu() - expected).abs().max().item() < 1e-4
    for a, b in zip(got, want, strict=True):
        assert (a.double().cpu() - b).abs().max().item() < 1e-4 * (1 + b.abs().max().item())


def test_wide_keys_sdpa_trains_and_decodes_like_eager():
    """sdpa pads values for the prefill and the backward pass, and decodes with single_query_attention."""
    torch.manual_seed(0)
    config = QKMapConfig(qk_mode="qk_map", **tiny_config_kwargs(eos_token_id=None))  # keys 2x as wide as values
    eager = AutoModelForCausalLM.from_config(config, attn_implementation="eager").to(DEVICE)
    sdpa = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(DEVICE)
    sdpa.load_state_dict(eager.state_dict())
    ids = torch.randint(3, 256, (2, 32), device=DEVICE)
    grads = []
    for model in (eager, sdpa):
        model(ids, labels=ids).loss.backward()
        grads.append(model.model.layers[0].self_attn.qk_map.query_gain.grad)
    assert (grads[0] - grads[1]).abs().max().item() < 1e-4 * (1 + grads[0].abs().max().item())
    with torch.no_grad():
        settings = dict(
            max_new_tokens=8, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True
        )
        expected, got = eager.eval().generate(ids, **settings), sdpa.eval().generate(ids, **settings)
    assert max((a - b).abs().max().item() for a, b in zip(expected.logits, got.logits, strict=True)) < 1e-3


def test_recomputing_projections_in_bf16_on_device_gives_the_plain_loss_and_gradients():
    """``qkmap_recompute_projections`` in bf16 weights on the device (sdpa): the plain path's loss bit for bit, its
    gradients up to bf16 rounding of the sums' order."""
    losses = trained_pair_in_bf16_on_device(
        {"qkmap_recompute_projections": False}, {"qkmap_recompute_projections": True}
    )
    assert torch.equal(losses[0], losses[1])


def trained_pair_in_bf16_on_device(first: dict, second: dict) -> list[torch.Tensor]:
    """Two qk_map models (config fields ``first`` and ``second``) in bf16 on the device with the same weights, one
    training step each on the same ids: their losses, after checking their ``q_proj``/``k_proj`` gradients agree up
    to bf16 rounding of the sums' order."""
    torch.manual_seed(0)
    models = []
    for fields in (first, second):
        config = QKMapConfig(qk_mode="qk_map", **fields, **tiny_config_kwargs())
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.bfloat16)
        models.append(model.to(DEVICE))
    models[1].load_state_dict(models[0].state_dict())
    ids = torch.randint(3, 256, (2, 32), device=DEVICE)
    losses = []
    for model in models:
        loss = model(ids, labels=ids).loss
        loss.backward()
        losses.append(loss)
    for name in ("q_proj", "k_proj"):
        plain, fused = (getattr(m.model.layers[0].self_attn, name).weight.grad.float() for m in models)
        assert (plain - fused).abs().max().item() < 2e-2 * (1 + plain.abs().max().item()), name
    return losses


@pytest.mark.slow
def test_compiled_feature_map_in_bf16_on_device_gives_the_eager_loss_and_gradients():
    """``qkmap_compile_feature_map`` in bf16 weights on the device (inductor: Triton on a GPU, C++ on a CPU), the wide
    layout's default recomputing node: the eager map's loss and gradients up to bf16 rounding, no eager fall-back."""
    from qkmap_hf.modeling import feature_map_qkmap

    eager, compiled = ({"qkmap_fused_feature_map": False, "qkmap_compile_feature_map": c} for c in (False, True))
    losses = trained_pair_in_bf16_on_device(eager, compiled)  # the fused CPU kernel, where loaded, precedes compiling
    assert feature_map_qkmap.COMPILED_QUERY_KEY_GRADIENTS.failure is None
    assert feature_map_qkmap.COMPILED_QUERY_KEY_GRADIENTS.compiled is not None
    assert losses[1].float().item() == pytest.approx(losses[0].float().item(), rel=1e-2)


def test_decoding_rows_kept_between_tokens_follow_a_move_to_the_device_and_updates_there():
    """The rows a decoding model keeps between tokens (``QKMapFeatureMap.decoding_parameters``) are rebuilt when
    the model moves to the device in bf16 and after an in-place update there: the same bits as recomputing."""
    feature_map, inputs = decoding_feature_map(num_freq=2, groups=2)
    with torch.no_grad():
        feature_map(*inputs)  # rows kept on the CPU in float32
        feature_map.to(DEVICE, torch.bfloat16)
        on_device = [t.to(DEVICE, torch.bfloat16) for t in inputs]
        moved = feature_map(*on_device)
        assert moved[0].device.type == torch.device(DEVICE).type and moved[0].dtype == torch.bfloat16
        assert all(torch.equal(a, b) for a, b in zip(moved, uncached_features(feature_map, *on_device), strict=True))
        feature_map.query_gain.mul_(2.0)
        updated = feature_map(*on_device)
        assert not torch.equal(updated[0], moved[0]) and torch.equal(updated[1], moved[1])
        assert all(torch.equal(a, b) for a, b in zip(updated, uncached_features(feature_map, *on_device), strict=True))


def test_training_monitor_probe_on_device_in_bf16_stays_under_its_bound():
    from qkmap_hf.monitoring import probe

    torch.manual_seed(0)
    config = QKMapConfig(qk_mode="qk_map", **tiny_config_kwargs(eos_token_id=None))
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(DEVICE, torch.bfloat16)
    record = probe(model, torch.randint(3, 256, (2, 48), device=DEVICE))
    assert model.config._attn_implementation == "sdpa"
    for layer in record.layers:
        assert all(torch.isfinite(torch.tensor(v)) for v in layer.values())
        assert layer["max_logit"] <= layer["logit_bound"] * (1 + 2e-2)  # bf16 features, float32 logits
