"""QKMapConfig: Llama's fields, the QK-MAP fields, and one clear error per invalid value."""

from __future__ import annotations

import pytest
from transformers import AutoConfig, LlamaConfig

from qkmap_hf import QKMapConfig
from tests.utils import tiny_config_kwargs


def test_every_llama_field_is_a_qkmap_field():
    llama = LlamaConfig(**tiny_config_kwargs()).to_dict()
    ours = QKMapConfig(**tiny_config_kwargs()).to_dict()
    missing = {k for k in llama if k not in ours} - {"model_type", "transformers_version"}
    assert not missing


def test_qkmap_fields_round_trip_through_json(tmp_path):
    config = QKMapConfig(
        qk_mode="qk_map",
        qkmap_input_dim=8,
        qkmap_num_frequencies=2,
        qkmap_frequency_sharing="head",
        qkmap_min_frequency=0.2,
        qkmap_max_frequency=5.0,
        qkmap_logit_scale=0.25,
        qkmap_gain_parametrization="inverse_frequency",
        qkmap_init="exact",
        qkmap_exact_frequency=1e-2,
        qkmap_learnable_frequencies=False,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        **tiny_config_kwargs(),
    )
    config.save_pretrained(tmp_path)
    loaded = AutoConfig.from_pretrained(tmp_path)
    assert isinstance(loaded, QKMapConfig)
    for field in (
        "qkmap_input_dim",
        "qkmap_num_frequencies",
        "qkmap_frequency_sharing",
        "qkmap_min_frequency",
        "qkmap_max_frequency",
        "qkmap_logit_scale",
        "qkmap_gain_parametrization",
        "qkmap_init",
        "qkmap_exact_frequency",
        "qkmap_learnable_frequencies",
        "rope_parameters",
    ):
        assert getattr(loaded, field) == getattr(config, field), field
    assert loaded.query_key_dim == 2 * 2 * 8
    assert set(loaded.auto_map) >= {"AutoConfig", "AutoModel", "AutoModelForCausalLM"}


def test_derived_widths():
    wide = QKMapConfig(**tiny_config_kwargs())  # head_dim 16
    assert (wide.projection_dim, wide.query_key_dim) == (16, 32)
    compact = QKMapConfig(qkmap_input_dim=4, qkmap_num_frequencies=2, **tiny_config_kwargs())
    assert (compact.projection_dim, compact.query_key_dim) == (4, 16)
    standard = QKMapConfig(qk_mode="standard", qkmap_input_dim=4, **tiny_config_kwargs())
    assert (standard.projection_dim, standard.query_key_dim) == (16, 16)
    # m has one name: the field qkmap_input_dim, resolved (None -> head_dim) as resolved_qkmap_input_dim
    assert (wide.resolved_qkmap_input_dim, compact.resolved_qkmap_input_dim) == (16, 4)
    assert compact.qkmap_feature_dim_per_block == 4  # the deprecated old name still answers


INVALID = [
    ({"qk_mode": "qknorm"}, "qk_mode", "standard, qk_norm, qk_map"),
    ({"qkmap_frequency_sharing": "layer"}, "qkmap_frequency_sharing", "channel, head"),
    ({"qkmap_gain_parametrization": "relative"}, "qkmap_gain_parametrization", "absolute, inverse_frequency"),
    ({"qkmap_init": "random"}, "qkmap_init", "native, exact"),
    ({"num_key_value_heads": 3}, "num_attention_heads=4 is not divisible by num_key_value_heads=3", "divisors"),
    ({"num_key_value_heads": 0}, "num_key_value_heads", "positive"),
    ({"qkmap_num_frequencies": 0}, "qkmap_num_frequencies", "positive"),
    ({"qkmap_num_frequencies": -2}, "qkmap_num_frequencies", "positive"),
    ({"qkmap_num_frequencies": 1.5}, "qkmap_num_frequencies", "positive int"),
    ({"qkmap_input_dim": 0}, "qkmap_input_dim", "positive"),
    ({"qkmap_input_dim": 7}, "qkmap_input_dim=7", "even"),
    ({"qkmap_min_frequency": 0.0}, "qkmap_min_frequency", "positive"),
    ({"qkmap_max_frequency": -1.0}, "qkmap_max_frequency", "positive"),
    ({"qkmap_min_frequency": 4.0, "qkmap_max_frequency": 3.0}, "qkmap_min_frequency=4.0 exceeds", "min to max"),
    ({"qkmap_exact_frequency": 0.0}, "qkmap_exact_frequency", "positive"),
    ({"qkmap_logit_scale": -0.1}, "qkmap_logit_scale", "positive"),
    ({"num_hidden_layers": 0}, "num_hidden_layers", "positive"),
    ({"vocab_size": 0}, "vocab_size", "positive"),
]


@pytest.mark.parametrize("overrides,field,hint", INVALID, ids=[case[1].split("=")[0] for case in INVALID])
def test_invalid_fields_name_the_field_and_the_allowed_values(overrides, field, hint):
    with pytest.raises(ValueError) as error:
        QKMapConfig(**tiny_config_kwargs(**overrides))
    assert field in str(error.value)
    assert hint in str(error.value)


def test_invalid_values_in_a_saved_config_fail_on_load(tmp_path):
    import json

    QKMapConfig(**tiny_config_kwargs()).save_pretrained(tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    data["qkmap_num_frequencies"] = 0
    (tmp_path / "config.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="qkmap_num_frequencies"):
        AutoConfig.from_pretrained(tmp_path)


def test_configuration_page_lists_every_qkmap_field_with_its_real_default():
    import dataclasses
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text()
    rows = dict(re.findall(r"^\| `(\w+)` \| `([^`]*)` \|", readme, flags=re.MULTILINE))
    defaults = {f.name: f.default for f in dataclasses.fields(QKMapConfig) if f.name.startswith(("qk_", "qkmap_"))}
    assert set(rows) == set(defaults)
    for name, default in defaults.items():
        rendered = f'"{default}"' if isinstance(default, str) else repr(default)
        assert rows[name] == rendered, name
