"""Hostile config values and foreign checkpoints: refused where they enter, naming the field, files untouched."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM

from qkmap_hf import QKMapConfig, QKMapForCausalLM
from tests.hostile import tree_digest
from tests.utils import tiny_config_kwargs

FLOAT_FIELDS = [name for name, kind in QKMapConfig.__annotations__.items() if "float" in str(kind)]


def test_every_float_field_is_covered():
    assert {"qkmap_min_frequency", "qkmap_max_frequency", "qkmap_exact_frequency", "qkmap_logit_scale"} <= set(
        FLOAT_FIELDS
    )


@pytest.mark.parametrize("field", FLOAT_FIELDS)
@pytest.mark.parametrize(
    "value, complaint",
    [
        (math.nan, "finite"),
        (math.inf, "finite"),
        (-math.inf, "finite"),
        ("0.5", "must be a number"),
        (True, "must be a number"),
        (1e-50, "magnitude"),  # 1/x overflows float32: the exact init's gains would be inf, the logits NaN
        (1e39, "magnitude"),
    ],
    ids=["nan", "inf", "-inf", "string", "bool", "tiny", "huge"],
)
def test_float_fields_refuse_non_finite_and_unrepresentable_values(field, value, complaint):
    with pytest.raises(ValueError, match=f"QKMapConfig.{field}=.*{complaint}"):
        QKMapConfig(**tiny_config_kwargs(**{field: value}))


def test_nan_in_a_saved_config_is_refused_on_load(tmp_path):
    """A config.json edited by hand (JSON has no NaN, but Python's json writes and reads it)."""
    QKMapConfig(**tiny_config_kwargs()).save_pretrained(tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    data["qkmap_logit_scale"] = float("nan")
    (tmp_path / "config.json").write_text(json.dumps(data))
    before = tree_digest(tmp_path)
    with pytest.raises(ValueError, match="qkmap_logit_scale=nan.*finite"):
        AutoConfig.from_pretrained(tmp_path)
    assert tree_digest(tmp_path) == before


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("plain-llama")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**tiny_config_kwargs())).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("cls", [QKMapConfig, QKMapForCausalLM], ids=lambda c: c.__name__)
def test_plain_llama_through_qkmap_classes_points_to_convert(cls, llama_folder):
    before = tree_digest(llama_folder)
    with pytest.raises(ValueError) as raised:
        cls.from_pretrained(llama_folder)
    message = str(raised.value)
    assert "`llama` checkpoint, not QK-MAP" in message and f"qkmap convert {llama_folder}" in message
    assert tree_digest(llama_folder) == before


def test_qkmap_checkpoints_and_auto_classes_still_load(llama_folder, tmp_path):
    """The refusal is for QK-MAP classes only: AutoModel loads the Llama, and a QK-MAP folder loads as before."""
    from transformers import AutoModelForCausalLM

    assert type(AutoModelForCausalLM.from_pretrained(llama_folder)).__name__ == "LlamaForCausalLM"
    model = QKMapForCausalLM(QKMapConfig(**tiny_config_kwargs()))
    model.save_pretrained(tmp_path)
    reloaded = QKMapForCausalLM.from_pretrained(tmp_path)
    ids = torch.arange(8)[None]
    torch.testing.assert_close(reloaded(ids).logits, model(ids).logits)
