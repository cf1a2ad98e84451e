# Copyright 2026 The qkmap-hf authors. Licensed under the Apache License, Version 2.0.
"""QK-MAP attention for Llama-style decoders (arXiv:2611.10560, as reconstructed in docs/method.md).

This file is copied into every saved checkpoint and loaded with ``trust_remote_code=True``: it must
import only torch and transformers (and sibling files, relatively).

Everything that differs from Llama is in attention_qkmap.py (``QKMapAttention`` and its kernels) and the query/key
constructions it runs (qk_registry.py: QK-Norm, the QK-MAP feature map of construction_qkmap.py with the math of
feature_map_qkmap.py, the position prior). This file is Llama's layout around them, parameter names included, so
weights move between them by name.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import inspect
from collections.abc import Iterator

import torch
from torch import nn
from transformers import AutoModel
from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicCache
from transformers.generation import GenerationMixin
from transformers.masking_utils import create_causal_mask
from transformers.modeling_layers import (
    GenericForQuestionAnswering,
    GenericForSequenceClassification,
    GenericForTokenClassification,
    GradientCheckpointingLayer,
)
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import PreTrainedModel
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding
from transformers.utils.deprecation import deprecate_kwarg
from transformers.utils.generic import can_return_tuple, merge_with_config_defaults
from transformers.utils.output_capturing import capture_outputs

from .attention_qkmap import QKMapAttention, single_query_attention
from .configuration_qkmap import QKMapConfig
from .construction_qkmap import QKMapFeatureMap, QKMapInputRMSNorm
from .feature_map_qkmap import qkmap_features
from .position_prior import QKPositionPrior
from .qk_registry import constructions_for, position_construction

# transformers 5.24 renamed the cache argument and output field from ``past_key_values`` to ``cache``.
# One name per installed version keeps this file working across the supported 5.x range.
_MASK_CACHE_ARG = "cache" if "cache" in inspect.signature(create_causal_mask).parameters else "past_key_values"
_OUTPUT_CACHE_FIELD = (
    "cache" if "cache" in {f.name for f in dataclasses.fields(BaseModelOutputWithPast)} else "past_key_values"
)


def cache_keyword(forward):
    """The cache keyword as the installed transformers' own models take it: where it is ``cache`` (5.24 on),
    ``past_key_values`` still works with Llama's deprecation notice; before, ``past_key_values`` is the name."""
    if _MASK_CACHE_ARG == "past_key_values":
        return forward
    return deprecate_kwarg("past_key_values", version="5.40.0", new_name="cache")(forward)


# --------------------------------------------------------------------------------------------------
# Llama's layout around QKMapAttention
# --------------------------------------------------------------------------------------------------


class QKMapDecoderLayer(GradientCheckpointingLayer):
    def __init__(self, config: QKMapConfig, layer_idx: int):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.self_attn = QKMapAttention(config=config, layer_idx=layer_idx)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        use_cache: bool | None = False,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs,
    ) -> torch.Tensor:
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, _ = self.self_attn(
            hidden_states=hidden_states,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            use_cache=use_cache,
            position_embeddings=position_embeddings,
            **kwargs,
        )
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        return residual + hidden_states


class QKMapPreTrainedModel(PreTrainedModel):
    config_class = QKMapConfig
    config: QKMapConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["QKMapDecoderLayer"]
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_flex_attn = True
    _can_compile_fullgraph = True
    _supports_attention_backend = True
    _can_record_outputs = {
        "hidden_states": QKMapDecoderLayer,
        "attentions": QKMapAttention,
    }

    def post_init(self) -> None:
        """``PreTrainedModel.post_init``, with the modules kept in float32 those of this config's constructions only
        (a ``qk_norm`` or ``standard`` model has no ``qk_map`` module)."""
        self._keep_in_fp32_modules = sorted({n for c in constructions_for(self.config) for n in c.float32_modules})
        super().post_init()

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        """``PreTrainedModel.from_pretrained``, then the fixed parameters frozen again (the loader makes every loaded
        float tensor trainable: a frozen omega, gain or reference scale would train)."""
        loaded = super().from_pretrained(*args, **kwargs)
        model = loaded[0] if isinstance(loaded, tuple) else loaded
        for module in model.modules():
            if callable(getattr(module, "reset_trainability", None)):  # a query/key construction's module
                module.reset_trainability()
        return loaded

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """Llama's init, then a query/key construction's modules at their ``initial_values``."""
        super()._init_weights(module)
        if callable(getattr(module, "initial_values", None)):
            for name, value in module.initial_values().items():
                init.copy_(getattr(module, name), value)


def rope_config_for_width(config: QKMapConfig, width: int) -> QKMapConfig:
    """The config RoPE sees: transformers' rope utilities read ``head_dim`` as the rotated width."""
    if width == config.head_dim:
        return config
    rope_config = copy.copy(config)
    rope_config.head_dim = width
    return rope_config


