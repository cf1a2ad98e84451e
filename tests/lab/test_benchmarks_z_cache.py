"""benchmarks/z_cache.py (issue 23 item 3): what caching z instead of the features would cost and save."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import z_cache  # noqa: E402
from attention_overhead import build, variant_config  # noqa: E402
from shape_grid import shape_size  # noqa: E402

from qkmap_hf.modeling.feature_map_qkmap import qkmap_features  # noqa: E402

TINY = shape_size(head_dim=16, heads=4, kv_ratio=2, layers=1)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("variant", z_cache.LAYOUTS)
def test_bytes_per_token_follow_the_layout_and_the_remap_is_timed(variant):
    row = z_cache.measure(TINY, variant, seq_len=8, repeats=1)
    config = variant_config(variant, TINY)
    kv_heads, m, width = config.num_key_value_heads, config.resolved_qkmap_input_dim, config.query_key_dim
    assert row["key_bytes_features"] == kv_heads * width * 4 and row["key_bytes_z"] == kv_heads * m * 4
    values = kv_heads * config.head_dim * 4
    assert row["kv_bytes_saved"] == pytest.approx(1 - (kv_heads * m * 4 + values) / (kv_heads * width * 4 + values))
    assert row["decode_ms"] > 0 and row["remap_ms"] > 0
    assert row["z_cache_decode_ratio"] == pytest.approx((row["decode_ms"] + row["remap_ms"]) / row["decode_ms"])


@torch.no_grad()
def test_remapping_cached_z_reproduces_the_cached_features():
    """The premise of a z cache: a key's features depend only on its z and its position."""
    model = build("qk_map_wide", "cpu", torch.float32, "sdpa", TINY).eval()
    captured = {}
    attention = model.model.layers[0].self_attn
    handle = attention.k_proj.register_forward_hook(lambda _m, _i, out: captured.setdefault("z", out))
    prompt = torch.randint(0, model.config.vocab_size, (1, 8))
    try:
        cache = model(prompt, use_cache=True).past_key_values
    finally:
        handle.remove()
    z = captured["z"].view(1, 8, model.config.num_key_value_heads, -1).transpose(1, 2)
    tables = model.model.rotary_emb(z, position_ids=torch.arange(8)[None])
    feature_map = attention.qk_map
    frequency = feature_map.frequency()
    gain = feature_map.effective_gain(feature_map.key_gain, frequency)
    remapped = qkmap_features(z, frequency, gain, *tables, model.config.qkmap_rotate_cos_blocks)
    assert torch.allclose(remapped, cache.layers[0].keys, atol=1e-6)
