"""Qwen3: per-head RMSNorm on queries and keys (``q_norm``/``k_norm``), ``head_dim`` independent of the width.

No elementwise feature map reproduces a per-token RMS division, so the converted model keeps the norm in
front of the feature map (``qkmap_input_norm``: ``phi(RMSNorm(z))``); the norm weights carry over by name, and the
input norm's construction creates its per-head reference scale (ones: unused at norm power 1, the healing schedule
calibrates it).
"""

from __future__ import annotations

from typing import Any, ClassVar

from ..adapters import ArchitectureAdapter, refuse_sliding_layers, register_adapter


@register_adapter("Qwen3ForCausalLM")
class Qwen3Adapter(ArchitectureAdapter):
    forced_fields: ClassVar[dict[str, Any]] = {"mlp_bias": False, "qkmap_input_norm": True}
    refused_tensor_markers: ClassVar[dict[str, str]] = {
        key: reason for key, reason in ArchitectureAdapter.refused_tensor_markers.items() if "_norm" not in key
    }

    def check_config(self, config: dict[str, Any], where: str) -> None:
        refuse_sliding_layers(config, where, "Qwen3ForCausalLM")
