"""Architecture adapters: what each source family needs to become a QK-MAP model.

An adapter answers three questions for one family of Llama-style checkpoints and nothing else: can this
source be converted exactly (refusals with a reason), which config fields carry over (and which are
forced), and which output tensors each source tensor becomes (``tensor_outputs``: none, one, or several;
an output computed from several source tensors names them all). The plan (``plan.py``) and the writer
(``writer.py``) do the rest, the same way for every family. A family joins with a small file in
``families/`` holding a subclass decorated with ``@register_adapter("XForCausalLM")``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator
from typing import Any, ClassVar

import torch

from ..modeling.configuration_qkmap import QKMapConfig
from .errors import ConversionError

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
    "Olmo2ForCausalLM": "it normalizes queries and keys over all heads at once (not per head)",
    "Gemma3ForCausalLM": "it normalizes queries and keys with Gemma's (1 + weight) RMSNorm and alternates sliding layers",
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


@dataclasses.dataclass(frozen=True)
class OutputTensor:
    """One tensor of the converted checkpoint and how it is computed.

    ``compute(*tensors)`` receives the source tensors named in ``sources`` (in that order) and returns the
    output; ``None`` means the single source unchanged. No sources: a tensor the conversion creates
    (``compute()`` with no arguments). The shape is checked against the QK-MAP model when planning.
    """

    name: str
    sources: tuple[str, ...] = ()
    compute: Callable[..., torch.Tensor] | None = None


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
                    "q_proj/k_proj/v_proj (q/k norms only where the family has them, as Qwen3 does)."
                )

    def tensor_outputs(self, name: str, config: QKMapConfig) -> Iterable[OutputTensor]:
        """The output tensors source tensor ``name`` contributes to: none (dropped), one, or several (a split).

        An output computed from several source tensors (a merge) may be yielded by each of them with the
        same ``sources``; it is planned once. Exact and native inits copy W_q/W_k unchanged: with
        ``m = head_dim`` the projections feed ``z`` as they fed RoPE before.
        """
        if not name.endswith(_DROPPED_SUFFIXES):
            yield OutputTensor(name, (name,))

    def created_tensors(self, config: QKMapConfig) -> Iterator[OutputTensor]:
        """Tensors the QK-MAP layout needs that the source lacks (beyond qk_map); skipped where the source has them."""
        yield from ()


def is_sliding(config: dict[str, Any]) -> bool:
    """Whether a window is set and shorter than the context (transformers ignores it otherwise)."""
    window = config.get("sliding_window")
    limit = config.get("max_position_embeddings")
    return window is not None and (limit is None or int(window) < int(limit))


def refuse_sliding_layers(config: dict[str, Any], where: str, architecture: str) -> None:
    """Qwen2/Qwen3 rule: layers listed in ``layer_types`` (or from ``max_window_layers`` on) slide when enabled."""
    layers = int(config.get("num_hidden_layers") or 0)
    if config.get("layer_types"):
        sliding = [i for i, kind in enumerate(config["layer_types"]) if kind != "full_attention"]
    elif config.get("use_sliding_window"):
        sliding = list(range(int(config.get("max_window_layers", 28)), layers))
    else:
        sliding = []
    if not config.get("use_sliding_window") or not is_sliding(config):
        sliding = []  # transformers disables the window in these cases; every layer is full attention
    if sliding:
        raise ConversionError(
            f"{where}: {architecture} uses sliding-window attention (sliding_window="
            f"{config.get('sliding_window')}) in layers {sliding[:8]}{'...' if len(sliding) > 8 else ''}; QK-MAP "
            f"models attend over the full causal context, so only {architecture} checkpoints with "
            "use_sliding_window=false (or a window no shorter than max_position_embeddings) convert exactly."
        )


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
        "projections, mixture-of-experts and sliding-window-only models are refused."
    )


__all__ = [
    "ADAPTERS",
    "KNOWN_UNSUPPORTED",
    "ArchitectureAdapter",
    "ConversionError",
    "OutputTensor",
    "adapter_for",
    "is_sliding",
    "refuse_sliding_layers",
    "register_adapter",
    "supported_architectures",
]
