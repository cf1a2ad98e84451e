"""Every output form transformers' models give: ``return_dict=False`` (as an argument and in the config),
``output_attentions`` and ``output_hidden_states`` in every layout, the modules kept in float32 by the config's own
constructions, and the cache keyword as the installed transformers' Llama takes it."""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from qkmap_hf import QKMapConfig, QKMapForCausalLM, QKMapForSequenceClassification, QKMapModel
from qkmap_hf.modeling import modeling_qkmap
from tests.utils import tiny_config_kwargs

# head_dim 16: the wide layout's keys are 32 wide, the compact one's 16 (qkmap_input_dim 8).
LAYOUTS = {
    "standard": {"qk_mode": "standard"},
    "qk_norm": {"qk_mode": "qk_norm"},
    "wide": {"qk_mode": "qk_map"},
    "compact": {"qk_mode": "qk_map", "qkmap_input_dim": 8},
}
IDS = torch.tensor([[5, 9, 2, 7, 1, 3]])


def _config(layout: str, **overrides) -> QKMapConfig:
    return QKMapConfig(**LAYOUTS[layout], **tiny_config_kwargs(pad_token_id=0, **overrides))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("cls", [QKMapForCausalLM, QKMapModel, QKMapForSequenceClassification])
def test_return_dict_false_as_argument_and_in_the_config_gives_the_dicts_values_as_a_tuple(layout, cls):
    torch.manual_seed(0)
    model = cls(_config(layout)).eval()
    as_dict = model(IDS, output_hidden_states=True)
    expected = as_dict.to_tuple()
    as_tuple = model(IDS, return_dict=False, output_hidden_states=True)
    assert isinstance(as_tuple, tuple) and len(as_tuple) == len(expected)
    assert torch.equal(as_tuple[0], expected[0])
    if cls is QKMapForSequenceClassification:
        return  # transformers' generic head reads the inner output as a dict: config.return_dict=False fails there
    model.config.return_dict = False  # Llama's causal LM fails here too (transformers 5.25); this one does not
    from_config = model(IDS, output_hidden_states=True)
    assert isinstance(from_config, tuple) and torch.equal(from_config[0], expected[0])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_attentions_and_hidden_states_in_every_layout(layout):
    config = _config(layout)
    model = QKMapForCausalLM(config).eval()
    model.set_attn_implementation("eager")
    out = model(IDS, output_attentions=True, output_hidden_states=True)
    length = IDS.shape[1]
    assert len(out.attentions) == config.num_hidden_layers
    assert len(out.hidden_states) == config.num_hidden_layers + 1
    for weights in out.attentions:
        assert weights.shape == (1, config.num_attention_heads, length, length)
        assert torch.allclose(weights.sum(-1), torch.ones(1, config.num_attention_heads, length), atol=1e-5)
        assert torch.equal(weights.triu(1), torch.zeros_like(weights))  # causal
    assert out.hidden_states[0].shape == (1, length, config.hidden_size)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_modules_kept_in_float32_are_the_configs_own(layout):
    model = QKMapForCausalLM(_config(layout))
    kept = set(model._keep_in_fp32_modules)
    names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    assert kept <= names, f"{kept - names} named but not in the model"
    assert ("qk_map" in kept) == (LAYOUTS[layout]["qk_mode"] == "qk_map")


def _deprecation_notices(model, **kwargs) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(IDS, use_cache=True, **kwargs)
    return [str(w.message) for w in caught if "past_key_values" in str(w.message)]


@torch.no_grad()
def test_the_cache_keyword_is_taken_as_the_installed_llama_takes_it():
    torch.manual_seed(0)
    qkmap = QKMapForCausalLM(_config("wide")).eval()
    llama = LlamaForCausalLM(LlamaConfig(**tiny_config_kwargs())).eval()
    assert bool(_deprecation_notices(qkmap, past_key_values=None)) == bool(
        _deprecation_notices(llama, past_key_values=None)
    )
    renamed = modeling_qkmap._MASK_CACHE_ARG == "cache"
    if renamed:  # the old keyword still works and gives the same cache
        first = qkmap(IDS[:, :4], use_cache=True)
        step = IDS[:, 4:5]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            old = qkmap(step, past_key_values=_copy(first), use_cache=True)
        new = qkmap(step, cache=_copy(first), use_cache=True)
        assert torch.equal(old.logits, new.logits)


def _copy(output):
    import copy

    return copy.deepcopy(output.cache if hasattr(output, "cache") else output.past_key_values)
