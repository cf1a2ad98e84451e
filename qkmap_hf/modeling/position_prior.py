# Copyright 2026 The qkmap-hf authors. Licensed under the Apache License, Version 2.0.
"""The position-prior control (``qk_position_prior="constant"``) as a query/key construction, see docs/method.md,
"Ablations and tuning knobs".

Copied into checkpoints next to ``modeling_qkmap.py`` (a relative import): torch and transformers only.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers.models.llama.modeling_llama import rotate_half

from .query_key import QueryKeyConstruction


class QKPositionPrior(nn.Module):
    """Learnable constant query and key blocks per head, rotated by RoPE (``qk_position_prior="constant"``).

    The ablation that isolates QK-MAP's cos block at ``z = 0``: appended to the queries and keys of
    ``standard``/``qk_norm`` it adds ``scale * RoPE(c_q) . RoPE(c_k)``, a logit that depends on the relative
    position only. Initialised to ones like QK-MAP's unit gains (``cos(0) = 1``); zeros give back the base mode.
    """

    def __init__(self, config: Any):
        super().__init__()
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.query_prior = nn.Parameter(torch.ones(config.num_attention_heads, config.head_dim))
        self.key_prior = nn.Parameter(torch.ones(config.num_key_value_heads, config.head_dim))

    @torch.no_grad()
    def initial_values(self) -> dict[str, torch.Tensor]:
        return {"query_prior": torch.ones_like(self.query_prior), "key_prior": torch.ones_like(self.key_prior)}

    def forward(
        self, query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the rotated constant blocks to RoPE-rotated ``(batch, heads, seq, head_dim)`` queries and keys."""
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # (batch or 1, 1, seq, head_dim)

        def rotated(prior: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
            prior = prior.to(like.dtype)[None, :, None, :]
            block = prior * cos.to(like.dtype) + rotate_half(prior) * sin.to(like.dtype)
            return block.expand(like.shape[0], -1, -1, -1)

        return (
            torch.cat((query, rotated(self.query_prior, query)), dim=-1),
            torch.cat((key, rotated(self.key_prior, key)), dim=-1),
        )


class PositionPrior(QueryKeyConstruction):
    """Appends the rotated constant blocks after RoPE (``standard``/``qk_norm`` with ``qk_position_prior="constant"``):
    keys ``head_dim`` wider."""

    name = "position_prior"
    stage = "output"
    modules = ("position_prior",)

    @classmethod
    def applies_to(cls, config: Any) -> bool:
        return getattr(config, "qk_position_prior", "none") == "constant"

    @classmethod
    def build(cls, config: Any) -> dict[str, nn.Module]:
        return {"position_prior": QKPositionPrior(config)}

    @classmethod
    def apply(cls, attention, query, key, cos, sin):
        return attention.position_prior(query, key, cos, sin)

    @classmethod
    def width(cls, config: Any, width: int) -> int:
        return width + config.head_dim

    @classmethod
    def created_tensors(cls, config: Any) -> dict[str, torch.Tensor]:
        with torch.device("meta"):
            names = QKPositionPrior(config).initial_values()
        return {f"position_prior.{name}": torch.ones(value.shape) for name, value in names.items()}


__all__ = ["PositionPrior", "QKPositionPrior"]
