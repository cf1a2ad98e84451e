"""Convert Llama-style checkpoints (Llama, Mistral, Qwen2, Qwen3 and models saved as them) to QK-MAP attention.

One job per module: ``sources`` (where tensors come from), ``plan`` (every output tensor, checked against
the model), ``writer`` (streaming safetensors, atomic folder), ``api`` (``convert_model`` in memory,
``convert_to_folder`` on disk), ``packaging`` (provenance, verification and card: ``convert_checkpoint``,
what the CLI and the demo call), ``adapters`` (the hook) and one small file per family in ``families/``.
"""

from __future__ import annotations

from . import families as _families  # noqa: F401 - registers the adapters
from .adapters import ADAPTERS, ArchitectureAdapter, OutputTensor, register_adapter, supported_architectures
from .api import ConversionResult, convert_model, convert_to_folder
from .errors import ConversionError
from .export_qwen3 import save_qk_norm_as_qwen3
from .input_norm import calibrate_reference_scale, fold_input_norm, set_input_norm_power
from .options import INITS, ConversionOptions
from .packaging import convert_checkpoint, package_conversion
from .plan import plan_conversion
from .sources import resolve_source

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
    "calibrate_reference_scale",
    "convert_checkpoint",
    "convert_model",
    "convert_to_folder",
    "fold_input_norm",
    "package_conversion",
    "plan_conversion",
    "register_adapter",
    "resolve_source",
    "save_qk_norm_as_qwen3",
    "set_input_norm_power",
]
