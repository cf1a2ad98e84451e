"""Qwen3: per-head RMSNorm on queries and keys (``q_norm``/``k_norm``), ``head_dim`` independent of the width.

No elementwise feature map reproduces a per-token RMS division, so the converted model keeps the norm in
front of the feature map (``qkmap_input_norm``: ``phi(RMSNorm(z))``). Each norm weight also yields the
norm's per-head reference scale (ones: unused at norm power 1, the healing schedule calibrates it).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch

from ...modeling.configuration_qkmap import QKMapConfig
from ..adapters import ArchitectureAdapter, OutputTensor, refuse_sliding_layers, register_adapter

_NORM_WEIGHTS = (".self_attn.q_norm.weight", ".self_attn.k_norm.weight")


@register_adapter("Qwen3ForCausalLM")
class Qwen3Adapter(ArchitectureAdapter):
    forced_fields: ClassVar[dict[str, Any]] = {"mlp_bias": False, "qkmap_input_norm": True}
    refused_tensor_markers: ClassVar[dict[str, str]] = {
        key: reason for key, reason in ArchitectureAdapter.refused_tensor_markers.items() if "_norm" not in key
    }

    def check_config(self, config: dict[str, Any], where: str) -> None:
        refuse_sliding_layers(config, where, "Qwen3ForCausalLM")

    def tensor_outputs(self, name: str, config: QKMapConfig) -> Iterable[OutputTensor]:
        yield from super().tensor_outputs(name, config)
        if name.endswith(_NORM_WEIGHTS):  # one source tensor, two outputs
            heads = config.num_attention_heads if ".q_norm." in name else config.num_key_value_heads
            yield OutputTensor(
                name.removesuffix("weight") + "reference_scale", (name,), lambda weight: torch.ones(heads).to(weight)
            )
