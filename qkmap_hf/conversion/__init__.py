"""Convert Llama-style checkpoints (Llama, Mistral, Qwen2 and models saved as them) to QK-MAP attention.

``convert_model`` works in memory; ``convert_checkpoint`` streams a checkpoint on disk (safetensors folder,
repo id in the local Hugging Face cache, or GGUF) into a new folder that loads without qkmap_hf. Both use
one adapter registry (``adapters.py``) and one tensor plan (``engine.py``).
"""

from __future__ import annotations

from .adapters import ADAPTERS, ArchitectureAdapter, ConversionError, register_adapter, supported_architectures
from .engine import INITS, ConversionOptions, convert_checkpoint, convert_model, plan_conversion, resolve_source

SUPPORTED_ARCHITECTURES: tuple[str, ...] = supported_architectures()

__all__ = [
    "ADAPTERS",
    "INITS",
    "SUPPORTED_ARCHITECTURES",
    "ArchitectureAdapter",
    "ConversionError",
    "ConversionOptions",
    "convert_checkpoint",
    "convert_model",
    "plan_conversion",
    "register_adapter",
    "resolve_source",
]
