"""GPU checks (bf16, sdpa, cache) that run where a CUDA device exists: benchmarks/gpu_check.sh runs them.

On CPU-only machines (CI) they check the same properties on the CPU, so they are never skipped.
"""

from __future__ import annotations

import os

import pytest
import torch
from transformers import AutoModelForCausalLM

from qkmap_hf import QKMapConfig
from tests.utils import kl_per_token, tiny_config_kwargs

DEVICE = os.environ.get("QKMAP_TEST_DEVICE", "cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("mode", ["standard", "qk_norm", "qk_map"])
def test_bf16_sdpa_close_to_fp32_and_cache_consistent(mode):
    torch.manual_seed(0)
    config = QKMapConfig(qk_mode=mode, **tiny_config_kwargs(eos_token_id=None))
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
