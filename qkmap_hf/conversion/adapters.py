"""Architecture adapters: what each source family needs to become a QK-MAP model.

An adapter answers three questions for one family of Llama-style checkpoints and nothing else: can this
source be converted exactly (refusals with a reason), which config fields carry over (and which are
forced), and what happens to individual tensors (renames, transforms, tensors the QK-MAP layout adds).
The streaming engine (``engine.py``) does the rest, the same way for every family. A new family joins
with a small class and ``@register_adapter("XForCausalLM")``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar

import torch

from ..modeling.configuration_qkmap import QKMapConfig


class ConversionError(ValueError):
    """A source that cannot be converted; the message names the file or field and what to do."""


# Fields a QK-MAP config accepts (Llama's plus the generic ones); everything else in a source config is
# dropped, so family-specific switches (sliding windows, layer types) cannot leak into the new model.
QKMAP_CONFIG_FIELDS = frozenset(f.name for f in dataclasses.fields(QKMapConfig))
_NEVER_COPIED = {"architectures", "auto_map", "transformers_version", "dtype", "model_type"}
# Pre-v5 names that QKMapConfig normalizes into ``rope_parameters`` itself.
_LEGACY_ROPE_FIELDS = ("rope_scaling", "rope_theta")
# Buffers some older checkpoints saved; transformers recomputes them.
_DROPPED_SUFFIXES = (".rotary_emb.inv_freq",)

ADAPTERS: dict[str, type[ArchitectureAdapter]] = {}

# Families we know and refuse, with the reason; anything else unknown is refused generically.
KNOWN_UNSUPPORTED: dict[str, str] = {
    "Qwen3ForCausalLM": "it already normalizes queries and keys (q_norm/k_norm)",
    "Olmo2ForCausalLM": "it already normalizes queries and keys (q_norm/k_norm)",
    "Gemma3ForCausalLM": "it already normalizes queries and keys (q_norm/k_norm)",
    "CohereForCausalLM": "it normalizes queries and keys and uses parallel blocks",
    "Phi3ForCausalLM": "its attention uses one fused qkv_proj",
    "GPTNeoXForCausalLM": "its attention uses one fused query_key_value projection",
    "FalconForCausalLM": "its attention uses one fused query_key_value projection",
    "MixtralForCausalLM": "it is a mixture-of-experts model",
    "Qwen2MoeForCausalLM": "it is a mixture-of-experts model",
    "Qwen3MoeForCausalLM": "it is a mixture-of-experts model",
    "GemmaForCausalLM": "its RMSNorm and embedding scaling differ from Llama's",
    "Gemma2ForCausalLM": "it alternates sliding-window layers and soft-caps logits",
    "QKMapForCausalLM": "it is already a QK-MAP model",
}


def register_adapter(*architectures: str) -> Callable[[type[ArchitectureAdapter]], type[ArchitectureAdapter]]:
    """Class decorator: make ``cls`` the adapter for the given ``config.architectures`` names."""

    def decorate(cls: type[ArchitectureAdapter]) -> type[ArchitectureAdapter]:
        cls.architectures = tuple(architectures)
        for name in architectures:
            ADAPTERS[name] = cls
        return cls

    return decorate


def supported_architectures() -> tuple[str, ...]:
    return tuple(sorted(ADAPTERS))


class ArchitectureAdapter:
    """Llama's layout: q/k/v/o projections by name, RMSNorms, SwiGLU MLP. Subclasses override the differences."""

    architectures: ClassVar[tuple[str, ...]] = ()
    #: Config fields forced on the QK-MAP config (after copying the shared ones).
    forced_fields: ClassVar[dict[str, Any]] = {}
    #: Substrings of tensor names that reveal a layout we cannot convert, with the reason.
    refused_tensor_markers: ClassVar[dict[str, str]] = {
        ".q_norm.": "queries are already normalized (q_norm)",
        ".k_norm.": "keys are already normalized (k_norm)",
        ".qkv_proj.": "the q/k/v projections are fused (qkv_proj)",
        ".experts.": "the MLP is a mixture of experts",
    }

    def __init__(self, architecture: str):
        self.architecture = architecture

    # ---- config -------------------------------------------------------------------------------

    def check_config(self, config: dict[str, Any], where: str) -> None:
        """Raise ``ConversionError`` if the source's function cannot be reproduced by a QK-MAP model."""

    def config_fields(self, config: dict[str, Any]) -> dict[str, Any]:
        """The Llama-compatible fields of the QK-MAP config, taken from the source config."""
        fields = {
            key: value
            for key, value in config.items()
            if (key in QKMAP_CONFIG_FIELDS or key in _LEGACY_ROPE_FIELDS)
            and key not in _NEVER_COPIED
            and not key.startswith("qk")
        }
        fields.update(self.forced_fields)
        return fields

    # ---- tensors -------------------------------------------------------------------------------

    def check_tensor_name(self, name: str, where: str) -> None:
        for marker, reason in self.refused_tensor_markers.items():
            if marker in name:
                raise ConversionError(
                    f"{where}: tensor {name!r} shows that {reason}; {self.architecture} checkpoints with this layout "
                    f"cannot be converted exactly. Supported: {', '.join(supported_architectures())} with separate "
                    "q_proj/k_proj/v_proj and no q/k norms."
                )

    def rename(self, name: str) -> str | None:
        """Output name of a source tensor, or ``None`` to drop it (recomputed buffers)."""
        return None if name.endswith(_DROPPED_SUFFIXES) else name

    def transform(self, name: str, tensor: torch.Tensor, config: QKMapConfig) -> torch.Tensor:
        """Transform one tensor (output name ``name``). Exact and canonical inits copy W_q/W_k unchanged:
        with ``m = head_dim`` the projections feed ``z`` as they fed RoPE before."""
        return tensor

    def extra_tensors(self, config: QKMapConfig) -> dict[str, Callable[[tuple[int, ...]], torch.Tensor]]:
        """Tensors the QK-MAP layout needs that the source lacks (beyond qk_map), as ``name -> make(shape)``."""
        return {}


