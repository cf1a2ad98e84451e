"""Shared test helpers: tiny configs and a clean interpreter in which qkmap_hf cannot be imported."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from qkmap_hf.cleanroom import run_without_qkmap_hf

TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


def tiny_config_kwargs(**overrides) -> dict:
    return {**TINY, **overrides}


def kl_per_token(reference_logits: torch.Tensor, other_logits: torch.Tensor) -> torch.Tensor:
    """KL(reference || other) per position, in float64 nats."""
    p = reference_logits.double().log_softmax(-1)
    q = other_logits.double().log_softmax(-1)
    return (p.exp() * (p - q)).sum(-1)


def run_clean_python(code: str, cwd: Path, env: dict | None = None, timeout: float = 300) -> dict:
    """Run ``code`` in a fresh interpreter where ``import qkmap_hf`` fails; return the JSON it prints last.

    The code must print one JSON object as its last stdout line.
    """
    result = run_without_qkmap_hf(code, cwd=cwd, env=env, timeout=timeout)
    if result.returncode != 0:
        raise AssertionError(f"clean interpreter failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
    return json.loads(result.stdout.strip().splitlines()[-1])
