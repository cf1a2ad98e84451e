"""Serving: transformers' continuous batching (``generate_batch``, ``transformers serve``) gives ``generate``'s tokens."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, ContinuousBatchingConfig, GenerationConfig

from qkmap_hf import QKMapConfig
from qkmap_hf.modeling.modeling_qkmap import paged_cache_width
from tests.utils import tiny_config_kwargs

PROMPTS = [[5, 17, 42, 99, 7, 3], [9, 8, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]
NEW_TOKENS = 8
LAYOUTS = {
    # head_dim 16: wide keys 2 * 2 * 16 = 64 wide (values 16); compact keys 2 * 2 * 4 = 16 (= head_dim)
    "wide": dict(qkmap_num_frequencies=2),
    "compact": dict(qkmap_num_frequencies=2, qkmap_input_dim=4),
}


def tiny_model(layout: str, attn: str) -> torch.nn.Module:
    torch.manual_seed(0)
    config = QKMapConfig(qk_mode="qk_map", **tiny_config_kwargs(**LAYOUTS[layout]))
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn).eval()
    with torch.no_grad():  # random gains, so every parameter is at work
        for name, param in model.named_parameters():
            if name.endswith(("query_gain", "key_gain")):
                param.mul_(1 + 0.3 * torch.randn_like(param))
    model.generation_config.eos_token_id = None
    return model


def generate_each(model: torch.nn.Module, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Greedy ``generate``, one prompt at a time: the reference every serving path must reproduce."""
    with torch.no_grad():
        return [
            model.generate(torch.tensor([p]), max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)[
                0, len(p) :
            ].tolist()
            for p in prompts
        ]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("attn", ["sdpa", pytest.param("eager", marks=pytest.mark.slow)])  # eager runs paged|eager
def test_generate_batch_gives_generates_tokens(layout, attn):
    model = tiny_model(layout, attn)
    expected = generate_each(model, PROMPTS, NEW_TOKENS)
    settings = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=-1, pad_token_id=0)
    outputs = model.generate_batch(
        PROMPTS,
        generation_config=settings,
        continuous_batching_config=ContinuousBatchingConfig(num_blocks=16, max_batch_tokens=64),
        max_new_tokens=NEW_TOKENS,
    )
    got = [outputs[request].generated_tokens for request in sorted(outputs, key=lambda r: int(r.split("_")[-1]))]
    assert got == expected
    assert len(expected) == 3 and all(len(tokens) == NEW_TOKENS for tokens in expected)
    assert model.config.head_dim == 16  # the paged cache saw the key width only while it was built


def test_paged_cache_width_is_the_key_width_while_sizing_only():
    config = QKMapConfig(qk_mode="qk_map", **tiny_config_kwargs(**LAYOUTS["wide"]))
    with paged_cache_width(config):
        assert config.head_dim == 64
    assert (config.head_dim, config.query_key_dim) == (16, 64)