def _is_sliding(config: dict[str, Any]) -> bool:
    window = config.get("sliding_window")
    limit = config.get("max_position_embeddings")
    return window is not None and (limit is None or int(window) < int(limit))


@register_adapter("LlamaForCausalLM")
class LlamaAdapter(ArchitectureAdapter):
    """Llama, and everything saved as Llama (SmolLM, TinyLlama, Llama 2/3, ...)."""


@register_adapter("MistralForCausalLM")
class MistralAdapter(ArchitectureAdapter):
    """Mistral is Llama without biases, plus an optional sliding window over every layer."""

    forced_fields: ClassVar[dict[str, Any]] = {"attention_bias": False, "mlp_bias": False}

    def check_config(self, config: dict[str, Any], where: str) -> None:
        if _is_sliding(config):
            raise ConversionError(
                f"{where}: MistralForCausalLM with sliding_window={config['sliding_window']} < "
                f"max_position_embeddings={config.get('max_position_embeddings')} attends through a sliding window in "
                "every layer; QK-MAP models attend over the full causal context, so the conversion would not be exact "
                "beyond the window. Convert a release with sliding_window null (Mistral v0.2 and later)."
            )


@register_adapter("Qwen2ForCausalLM")
class Qwen2Adapter(ArchitectureAdapter):
    """Qwen2: biases on q/k/v but not on o; the QK-MAP layout gets a zero o_proj bias (exact)."""

    forced_fields: ClassVar[dict[str, Any]] = {"attention_bias": True, "mlp_bias": False}

    def check_config(self, config: dict[str, Any], where: str) -> None:
        layers = int(config.get("num_hidden_layers") or 0)
        if config.get("layer_types"):
            sliding = [i for i, kind in enumerate(config["layer_types"]) if kind != "full_attention"]
        elif config.get("use_sliding_window"):
            sliding = list(range(int(config.get("max_window_layers", 28)), layers))
        else:
            sliding = []
        if not config.get("use_sliding_window") or not _is_sliding(config):
            sliding = []  # transformers disables the window in these cases; every layer is full attention
        if sliding:
            raise ConversionError(
                f"{where}: Qwen2ForCausalLM uses sliding-window attention (sliding_window="
                f"{config.get('sliding_window')}) in layers {sliding[:8]}{'...' if len(sliding) > 8 else ''}; QK-MAP "
                "models attend over the full causal context, so only Qwen2 checkpoints with use_sliding_window=false "
                "(or a window no shorter than max_position_embeddings) convert exactly."
            )

    def extra_tensors(self, config: QKMapConfig) -> dict[str, Callable[[tuple[int, ...]], torch.Tensor]]:
        return {
            f"model.layers.{i}.self_attn.o_proj.bias": lambda shape: torch.zeros(shape)
            for i in range(config.num_hidden_layers)
        }


def adapter_for(architecture: str | None, where: str) -> ArchitectureAdapter:
    """The adapter for ``architecture`` or a ``ConversionError`` that names it and lists the supported ones."""
    supported = ", ".join(supported_architectures())
    if architecture in ADAPTERS:
        return ADAPTERS[architecture](architecture)
    if architecture is None:
        raise ConversionError(
            f"{where}: no 'architectures' entry, so the model family is unknown. Add e.g. "
            f'"architectures": ["LlamaForCausalLM"] if it is one of the supported ones: {supported}.'
        )
    reason = KNOWN_UNSUPPORTED.get(architecture)
    because = f" because {reason}" if reason else ""
    raise ConversionError(
        f"{where}: architecture {architecture} cannot be converted to QK-MAP attention{because}. Supported "
        f"architectures: {supported} (and models saved as one of them, e.g. SmolLM, TinyLlama). Fused qkv "
        "projections, mixture-of-experts, sliding-window-only models and models with q/k norms are refused."
    )
