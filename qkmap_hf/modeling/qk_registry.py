# Copyright 2026 The qkmap-hf authors. Licensed under the Apache License, Version 2.0.
"""The registry of query/key constructions (protocol: query_key.py), keyed by the config.

``constructions_for(config)`` is the one answer to "how does this layer build its queries and keys": the attention
module runs it, and the config (kernel width, projection width, logit scale), the optimizer groups, peft's
``modules_to_save``, the conversion plan and the training monitor read it. A new construction is its file, its
line in ``QK_CONSTRUCTIONS`` and its tests (docs/architecture.md). Copied into checkpoints: torch and transformers only.
"""

from __future__ import annotations

from typing import Any

from .construction_qkmap import QKMapFeatures, QKMapInputNorm
from .position_prior import PositionPrior
from .query_key import STAGES, QueryKeyConstruction, QueryKeyRMSNorm, RotaryPositions

QK_CONSTRUCTIONS: tuple[type[QueryKeyConstruction], ...] = (
    QueryKeyRMSNorm,
    QKMapInputNorm,
    RotaryPositions,
    QKMapFeatures,
    PositionPrior,
)


def constructions_for(config: Any) -> tuple[type[QueryKeyConstruction], ...]:
    """The constructions a model with ``config`` runs, in stage order (input, position, output); exactly one
    position stage. Any config works: one without ``qk_mode`` (a plain Llama) gets RoPE."""
    chosen = sorted((c for c in QK_CONSTRUCTIONS if c.applies_to(config)), key=lambda c: STAGES.index(c.stage))
    positions = [c.name for c in chosen if c.stage == "position"]
    if len(positions) != 1:
        raise ValueError(
            f"qk_mode={getattr(config, 'qk_mode', None)!r} selects {len(positions)} position constructions "
            f"({', '.join(positions) or 'none'}); exactly one must apply (qkmap_hf/modeling/qk_registry.py)."
        )
    return tuple(chosen)


def position_construction(config: Any) -> type[QueryKeyConstruction]:
    """The construction that brings in positions and sets the query/key projection width and logit scale."""
    return next(c for c in constructions_for(config) if c.stage == "position")


def query_key_width(config: Any) -> int:
    """Width per head of the queries and keys that reach the attention kernel (and the key cache)."""
    constructions = constructions_for(config)
    width = next(c for c in constructions if c.stage == "position").projection_dim(config)
    for construction in constructions:
        width = construction.width(config, width)
    return width


def owned_modules(config: Any) -> tuple[str, ...]:
    """Attribute names (under ``self_attn``) of every module the constructions of ``config`` own."""
    return tuple(name for construction in constructions_for(config) for name in construction.modules)


__all__ = ["QK_CONSTRUCTIONS", "constructions_for", "owned_modules", "position_construction", "query_key_width"]
