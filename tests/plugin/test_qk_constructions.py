"""The query/key construction seam (qkmap_hf/modeling/qk_registry.py): the registry decides, every consumer follows.

The last test adds a construction the way docs/architecture.md says (a class, a registry line) and checks that the
model, the config's widths, the optimizer groups, peft, the conversion plan and the monitor pick it up with no
other change.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from qkmap_hf import QKMapConfig, QKMapForCausalLM
from qkmap_hf.conversion import convert_model
from qkmap_hf.modeling import qk_registry
from qkmap_hf.modeling.construction_qkmap import QKMapFeatures
from qkmap_hf.modeling.cos_blocks import COS_BLOCKS
from qkmap_hf.modeling.gain_treatments import GAIN_TREATMENTS
from qkmap_hf.modeling.query_key import QueryKeyConstruction
from qkmap_hf.monitoring import parameter_statistics
from qkmap_hf.training.optim import classify_parameters
from qkmap_hf.training.peft_support import qk_modules_to_save
from tests.utils import tiny_config_kwargs

CONFIGS = {
    "standard": {"qk_mode": "standard"},
    "qk_norm": {"qk_mode": "qk_norm"},
    "qk_map": {"qk_mode": "qk_map"},
    "qk_map_f2_compact": {"qk_mode": "qk_map", "qkmap_num_frequencies": 2, "qkmap_input_dim": 4},
    "standard_prior": {"qk_mode": "standard", "qk_position_prior": "constant"},
    "qk_norm_prior": {"qk_mode": "qk_norm", "qk_position_prior": "constant"},
    "qk_map_noprior": {"qk_mode": "qk_map", "qkmap_rotate_cos_blocks": False},
    "qk_map_input_norm": {"qk_mode": "qk_map", "qkmap_input_norm": True},
    **{f"gains_{name}": {"qk_mode": "qk_map", "qkmap_gain_treatment": name} for name in GAIN_TREATMENTS},
    **{f"cos_{name}": {"qk_mode": "qk_map", "qkmap_cos_block": name} for name in COS_BLOCKS},
}


def _config(**fields: Any) -> QKMapConfig:
    return QKMapConfig(**tiny_config_kwargs(**fields))


def _key_cache_width(model: QKMapForCausalLM) -> int:
    out = model(torch.tensor([[3, 1, 4, 1, 5]]), use_cache=True)
    return out.past_key_values.layers[0].keys.shape[-1]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_registry_builds_what_the_config_declares(name):
    config = _config(**CONFIGS[name])
    constructions = qk_registry.constructions_for(config)
    assert [c.stage for c in constructions].count("position") == 1
    model = QKMapForCausalLM(config).eval()
    attention = model.model.layers[0].self_attn
    owned = {m for c in constructions for m in c.modules}
    children = {n for n, _ in attention.named_children()} - {"q_proj", "k_proj", "v_proj", "o_proj"}
    assert children == owned
    assert attention.q_proj.out_features == config.num_attention_heads * config.projection_dim
    assert _key_cache_width(model) == config.query_key_dim  # the kernel (and cache) width the registry computes
    # every owned trainable parameter has a group, and those of the query/key group are exactly the owned ones there
    groups = classify_parameters(model)
    in_qk_group = {n.split("self_attn.", 1)[1].split(".")[0] for n, _ in groups["qkmap"]}
    expected = {
        module
        for c in constructions
        for module in c.modules
        for p, _ in getattr(attention, module).named_parameters()
        if c.parameter_group(config, module, p) == "query_key"
        and getattr(attention, module).get_parameter(p).requires_grad
    }
    assert in_qk_group == expected
    assert set(qk_modules_to_save(model)) == owned


def test_gain_treatments_and_cos_blocks_are_registry_entries():
    """The variants of the feature map follow their registries: frozen gains do not train, decayed gains join the
    decayed group, normalized gains feed rows of RMS 1, constant cos rows do not depend on z."""
    frozen = QKMapForCausalLM(_config(qkmap_gain_treatment="frozen"))
    assert not frozen.model.layers[0].self_attn.qk_map.query_gain.requires_grad
    decayed = classify_parameters(QKMapForCausalLM(_config(qkmap_gain_treatment="decayed")))
    assert sorted(n.rsplit(".", 1)[-1] for n, _ in decayed["decay"] if ".qk_map." in n)[:2] == ["key_gain", "key_gain"]
    feature_map = QKMapForCausalLM(_config(qkmap_gain_treatment="normalized")).model.layers[0].self_attn.qk_map
    with torch.no_grad():
        feature_map.query_gain.mul_(torch.rand_like(feature_map.query_gain) * 7)
    rms = feature_map.effective_gain(feature_map.query_gain, feature_map.frequency()).square().mean(-1).sqrt()
    torch.testing.assert_close(rms, torch.ones_like(rms))
    constant = QKMapForCausalLM(_config(qkmap_cos_block="constant")).model.layers[0].self_attn.qk_map
    z = torch.randn(1, constant.config.num_key_value_heads, 3, constant.config.resolved_qkmap_input_dim)
    cos, sin = torch.ones(1, 3, z.shape[-1]), torch.zeros(1, 3, z.shape[-1])
    _, keys = constant(z, z, cos, sin)
    _, keys_scaled = constant(z, 5 * z, cos, sin)
    cos_rows = keys.view(*keys.shape[:-1], -1, 2, z.shape[-1])[..., 0, :]
    torch.testing.assert_close(
        cos_rows, keys_scaled.view_as(keys.view(*keys.shape[:-1], -1, 2, z.shape[-1]))[..., 0, :]
    )


class KeyTemperature(QueryKeyConstruction):
    """A test construction: a learnable log-scale per key head after positions (zero: the identity)."""

    name = "key_temperature"
    stage = "output"
    modules = ("key_temperature",)

    @classmethod
    def applies_to(cls, config: Any) -> bool:
        return getattr(config, "qk_mode", "standard") == "qk_map"

    @classmethod
    def build(cls, config: Any) -> dict[str, nn.Module]:
        module = nn.Module()
        module.log_scale = nn.Parameter(torch.zeros(config.num_key_value_heads))
        return {"key_temperature": module}

    @classmethod
    def apply(cls, attention, query, key, cos, sin):
        return query, key * attention.key_temperature.log_scale.exp()[None, :, None, None].to(key.dtype)

    @classmethod
    def created_tensors(cls, config: Any) -> dict[str, torch.Tensor]:
        return {"key_temperature.log_scale": torch.zeros(config.num_key_value_heads)}

    @classmethod
    def statistics(cls, attention: nn.Module, scaling: float) -> dict[str, float]:
        return {"key_temperature_max": float(attention.key_temperature.log_scale.detach().exp().max())}


def test_a_new_construction_is_a_class_and_a_registry_line(monkeypatch):
    monkeypatch.setattr(qk_registry, "QK_CONSTRUCTIONS", (*qk_registry.QK_CONSTRUCTIONS, KeyTemperature))
    torch.manual_seed(0)
    source = LlamaForCausalLM(LlamaConfig(**tiny_config_kwargs(initializer_range=0.1))).eval()
    converted = convert_model(source, init="exact")  # the plan creates the new tensors at their starting values
    attention = converted.model.layers[0].self_attn
    assert torch.equal(attention.key_temperature.log_scale, torch.zeros(converted.config.num_key_value_heads))
    ids = torch.tensor([[5, 17, 42, 99, 7, 3]])
    with torch.no_grad():
        reference = source(ids).logits
        torch.testing.assert_close(converted(ids).logits, reference, atol=1e-4, rtol=1e-4)
        for layer in converted.model.layers:
            layer.self_attn.key_temperature.log_scale.fill_(1.0)
        assert (converted(ids).logits - reference).abs().max() > 1e-3  # the stage runs
    groups = classify_parameters(converted)
    assert any(name.endswith("key_temperature.log_scale") for name, _ in groups["qkmap"])
    assert "key_temperature" in qk_modules_to_save(converted)
    statistics = parameter_statistics(attention, attention.scaling)
    assert statistics["key_temperature_max"] == pytest.approx(torch.e)
    assert "logit_bound" in statistics  # the feature map still reports its own


def test_a_config_selecting_two_position_stages_is_refused(monkeypatch):
    class AnotherPosition(QKMapFeatures):
        name = "another"

    monkeypatch.setattr(qk_registry, "QK_CONSTRUCTIONS", (*qk_registry.QK_CONSTRUCTIONS, AnotherPosition))
    with pytest.raises(ValueError, match="selects 2 position constructions"):
        qk_registry.constructions_for(_config())
