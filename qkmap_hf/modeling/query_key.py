# Copyright 2026 The qkmap-hf authors. Licensed under the Apache License, Version 2.0.
"""The query/key construction protocol, and the two constructions every Llama has: RoPE and QK-Norm.

A *construction* is one stage of the path from a layer's projected queries and keys to what its attention kernel
sees. ``QKMapAttention`` runs the constructions ``qk_registry.constructions_for(config)`` selects, stage by stage:

- ``input``: per head, on the projection ``z`` in ``(batch, seq, heads, width)`` (QK-Norm, QK-MAP's input norm);
- ``position``: exactly one, which brings in positions and sets the kernel width (RoPE; QK-MAP's feature map);
- ``output``: appended after positions, ``(batch, heads, seq, width)`` (the position-prior control).

A construction owns modules under fixed attribute names of the attention module (``modules``: they are the
checkpoint's tensor names, ``self_attn.<name>.<parameter>``) and says everything the rest of the package needs to
know about them: the kernel width it produces, its logit scale, which optimizer group each parameter joins
(``parameter_group``), the tensors a converted checkpoint gets for it (``created_tensors``), and the monitor's
statistics of its parameters (``statistics``). Consumers ask the registry with a config; nothing outside
``modeling/`` names a construction's parameters. Adding one: docs/architecture.md, "Adding a query/key construction".

Copied into checkpoints next to modeling_qkmap.py: torch and transformers only.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

STAGES = ("input", "position", "output")
# Optimizer groups a construction may put its parameters in (``training/optim.py`` owns their settings):
# "query_key" is the group with its own learning rate and no weight decay; None leaves transformers' rule
# (norm weights and biases undecayed, matrices decayed); "decay" forces the weight-matrix treatment.
QUERY_KEY_GROUP = "query_key"


class QueryKeyConstruction:
    """One stage of the query/key path (see the module docstring). Entries are classes; nothing is instantiated."""

    name: ClassVar[str]
    stage: ClassVar[str]
    modules: ClassVar[tuple[str, ...]] = ()
    # Owned modules kept in float32 (``_keep_in_fp32_modules``): phases and gains lose too much in half precision.
    float32_modules: ClassVar[tuple[str, ...]] = ()
    # The position stage's RoPE tables in float32 whatever the model's dtype (else the dtype of the hidden states).
    float32_positions: ClassVar[bool] = False

    @classmethod
    def applies_to(cls, config: Any) -> bool:
        """Whether a model with ``config`` uses this construction."""
        raise NotImplementedError

    @classmethod
    def build(cls, config: Any) -> dict[str, nn.Module]:
        """The modules to attach to the attention module, by attribute name (``modules``)."""
        return {}

    @classmethod
    def apply(
        cls, attention: nn.Module, query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The stage itself, with the modules ``build`` attached to ``attention``."""
        raise NotImplementedError

    @classmethod
    def project(
        cls, attention: nn.Module, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Queries and keys ``(batch, heads, seq, width)`` built straight from the layer input in one step with this
        stage, or None (the default): the layer runs ``q_proj``/``k_proj`` and then the stages. Asked of the position
        stage when no input stage runs; the output stages run after it either way."""
        return None

    @classmethod
    def width(cls, config: Any, width: int) -> int:
        """Query/key width per head after this stage, given the width before it."""
        return width

    @classmethod
    def projection_dim(cls, config: Any) -> int:
        """Per-head width of ``q_proj``/``k_proj`` (asked of the position stage only)."""
        return config.head_dim

    @classmethod
    def logit_scale(cls, config: Any) -> float:
        """The logit scale before ``logit_scale_multiplier`` (asked of the position stage only)."""
        return config.head_dim**-0.5

    @classmethod
    def parameter_group(cls, config: Any, module_name: str, parameter_name: str) -> str | None:
        """Optimizer group of one owned parameter: ``QUERY_KEY_GROUP``, ``"decay"``, or None (transformers' rule)."""
        return QUERY_KEY_GROUP

    @classmethod
    def created_tensors(cls, config: Any) -> dict[str, torch.Tensor]:
        """Tensors a converted checkpoint gets for this construction when the source has none, by name under
        ``self_attn`` (e.g. ``qk_map.log_frequency``): the values a fresh model starts from."""
        return {}

    @classmethod
    def statistics(cls, attention: nn.Module, scaling: float) -> dict[str, float]:
        """Parameter-side numbers for the training monitor (``qkmap_hf.monitoring``): the logit bound the
        parameters imply and their sizes. Empty when the construction bounds nothing."""
        return {}


class RotaryPositions(QueryKeyConstruction):
    """Llama's RoPE on the projected queries and keys: the position stage of ``standard`` and ``qk_norm``."""

    name = "rope"
    stage = "position"

    @classmethod
    def applies_to(cls, config: Any) -> bool:
        return getattr(config, "qk_mode", "standard") != "qk_map"

    @classmethod
    def apply(cls, attention, query, key, cos, sin):
        return apply_rotary_pos_emb(query, key, cos, sin)


class QueryKeyRMSNorm(QueryKeyConstruction):
    """QK-Norm (``qk_mode="qk_norm"``): per-head RMSNorm with weights on queries and keys before RoPE (Qwen3's
    ``q_norm``/``k_norm``). Its weights train like every norm's (no decay, base rate) unless ``qkmap compare``
    puts them in the query/key group (``qk_norm_in_qk_group``, decided by the optimizer)."""

    name = "qk_norm"
    stage = "input"
    modules = ("q_norm", "k_norm")

    @classmethod
    def applies_to(cls, config: Any) -> bool:
        return getattr(config, "qk_mode", "standard") == "qk_norm"

    @classmethod
    def build(cls, config: Any) -> dict[str, nn.Module]:
        return {name: LlamaRMSNorm(config.head_dim, eps=config.rms_norm_eps) for name in cls.modules}

    @classmethod
    def apply(cls, attention, query, key, cos, sin):
        return attention.q_norm(query), attention.k_norm(key)

    @classmethod
    def parameter_group(cls, config: Any, module_name: str, parameter_name: str) -> str | None:
        return None

    @classmethod
    def statistics(cls, attention: nn.Module, scaling: float) -> dict[str, float]:
        """``|logit| <= scale * d * max|w_q| * max|w_k|``: unit-RMS inputs, weights scale each channel."""
        q_max, k_max = (float(getattr(attention, n).weight.detach().float().abs().max()) for n in cls.modules)
        width = attention.q_norm.weight.numel()
        return {"logit_bound": scaling * width * q_max * k_max, "q_norm_weight_max": q_max, "k_norm_weight_max": k_max}


__all__ = ["QUERY_KEY_GROUP", "STAGES", "QueryKeyConstruction", "QueryKeyRMSNorm", "RotaryPositions"]