class QKMapModel(QKMapPreTrainedModel):
    def __init__(self, config: QKMapConfig):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList(
            [QKMapDecoderLayer(config, layer_idx) for layer_idx in range(config.num_hidden_layers)]
        )
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config=rope_config_for_width(config, config.projection_dim))
        self.gradient_checkpointing = False
        if config.qk_mode == "qk_map" and config.qkmap_input_norm and config.qkmap_input_norm_power == 1:
            # At power 1 the input norm is Qwen3's RMSNorm and its reference_scale unused (r^(1 - beta) = 1); vLLM
            # swaps such a norm for its own RMSNorm, which has no reference_scale, and skips checkpoint keys that
            # match this pattern (transformers loads them as usual: it only filters its warnings with it).
            self._keys_to_ignore_on_load_unexpected = [r"self_attn\.[qk]_norm\.reference_scale$"]
        self.post_init()

    @cache_keyword
    @merge_with_config_defaults
    @capture_outputs
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        use_cache: bool | None = None,
        past_key_values: Cache | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        cache = cache if cache is not None else past_key_values
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        if position_ids is None:
            past_seen_tokens = cache.get_seq_length() if cache is not None else 0
            position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_seen_tokens
            position_ids = position_ids.unsqueeze(0)

        causal_mask = create_causal_mask(
            config=self.config,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            position_ids=position_ids,
            **{_MASK_CACHE_ARG: cache},
        )
        hidden_states = inputs_embeds
        # QK-MAP rotates its feature blocks in float32; the other modes keep Llama's exact numerics.
        float32 = position_construction(self.config).float32_positions
        rope_reference = hidden_states.new_empty(0, dtype=torch.float32) if float32 else hidden_states
        position_embeddings = self.rotary_emb(rope_reference, position_ids=position_ids)

        for decoder_layer in self.layers[: self.config.num_hidden_layers]:
            hidden_states = decoder_layer(
                hidden_states,
                attention_mask=causal_mask,
                position_embeddings=position_embeddings,
                position_ids=position_ids,
                cache=cache,
                use_cache=use_cache,
                **kwargs,
            )
        hidden_states = self.norm(hidden_states)
        return BaseModelOutputWithPast(last_hidden_state=hidden_states, **{_OUTPUT_CACHE_FIELD: cache})


@contextlib.contextmanager
def paged_cache_width(config: QKMapConfig) -> Iterator[None]:
    """``config.head_dim`` reads as the key width while continuous batching sizes its paged cache.

    The paged cache keeps keys and values at one width, ``head_dim`` of the config; QK-MAP keys are ``2 F m`` wide,
    so the cache is sized for them and the attention pads values to that width before storing them. Nothing else
    reads ``config.head_dim`` while the cache is built (the layers hold their own widths).
    """
    width, head_dim = config.query_key_dim, config.head_dim
    if width == head_dim:
        yield
        return
    config.head_dim = width
    try:
        yield
    finally:
        config.head_dim = head_dim


class QKMapForCausalLM(QKMapPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _tp_plan = {"lm_head": "colwise_gather_output"}
    _pp_plan = {"lm_head": (["hidden_states"], ["logits"])}

    def __init__(self, config: QKMapConfig):
        super().__init__(config)
        self.model = QKMapModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def init_continuous_batching(self, *args, **kwargs):
        """transformers' continuous batching manager, its paged cache sized for QK-MAP's keys (``paged_cache_width``)."""
        manager = super().init_continuous_batching(*args, **kwargs)
        create = getattr(manager, "_create_batch_processor", None)
        if create is None:
            if self.config.query_key_dim != self.config.head_dim:
                raise ValueError(
                    f"config.json: keys are {self.config.query_key_dim} wide (2 * qkmap_num_frequencies * "
                    f"qkmap_input_dim) but this transformers' continuous batching sizes its cache from head_dim="
                    f"{self.config.head_dim} at a place this model cannot reach; use generate(), or a compact layout "
                    "(qkmap_input_dim = head_dim // (2 * qkmap_num_frequencies))."
                )
            return manager
        if not getattr(create, "_qkmap_sized", False):

            @functools.wraps(create)
            def create_sized(*a, **kw):
                with paged_cache_width(self.config):
                    return create(*a, **kw)

            create_sized._qkmap_sized = True
            manager._create_batch_processor = create_sized
        return manager

    @cache_keyword
    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        past_key_values: Cache | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        outputs: BaseModelOutputWithPast = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache if cache is not None else past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            return_dict=True,  # a tuple, where asked for, is made once, at the end (can_return_tuple)
            **kwargs,
        )
        hidden_states = outputs.last_hidden_state
        slice_indices = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(hidden_states[:, slice_indices, :])
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            **{_OUTPUT_CACHE_FIELD: getattr(outputs, _OUTPUT_CACHE_FIELD)},
        )


class QKMapHeadMixin:
    """Builds a transformers generic head (``GenericFor*``) on ``QKMapModel``.

    The generic heads build their body with ``AutoModel.from_config(config)``. In a process that loads a saved folder
    as remote code, the config's class comes from another copy of ``configuration_qkmap`` than this file's (transformers
    loads each class with its own files), so no registration made in advance matches it, and the body's lookup asks
    for ``trust_remote_code`` again. Registering the config's own class first finds this file's ``QKMapModel``.
    """

    def __init__(self, config: QKMapConfig) -> None:
        AutoModel.register(type(config), QKMapModel, exist_ok=True)
        super().__init__(config)


class QKMapForSequenceClassification(QKMapHeadMixin, GenericForSequenceClassification, QKMapPreTrainedModel): ...


class QKMapForQuestionAnswering(QKMapHeadMixin, GenericForQuestionAnswering, QKMapPreTrainedModel):
    base_model_prefix = "transformer"  # Llama's name for the body of this head: its checkpoints load unchanged


class QKMapForTokenClassification(QKMapHeadMixin, GenericForTokenClassification, QKMapPreTrainedModel): ...


__all__ = [
    "QKMapAttention",
    "QKMapFeatureMap",
    "QKMapForCausalLM",
    "QKMapForQuestionAnswering",
    "QKMapForTokenClassification",
    "QKMapInputRMSNorm",
    "QKMapForSequenceClassification",
    "QKMapModel",
    "QKMapPreTrainedModel",
    "QKPositionPrior",
    "qkmap_features",
    "single_query_attention",
]
