# Copyright 2026 The qkmap-hf authors. Licensed under the Apache License, Version 2.0.
"""QK-MAP attention for Llama-style decoders (arXiv:2611.10560, as reconstructed in docs/method.md).

This file is copied into every saved checkpoint and loaded with ``trust_remote_code=True``: it must
import only torch and transformers (and sibling files, relatively).

Everything that differs from Llama sits in the first section: the feature map ``qkmap_features`` (in
feature_map_qkmap.py, with its recomputing backward pass), the ``QKMapFeatureMap`` module that owns the frequencies and gains, and ``QKMapAttention`` with its three
modes. The rest is Llama's layout, parameter names included, so weights move between them by name.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import math
from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F
from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicCache
from transformers.generation import GenerationMixin
from transformers.masking_utils import create_causal_mask
from transformers.modeling_layers import GenericForSequenceClassification, GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, PreTrainedModel
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
    eager_attention_forward,
)
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import capture_outputs

from .configuration_qkmap import QKMapConfig
from .feature_map_qkmap import qkmap_features
from .position_prior import QKPositionPrior

# transformers 5.24 renamed the cache argument and output field from ``past_key_values`` to ``cache``.
# One name per installed version keeps this file working across the supported 5.x range.
_MASK_CACHE_ARG = "cache" if "cache" in inspect.signature(create_causal_mask).parameters else "past_key_values"
_OUTPUT_CACHE_FIELD = (
    "cache" if "cache" in {f.name for f in dataclasses.fields(BaseModelOutputWithPast)} else "past_key_values"
)

# Kernels that want queries, keys and values of one width. Values are zero-padded to the key width and
# the output sliced back: exact, and it keeps the fused kernels (CPU sdpa leaves its fused path otherwise).
# flex_attention takes values narrower than queries/keys as they are. A single query token (decoding) skips the
# padding for sdpa too: its T x 1 scores cost nothing on the unfused path, the copy of the whole value cache does.
PAD_VALUES_FOR_IMPLEMENTATIONS = ("sdpa", "flash_attention_2", "flash_attention_3")
FLASH_MAX_HEAD_DIM = 256


# --------------------------------------------------------------------------------------------------
# The QK-MAP math
# --------------------------------------------------------------------------------------------------


def qkmap_native_frequencies(config: QKMapConfig) -> torch.Tensor:
    """Geometric grid from ``qkmap_min_frequency`` to ``qkmap_max_frequency`` over blocks and channels."""
    num_freq, m = config.qkmap_num_frequencies, config.qkmap_feature_dim_per_block
    per_block = config.qkmap_frequency_sharing == "head"
    count = num_freq if per_block else num_freq * m
    grid = torch.logspace(
        math.log10(config.qkmap_min_frequency), math.log10(config.qkmap_max_frequency), count, dtype=torch.float64
    )
    grid = grid.view(num_freq, 1 if per_block else m)
    return grid.unsqueeze(0).expand(config.num_key_value_heads, -1, -1).float()


class QKMapFeatureMap(nn.Module):
    """Frequencies and gains of one attention layer, owned by the key/value heads.

    Query heads of a GQA group share their key head's frequencies, so the logit depends on phase
    differences only; queries and keys have separate gains (like QK-Norm's separate weights).
    ``log_frequency`` stores ``log(omega)`` so up-training can travel from ``omega ~ 1e-3`` to ``~1``.
    """

    def __init__(self, config: QKMapConfig):
        super().__init__()
        self.config = config
        kv_heads, num_freq, m = (
            config.num_key_value_heads,
            config.qkmap_num_frequencies,
            config.qkmap_feature_dim_per_block,
        )
        freq_width = 1 if config.qkmap_frequency_sharing == "head" else m
        self.log_frequency = nn.Parameter(
            torch.zeros(kv_heads, num_freq, freq_width), requires_grad=config.qkmap_learnable_frequencies
        )
        self.query_gain = nn.Parameter(torch.ones(kv_heads, 2 * num_freq, m))
        self.key_gain = nn.Parameter(torch.ones(kv_heads, 2 * num_freq, m))
        self.inverse_frequency_gains = config.qkmap_gain_parametrization == "inverse_frequency"

    def frequency(self) -> torch.Tensor:
        """``omega`` in float32, ``(kv_heads, F, m or 1)``."""
        return self.log_frequency.float().exp()

    def effective_gain(self, gain: torch.Tensor, frequency: torch.Tensor) -> torch.Tensor:
        """Gain applied to the features; ``stored / omega`` under the inverse-frequency parametrization."""
        gain = gain.float()
        if self.inverse_frequency_gains:
            gain = gain / frequency.repeat_interleave(2, dim=1)
        return gain

    def forward(
        self, query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        frequency = self.frequency()
        rotate = self.config.qkmap_rotate_cos_blocks
        return (
            qkmap_features(query, frequency, self.effective_gain(self.query_gain, frequency), cos, sin, rotate),
            qkmap_features(key, frequency, self.effective_gain(self.key_gain, frequency), cos, sin, rotate),
        )

    @torch.no_grad()
    def initial_values(self) -> dict[str, torch.Tensor]:
        """Parameter values of the configured initialisation (``qkmap_init``)."""
        config, shape = self.config, self.log_frequency.shape
        if config.qkmap_init == "exact":
            omega = torch.full(shape, config.qkmap_exact_frequency)
            sine_gain = torch.ones(self.query_gain.shape)
            if not self.inverse_frequency_gains:
                sine_gain = sine_gain / omega.repeat_interleave(2, dim=1).expand_as(sine_gain)
            gain = torch.zeros_like(sine_gain)
            gain[:, 1] = sine_gain[:, 1]  # only the first sine block: a_sin sin(omega z) ~ z, the rest is zero
            return {"log_frequency": omega.log(), "query_gain": gain, "key_gain": gain.clone()}
        omega = qkmap_native_frequencies(config)
        gain = torch.ones(self.query_gain.shape)
        if self.inverse_frequency_gains:
            gain = gain * omega.repeat_interleave(2, dim=1).expand_as(gain)
        return {"log_frequency": omega.log(), "query_gain": gain, "key_gain": gain.clone()}

    def extra_repr(self) -> str:
        c = self.config
        return (
            f"num_frequencies={c.qkmap_num_frequencies}, input_dim={c.qkmap_feature_dim_per_block}, "
            f"sharing={c.qkmap_frequency_sharing}, gains={c.qkmap_gain_parametrization}"
        )


class QKMapInputRMSNorm(LlamaRMSNorm):
    """Per-head RMSNorm on ``z`` before the feature map (``qkmap_input_norm``), raised to a power ``beta``:
    ``weight * z / (rms(z)^beta * r^(1 - beta))`` with ``r`` a per-head reference scale.

    ``beta = 1`` (``qkmap_input_norm_power``) is Qwen3's ``q_norm``/``k_norm`` exactly, where a converted Qwen3
    starts (``r`` unused); ``beta = 0`` is the fixed per-channel scale ``weight / r``, which folds into the
    projection and leaves plain QK-MAP. Annealing ``beta`` from 1 to 0 heals the norm away.
    """

    def __init__(self, config: QKMapConfig, num_heads: int):
        super().__init__(config.projection_dim, eps=config.rms_norm_eps)
        self.config = config
        self.reference_scale = nn.Parameter(torch.ones(num_heads), requires_grad=False)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        power = self.config.qkmap_input_norm_power
        if power == 1:
            return super().forward(hidden_states)
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        reference = self.reference_scale.float().unsqueeze(-1)  # (heads, 1) against (..., heads, dim)
        scale = (variance + self.variance_epsilon).pow(-power / 2) * reference.pow(power - 1)
        return self.weight * (hidden_states * scale).to(input_dtype)


class QKMapAttention(nn.Module):
    """Llama attention whose queries and keys follow ``config.qk_mode``; values and output are Llama's."""

    def __init__(self, config: QKMapConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.qk_mode = config.qk_mode
        self.head_dim = config.head_dim
        self.projection_dim = config.projection_dim
        self.query_key_dim = config.query_key_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.attention_dropout = config.attention_dropout
        self.is_causal = True
        if self.qk_mode == "qk_map":
            self.scaling = config.qkmap_logit_scale or config.qkmap_feature_dim_per_block**-0.5
        else:
            self.scaling = self.head_dim**-0.5
        self.scaling = self.scaling * config.logit_scale_multiplier  # 1.0 leaves Llama's float unchanged

        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * self.projection_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.projection_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=bias)
        if self.qk_mode == "qk_norm":
            self.q_norm = LlamaRMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = LlamaRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        elif self.qk_mode == "qk_map":
            self.qk_map = QKMapFeatureMap(config)
            if config.qkmap_input_norm:
                self.q_norm = QKMapInputRMSNorm(config, config.num_attention_heads)
                self.k_norm = QKMapInputRMSNorm(config, config.num_key_value_heads)
        if config.qk_position_prior == "constant":
            self.position_prior = QKPositionPrior(config)

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        past_key_values: Cache | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        cache = cache if cache is not None else past_key_values
        input_shape = hidden_states.shape[:-1]
        query_states = self.q_proj(hidden_states).view(*input_shape, -1, self.projection_dim)
        key_states = self.k_proj(hidden_states).view(*input_shape, -1, self.projection_dim)
        value_states = self.v_proj(hidden_states).view(*input_shape, -1, self.head_dim).transpose(1, 2)
        if self.qk_mode == "qk_norm" or hasattr(self, "q_norm"):  # qk_norm mode, or qk_map's input norm
            query_states, key_states = self.q_norm(query_states), self.k_norm(key_states)
        query_states, key_states = query_states.transpose(1, 2), key_states.transpose(1, 2)

        cos, sin = position_embeddings
        if self.qk_mode == "qk_map":
            query_states, key_states = self.qk_map(query_states, key_states, cos, sin)
        else:
            query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
            if self.config.qk_position_prior == "constant":
                query_states, key_states = self.position_prior(query_states, key_states, cos, sin)

        if cache is not None:
            key_states, value_states = cache.update(key_states, value_states, self.layer_idx)

        implementation = self.config._attn_implementation or "eager"
        attention_interface = self.attention_kernel(implementation, query_states.shape[-2])
        value_for_kernel = self.pad_values_for_kernel(value_states, implementation, query_states.shape[-2])
        attn_output, attn_weights = attention_interface(
            self,
            query_states,
            key_states,
            value_for_kernel,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            **kwargs,
        )
        attn_output = attn_output[..., : self.head_dim]
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        return self.o_proj(attn_output), attn_weights

    def attention_kernel(self, implementation: str, query_length: int) -> Callable:
        """The configured kernel; for sdpa with one query token and keys wider than values, ``single_query_attention``."""
        if (
            implementation == "sdpa"
            and query_length == 1
            and self.query_key_dim != self.head_dim
            and not (self.training and self.attention_dropout > 0)
        ):
            return single_query_attention
        return ALL_ATTENTION_FUNCTIONS.get_interface(implementation, eager_attention_forward)

    def pad_values_for_kernel(
        self, value_states: torch.Tensor, implementation: str, query_length: int | None = None
    ) -> torch.Tensor:
        """Zero-pad values to the query/key width for kernels that want one width (see module constant)."""
        extra = self.query_key_dim - self.head_dim
        if extra <= 0 or not implementation.startswith(PAD_VALUES_FOR_IMPLEMENTATIONS):
            return value_states
        if query_length == 1 and implementation == "sdpa":
            return value_states
        if implementation.startswith("flash_attention") and self.query_key_dim > FLASH_MAX_HEAD_DIM:
            raise ValueError(
                f"attn_implementation={implementation!r} supports head widths up to {FLASH_MAX_HEAD_DIM}, but QK-MAP "
                f"queries/keys are {self.query_key_dim} wide (2 * qkmap_num_frequencies * qkmap_input_dim). Use "
                "attn_implementation='sdpa' or a smaller qkmap_input_dim (e.g. head_dim // (2 * F))."
            )
        return F.pad(value_states, (0, extra))


def single_query_attention(
    module: QKMapAttention,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention of one query token over the cache, with values narrower than keys (decoding, sdpa masks).

    sdpa would need values padded to the key width (a copy of the whole value cache per step) or take its
    unfused path (which rescales the whole key cache per step); here the scale hits the ``1 x T`` scores only,
    and GQA groups share their key head without repeating the cache. Returns ``(batch, 1, heads, d)`` as sdpa.
    """
    batch, heads, _, width = query.shape
    kv_heads = key.shape[1]
    grouped = query.view(batch, kv_heads, heads // kv_heads, width)
    scores = torch.matmul(grouped, key.transpose(-1, -2)) * scaling  # (batch, kv_heads, groups, T)
    if attention_mask is not None:
        mask = attention_mask[:, :, -1, : key.shape[-2]]  # (batch, 1 or heads, T)
        mask = mask.unsqueeze(2) if mask.shape[1] == 1 else mask.reshape(mask.shape[0], kv_heads, -1, mask.shape[-1])
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    probs = scores.softmax(dim=-1, dtype=torch.float32).to(value.dtype)
    output = torch.matmul(probs, value)  # (batch, kv_heads, groups, d)
    return output.view(batch, 1, heads, value.shape[-1]), None


# --------------------------------------------------------------------------------------------------
# Llama's layout around it
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
    _keep_in_fp32_modules = ["qk_map"]
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_flex_attn = True
    _can_compile_fullgraph = True
    _supports_attention_backend = True
    _can_record_outputs = {
        "hidden_states": QKMapDecoderLayer,
        "attentions": QKMapAttention,
    }

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if isinstance(module, QKMapFeatureMap):
            for name, value in module.initial_values().items():
                init.copy_(getattr(module, name), value)
        if isinstance(module, QKMapInputRMSNorm):
            init.ones_(module.reference_scale)
        elif isinstance(module, QKPositionPrior):
            init.ones_(module.query_prior)
            init.ones_(module.key_prior)


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
        self.post_init()

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
        rope_reference = hidden_states.new_empty(0, dtype=torch.float32) if self.config.qk_mode == "qk_map" else hidden_states
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


class QKMapForSequenceClassification(GenericForSequenceClassification, QKMapPreTrainedModel): ...


__all__ = [
    "QKMapAttention",
    "QKMapFeatureMap",
    "QKMapForCausalLM",
    "QKMapInputRMSNorm",
    "QKMapForSequenceClassification",
    "QKMapModel",
    "QKMapPreTrainedModel",
    "QKPositionPrior",
    "qkmap_features",
]
