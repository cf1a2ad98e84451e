"""Qwen2: biases on q/k/v but not on o; the QK-MAP layout gets a zero o_proj bias (exact)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, ClassVar

import torch

from ...modeling.configuration_qkmap import QKMapConfig
from ..adapters import ArchitectureAdapter, OutputTensor, refuse_sliding_layers, register_adapter


@register_adapter("Qwen2ForCausalLM")
class Qwen2Adapter(ArchitectureAdapter):
    forced_fields: ClassVar[dict[str, Any]] = {"attention_bias": True, "mlp_bias": False}

    def check_config(self, config: dict[str, Any], where: str) -> None:
        refuse_sliding_layers(config, where, "Qwen2ForCausalLM")

    def created_tensors(self, config: QKMapConfig) -> Iterator[OutputTensor]:
        for i in range(config.num_hidden_layers):
            yield OutputTensor(
                f"model.layers.{i}.self_attn.o_proj.bias", compute=lambda: torch.zeros(config.hidden_size)
            )
