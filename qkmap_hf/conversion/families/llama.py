"""Llama, and everything saved as Llama (SmolLM, TinyLlama, Llama 2/3, ...): the base layout, nothing to change."""

from __future__ import annotations

from ..adapters import ArchitectureAdapter, register_adapter


@register_adapter("LlamaForCausalLM")
class LlamaAdapter(ArchitectureAdapter):
    """Llama's tensors map one to one onto the QK-MAP model."""
