# Copyright 2026 The qkmap-hf authors. Licensed under the Apache License, Version 2.0.
"""What QK-MAP's cos rows see (``qkmap_cos_block``): the phase ``omega z`` (QK-MAP), or a learnable constant.

``COS_BLOCKS`` is the registry, keyed by the config value. Whether the cos rows are RoPE-rotated is a separate
option both variants honour (``qkmap_rotate_cos_blocks``; unrotated is the no-prior control). Copied into
checkpoints: torch and transformers only.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from .feature_map_qkmap import qkmap_query_key_features, rotate_half


class PhaseCosBlocks:
    """``phase`` (the default): ``phi(z) = concat_f [a_cos cos(omega z), a_sin sin(omega z)]``."""

    name: ClassVar[str] = "phase"
    # Decoding maps one token's queries and keys in one stacked call (``one_token_query_key_features``).
    stacks_decoding: ClassVar[bool] = True

    @staticmethod
    def features(
        rotate: bool,
        query: torch.Tensor,
        key: torch.Tensor,
        frequency: torch.Tensor,
        query_gain: torch.Tensor,
        key_gain: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        compiled: bool = False,
        fused: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return qkmap_query_key_features(query, key, frequency, query_gain, key_gain, cos, sin, rotate, compiled, fused)


class ConstantCosBlocks(PhaseCosBlocks):
    """``constant``: the cos rows are the learnable constant ``a_cos`` (``cos(omega z)`` replaced by 1), rotated by
    RoPE when the cos blocks are, so only the sine rows see ``z``: the control that isolates magnitude from QK-MAP's
    relative-position prior (qkmap_lab/notes/synthetic-tasks.md). At zero sine gains it equals ``standard_prior``."""

    name = "constant"
    stacks_decoding = False

    @classmethod
    def features(cls, rotate, query, key, frequency, query_gain, key_gain, cos, sin, compiled=False, fused=True):
        sine_rows = cls.sine_rows(query_gain)
        query_features, key_features = qkmap_query_key_features(
            query, key, frequency, query_gain * sine_rows, key_gain * sine_rows, cos, sin, rotate, compiled, fused
        )
        groups = query.shape[1] // key.shape[1]
        return (
            query_features + cls.constant_features(rotate, query_gain, cos, sin, groups).to(query_features.dtype),
            key_features + cls.constant_features(rotate, key_gain, cos, sin, 1).to(key_features.dtype),
        )

    @staticmethod
    def sine_rows(gain: torch.Tensor) -> torch.Tensor:
        """1 on the sine rows, 0 on the cos rows, shaped to multiply ``(kv_heads, 2F, m)`` gains (no buffer: a
        non-persistent buffer would not survive loading on the meta device)."""
        return torch.arange(gain.shape[1], device=gain.device).remainder(2).to(gain.dtype)[None, :, None]

    @classmethod
    def constant_features(
        cls, rotate: bool, gain: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, groups: int
    ) -> torch.Tensor:
        """The cos rows as the constant ``a_cos``, RoPE-rotated when ``rotate``, zero in the sine rows;
        ``(batch or 1, heads, seq, 2F*m)``."""
        rows = gain * (1 - cls.sine_rows(gain))  # (kv_heads, 2F, m): the cos rows only
        rows = rows.repeat_interleave(groups, dim=0)[None, :, None]  # (1, heads, 1, 2F, m)
        if rotate:
            table_cos, table_sin = cos.float()[:, None, :, None], sin.float()[:, None, :, None]  # (b, 1, seq, 1, m)
            rows = rows * table_cos + rotate_half(rows) * table_sin
        else:
            rows = rows.expand(-1, -1, cos.shape[1], -1, -1)
        return rows.flatten(-2)


COS_BLOCKS: dict[str, type[PhaseCosBlocks]] = {variant.name: variant for variant in (PhaseCosBlocks, ConstantCosBlocks)}

__all__ = ["COS_BLOCKS", "ConstantCosBlocks", "PhaseCosBlocks"]
