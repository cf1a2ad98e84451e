"""Mistral: Llama without biases, plus an optional sliding window over every layer (refused when active)."""

from __future__ import annotations

from typing import Any, ClassVar

from ..adapters import ArchitectureAdapter, is_sliding, register_adapter
from ..errors import ConversionError


@register_adapter("MistralForCausalLM")
class MistralAdapter(ArchitectureAdapter):
    forced_fields: ClassVar[dict[str, Any]] = {"attention_bias": False, "mlp_bias": False}

    def check_config(self, config: dict[str, Any], where: str) -> None:
        if is_sliding(config):
            raise ConversionError(
                f"{where}: MistralForCausalLM with sliding_window={config['sliding_window']} < "
                f"max_position_embeddings={config.get('max_position_embeddings')} attends through a sliding window in "
                "every layer; QK-MAP models attend over the full causal context, so the conversion would not be exact "
                "beyond the window. Convert a release with sliding_window null (Mistral v0.2 and later)."
            )
