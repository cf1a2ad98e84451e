"""qkmap_hf.phases: the one definition of phase statistics, cos energy share and regime."""

from __future__ import annotations

import math

import pytest
import torch

from qkmap_hf import phases
from qkmap_hf.modeling.configuration_qkmap import QKMapConfig
from qkmap_hf.modeling.modeling_qkmap import QKMapForCausalLM, qkmap_features
from tests.utils import tiny_config_kwargs


def test_regime_thresholds():
    assert phases.regime([0.1, 0.2]) == "linear"
    assert phases.regime([1.0, 1.3]) == "periodic"
    assert phases.regime([0.1, 1.2]) == phases.regime([0.5, 0.6]) == "transitional"
    layers = [{"query": {"p90": 0.3}, "key": {"p90": 1.1}}]
    assert phases.regime_from_roles(layers) == "periodic"


def test_recorder_statistics_match_a_direct_computation():
    config = QKMapConfig(**tiny_config_kwargs(qk_mode="qk_map", qkmap_num_frequencies=2))
    model = QKMapForCausalLM(config).eval()
    feature_map = model.model.layers[0].self_attn.qk_map
    with torch.no_grad():
        feature_map.log_frequency.uniform_(-1.0, 0.5)
        feature_map.query_gain.uniform_(0.1, 1.0)
        feature_map.key_gain.uniform_(0.1, 1.0)
    captured = {}
    attention = model.model.layers[0].self_attn
    hooks = [
        attention.q_proj.register_forward_hook(lambda _m, _i, out: captured.__setitem__("query", out)),
        attention.k_proj.register_forward_hook(lambda _m, _i, out: captured.__setitem__("key", out)),
    ]
    ids = torch.randint(0, config.vocab_size, (2, 24))
    with phases.PhaseRecorder(model) as recorder, torch.no_grad():
        model(input_ids=ids)
    for hook in hooks:
        hook.remove()
    summary = recorder.summary()
    layer = summary["layers"][0]

    m, kv_heads = config.resolved_qkmap_input_dim, config.num_key_value_heads
    omega = feature_map.frequency()
    shares, pooled = {}, []
    for role, gain in (("query", feature_map.query_gain), ("key", feature_map.key_gain)):
        z = captured[role].view(2, 24, -1, m).transpose(1, 2)  # (batch, heads, seq, m)
        groups = z.shape[1] // kv_heads
        pooled.append((z.reshape(2, kv_heads, groups, 24, 1, m) * omega.view(1, kv_heads, 1, 1, 2, m)).abs().flatten())
        # Features without rotation (cos table 1, sin table 0): rows cos_0, sin_0, cos_1, sin_1 of m channels each.
        no_rotation = torch.ones(1, 24, m), torch.zeros(1, 24, m)
        features = qkmap_features(z, omega, feature_map.effective_gain(gain, omega), *no_rotation).view(
            2, -1, 24, 2, 2, m
        )
        energy = features.detach().pow(2).sum(dim=(0, 1, 2, 3, 5))  # (cos, sin)
        shares[role] = float(energy[0] / energy.sum())
    values = torch.cat(pooled).detach()
    assert layer["phase_p90"] == pytest.approx(float(torch.quantile(values, 0.9)), rel=1e-5)
    assert layer["phase_median"] == pytest.approx(float(values.median()), rel=1e-5)
    assert layer["cos_energy_share"] == pytest.approx(math.sqrt(shares["query"] * shares["key"]), rel=1e-4)
    assert summary["regime"] == phases.regime(summary["phase_p90"])
