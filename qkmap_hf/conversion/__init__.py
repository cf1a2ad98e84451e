"""Convert Llama-style checkpoints (Llama, Mistral, Qwen2, Qwen3 and models saved as them) to QK-MAP attention.

One job per module: ``sources`` (the tensors of a source, streamed), ``plan`` (every output tensor, checked
against the model), ``writer`` (streaming safetensors, atomic folder), ``api`` (``convert_model`` in memory,
``convert_to_folder`` on disk), ``adapters`` (the hook) and one small file per family in ``families/``.
Around it, not in it: ``qkmap_hf.loading`` resolves and loads the source, ``qkmap_hf.packaging``
(``convert_checkpoint``, what the CLI and the demo call) adds provenance, verification and the card, and
``qkmap_hf.surgery`` edits models (the input norm, the export back to Qwen3). This package imports neither the
verifier nor the card writer.
"""

from __future__ import annotations

from . import families as _families  # noqa: F401 - registers the adapters
from .adapters import ADAPTERS, ArchitectureAdapter, OutputTensor, register_adapter, supported_architectures
from .api import ConversionResult, convert_model, convert_to_folder
from .errors import ConversionError
from .options import INITS, ConversionOptions
from .plan import plan_conversion

SUPPORTED_ARCHITECTURES: tuple[str, ...] = supported_architectures()

__all__ = [
    "ADAPTERS",
    "INITS",
    "SUPPORTED_ARCHITECTURES",
    "ArchitectureAdapter",
    "ConversionError",
    "ConversionOptions",
    "ConversionResult",
    "OutputTensor",
    "convert_model",
    "convert_to_folder",
    "plan_conversion",
    "register_adapter",
]
