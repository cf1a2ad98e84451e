"""How the diagnostics see a model: its attention layers, their weights, and one captured unscaled pass.

Attention weights come from hooks on the attention modules with the eager kernel. ``capture`` runs the probe
windows once and keeps every layer's weights and the inputs its attention module was called with, so the measures
that perturb one layer (scale and key-scale sensitivity) re-run that module alone instead of the model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn


@dataclass
class AttentionLayer:
    """One attention module with its q/k projections (and QK-MAP feature map), as the probes see it."""

    index: int
    attention: nn.Module
    q_proj: nn.Module
    k_proj: nn.Module
    feature_map: nn.Module | None = None
    extra: dict = field(default_factory=dict)


def attention_layers(model: nn.Module) -> list[AttentionLayer]:
    """Attention modules with separate ``q_proj``/``k_proj`` (Llama family, QK-MAP), in layer order."""
    layers = []
    for module in model.modules():
        q_proj, k_proj = getattr(module, "q_proj", None), getattr(module, "k_proj", None)
        if isinstance(q_proj, nn.Module) and isinstance(k_proj, nn.Module):
            feature_map = getattr(module, "qk_map", None)
            if feature_map is not None and not callable(getattr(feature_map, "frequency", None)):
                feature_map = None
            layers.append(AttentionLayer(len(layers), module, q_proj, k_proj, feature_map))
    if not layers:
        raise ValueError(
            f"{type(model).__name__} has no attention modules with separate q_proj and k_proj; the analysis supports "
            "Llama-family and QK-MAP models (fused-QKV architectures such as GPT-2 are not supported)."
        )
    return layers


def use_eager_attention(model: nn.Module) -> None:
    """Attention weights only come out of the eager kernel."""
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "_attn_implementation", "eager") != "eager":
        if hasattr(model, "set_attn_implementation"):
            model.set_attn_implementation("eager")
        else:  # pragma: no cover - older transformers
            config._attn_implementation = "eager"


def attention_weights(output: Any, layer: AttentionLayer) -> torch.Tensor:
    """The attention probabilities an eager attention module returned, in float32."""
    weights = output[1] if isinstance(output, tuple) and len(output) > 1 else None
    if weights is None:
        raise RuntimeError(
            f"Attention layer {layer.index} ({type(layer.attention).__name__}) returned no attention weights; load the "
            "model with attn_implementation='eager'."
        )
    return weights.float()


@torch.no_grad()
def forward_without_cache(model: nn.Module, input_ids: torch.Tensor) -> None:
    """One forward pass whose hooks collect what a probe needs (no cache, no gradients)."""
    model(input_ids=input_ids, use_cache=False)


def prepended_bos_id(tokenizer) -> int | None:
    """The BOS id if the tokenizer puts one in front of text by itself (then the analysis does too)."""
    bos = tokenizer.bos_token_id
    return bos if bos is not None and tokenizer("a").input_ids[:1] == [bos] else None


@dataclass
class CapturedPass:
    """The unscaled pass over the probe windows: per layer its attention weights ``(batch, heads, T, T)`` and the
    ``(args, kwargs)`` its attention module was called with (for the measures that re-run one layer)."""

    layers: list[AttentionLayer]
    weights: list[torch.Tensor]
    inputs: list[tuple[tuple, dict]]
    first_is_bos: bool = False

    def rerun(self, layer: AttentionLayer) -> torch.Tensor:
        """The layer's attention weights on the inputs it saw, with whatever hooks the caller put on it."""
        args, kwargs = self.inputs[layer.index]
        return attention_weights(layer.attention(*args, **kwargs), layer)


@torch.no_grad()
def capture(
    model: nn.Module, layers: list[AttentionLayer], input_ids: torch.Tensor, first_is_bos: bool = False
) -> CapturedPass:
    """Run ``input_ids`` once and keep what ``CapturedPass`` holds."""
    weights: list[torch.Tensor | None] = [None] * len(layers)
    inputs: list[Any] = [None] * len(layers)
    handles = []
    for layer in layers:

        def grab(_m, _i, output, layer=layer):
            weights[layer.index] = attention_weights(output, layer)

        def keep(_m, args, kwargs, layer=layer):
            inputs[layer.index] = (args, kwargs)

        handles.append(layer.attention.register_forward_hook(grab))
        handles.append(layer.attention.register_forward_pre_hook(keep, with_kwargs=True))
    try:
        forward_without_cache(model, input_ids)
    finally:
        for handle in handles:
            handle.remove()
    return CapturedPass(layers, weights, inputs, first_is_bos)  # type: ignore[arg-type]


__all__ = [
    "AttentionLayer",
    "CapturedPass",
    "attention_layers",
    "attention_weights",
    "capture",
    "forward_without_cache",
    "prepended_bos_id",
    "use_eager_attention",
]
