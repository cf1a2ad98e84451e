# Copyright 2026 The qkmap-hf authors. Licensed under the Apache License, Version 2.0.
"""QK-MAP attention: the feature-map module, the optional input norm, and ``QKMapAttention`` with its kernels.

Everything that differs from Llama's attention lives here; modeling_qkmap.py keeps Llama's decoder layout around
it. Copied into every checkpoint next to modeling_qkmap.py (it imports it relatively): torch and transformers only.
The feature map itself, with its recomputing backward pass, is in feature_map_qkmap.py.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F
from transformers.cache_utils import Cache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb, eager_attention_forward

from .configuration_qkmap import QKMapConfig
from .feature_map_qkmap import qkmap_query_key_features
from .position_prior import QKPositionPrior

# Kernels that want queries, keys and values of one width. Values are zero-padded to the key width and
# the output sliced back: exact, and it keeps the fused kernels (CPU sdpa leaves its fused path otherwise).
# vLLM's attention ("vllm", its Transformers backend) keeps one head size for keys and values on CPU (and its own
# padding needs contiguous values). flex_attention takes values narrower than queries/keys as they are. A single
# query token (decoding) skips the padding for sdpa too: its T x 1 scores cost nothing on the unfused path, the copy
# of the whole value cache does.
PAD_VALUES_FOR_IMPLEMENTATIONS = ("sdpa", "flash_attention_2", "flash_attention_3", "vllm")
FLASH_MAX_HEAD_DIM = 256
# Added to the mean square of a gain row before it is normalized (qkmap_gain_treatment="normalized"): keeps an
# all-zero row at zero instead of NaN, and is far below the unit RMS the native init starts from.
GAIN_NORMALIZATION_EPS = 1e-12


# --------------------------------------------------------------------------------------------------
# The QK-MAP math
# --------------------------------------------------------------------------------------------------


def qkmap_native_frequencies(config: QKMapConfig) -> torch.Tensor:
    """Geometric grid from ``qkmap_min_frequency`` to ``qkmap_max_frequency`` over blocks and channels."""
    num_freq, m = config.qkmap_num_frequencies, config.resolved_qkmap_input_dim
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
            config.resolved_qkmap_input_dim,
        )
        freq_width = 1 if config.qkmap_frequency_sharing == "head" else m
        self.log_frequency = nn.Parameter(torch.zeros(kv_heads, num_freq, freq_width))
        self.query_gain = nn.Parameter(torch.ones(kv_heads, 2 * num_freq, m))
        self.key_gain = nn.Parameter(torch.ones(kv_heads, 2 * num_freq, m))
        self.inverse_frequency_gains = config.qkmap_gain_parametrization == "inverse_frequency"
        self.normalized_gains = getattr(config, "qkmap_gain_treatment", "learned") == "normalized"
        self.constant_cos_blocks = getattr(config, "qkmap_cos_block", "phase") == "constant"
        self.reset_trainability()

    def reset_trainability(self) -> None:
        """Freeze what the config keeps fixed: omega (``qkmap_learnable_frequencies``), the gains
        (``qkmap_gain_treatment="frozen"``). Run at construction and after loading, because transformers' loader
        makes every loaded float tensor trainable."""
        self.log_frequency.requires_grad_(self.config.qkmap_learnable_frequencies)
        gains_train = getattr(self.config, "qkmap_gain_treatment", "learned") != "frozen"
        self.query_gain.requires_grad_(gains_train)
        self.key_gain.requires_grad_(gains_train)

    def frequency(self) -> torch.Tensor:
        """``omega`` in float32, ``(kv_heads, F, m or 1)``."""
        log_frequency = self.log_frequency  # float32 already under _keep_in_fp32_modules: no call per token
        return (log_frequency if log_frequency.dtype == torch.float32 else log_frequency.float()).exp()

    def effective_gain(self, gain: torch.Tensor, frequency: torch.Tensor) -> torch.Tensor:
        """Gain applied to the features: ``stored / omega`` under the inverse-frequency parametrization; each row
        rescaled to RMS 1 under ``qkmap_gain_treatment="normalized"`` (a bound on the logits that training cannot
        move)."""
        gain = gain if gain.dtype == torch.float32 else gain.float()
        if self.inverse_frequency_gains:
            gain = gain / frequency.repeat_interleave(2, dim=1)
        if self.normalized_gains:
            gain = gain * torch.rsqrt(gain.square().mean(dim=-1, keepdim=True) + GAIN_NORMALIZATION_EPS)
        return gain

    def forward(
        self, query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        frequency = self.frequency()
        rotate = self.config.qkmap_rotate_cos_blocks
        query_gain, key_gain = (
            self.effective_gain(self.query_gain, frequency),
            self.effective_gain(self.key_gain, frequency),
        )
        if not self.constant_cos_blocks:
            return qkmap_query_key_features(query, key, frequency, query_gain, key_gain, cos, sin, rotate)
        sine_rows = self.sine_rows(query_gain)
        query_features, key_features = qkmap_query_key_features(
            query, key, frequency, query_gain * sine_rows, key_gain * sine_rows, cos, sin, rotate
        )
        groups = query.shape[1] // key.shape[1]
        return (
            query_features + self.constant_cos_features(query_gain, cos, sin, groups).to(query_features.dtype),
            key_features + self.constant_cos_features(key_gain, cos, sin, 1).to(key_features.dtype),
        )

    @staticmethod
    def sine_rows(gain: torch.Tensor) -> torch.Tensor:
        """1 on the sine rows, 0 on the cos rows, shaped to multiply ``(kv_heads, 2F, m)`` gains (no buffer: a
        non-persistent buffer would not survive loading on the meta device)."""
        return torch.arange(gain.shape[1], device=gain.device).remainder(2).to(gain.dtype)[None, :, None]

    def constant_cos_features(self, gain: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, groups: int):
        """``qkmap_cos_block="constant"``: the cos rows as the constant ``a_cos`` (``cos(omega z)`` replaced by 1),
        RoPE-rotated when the cos blocks are, zero in the sine rows; ``(batch or 1, heads, seq, 2F*m)``."""
        rows = gain * (1 - self.sine_rows(gain))  # (kv_heads, 2F, m): the cos rows only
        rows = rows.repeat_interleave(groups, dim=0)[None, :, None]  # (1, heads, 1, 2F, m)
        if self.config.qkmap_rotate_cos_blocks:
            table_cos, table_sin = cos.float()[:, None, :, None], sin.float()[:, None, :, None]  # (b, 1, seq, 1, m)
            half = rows.shape[-1] // 2
            rotated_half = torch.cat((-rows[..., half:], rows[..., :half]), dim=-1)
            rows = rows * table_cos + rotated_half * table_sin
        else:
            rows = rows.expand(-1, -1, cos.shape[1], -1, -1)
        return rows.flatten(-2)

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
            f"num_frequencies={c.qkmap_num_frequencies}, input_dim={c.resolved_qkmap_input_dim}, "
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
        self.reference_scale = nn.Parameter(torch.ones(num_heads))
        self.reset_trainability()

    def reset_trainability(self) -> None:
        """``r`` is calibrated, never trained (see ``QKMapFeatureMap.reset_trainability`` for why this runs twice)."""
        self.reference_scale.requires_grad_(False)

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
            self.scaling = config.qkmap_logit_scale or config.resolved_qkmap_input_dim**-0.5
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

        paged = is_paged_cache(cache)
        if paged:  # the paged cache keeps keys and values at one width (the key width): pad values before storing
            value_states = self.pad_values_to_key_width(value_states)
        if cache is not None:
            key_states, value_states = update_cache(cache, key_states, value_states, self.layer_idx, kwargs)

        implementation = self.config._attn_implementation or "eager"
        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(implementation, eager_attention_forward)
        if self.decodes_one_query_over_wider_keys(implementation, query_states.shape[-2], paged):
            attention_interface = single_query_attention
        if not paged:
            value_states = self.pad_values_for_kernel(value_states, implementation, query_states.shape[-2])
        attn_output, attn_weights = attention_interface(
            self,
            query_states,
            key_states,
            value_states,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            **kwargs,
        )
        # Kernels return (..., heads, width) or, in vLLM, (tokens, heads * width): split off the heads, keep the
        # values' head_dim of each (the rest is the zero padding of the values, if any).
        attn_output = attn_output.reshape(*input_shape, -1, attn_output.shape[-1] // self.num_heads_out(attn_output))
        attn_output = attn_output[..., : self.head_dim].reshape(*input_shape, -1).contiguous()
        return self.o_proj(attn_output), attn_weights

    def num_heads_out(self, attn_output: torch.Tensor) -> int:
        """Heads in a kernel's output: the last dim holds one head (``(..., heads, width)``) unless it holds all of
        them flattened (vLLM's ``(tokens, heads * width)``)."""
        return self.config.num_attention_heads if attn_output.dim() == 2 else 1

    def decodes_one_query_over_wider_keys(self, implementation: str, query_length: int, paged: bool = False) -> bool:
        """sdpa, one query token, keys wider than values, values not padded in the cache: ``single_query_attention``."""
        return (
            implementation == "sdpa"
            and query_length == 1
            and not paged
            and self.query_key_dim != self.head_dim
            and not (self.training and self.attention_dropout > 0)
        )

    def pad_values_to_key_width(self, value_states: torch.Tensor) -> torch.Tensor:
        """Values zero-padded to the query/key width (exact: the padded output columns are sliced off)."""
        extra = self.query_key_dim - self.head_dim
        return F.pad(value_states, (0, extra)) if extra > 0 else value_states

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
        return self.pad_values_to_key_width(value_states)


_UPDATE_TAKES_KWARGS: dict[type, bool] = {}


def is_paged_cache(cache: Cache | None) -> bool:
    """The paged cache of transformers' continuous batching (``generate_batch``, ``transformers serve``)."""
    return cache is not None and type(cache).__name__ == "PagedAttentionCache"


def update_cache(
    cache: Cache, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, kwargs: dict
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cache.update`` as the installed transformers calls it: newer caches take the layer's kwargs (the paged
    cache of continuous batching reads its read/write indices there and needs them), older ones do not."""
    takes_kwargs = _UPDATE_TAKES_KWARGS.get(type(cache))
    if takes_kwargs is None:
        takes_kwargs = "kwargs" in inspect.signature(type(cache).update).parameters
        _UPDATE_TAKES_KWARGS[type(cache)] = takes_kwargs
    if takes_kwargs:
        return cache.update(key_states, value_states, layer_idx, kwargs=kwargs)
    return cache.update(key_states, value_states, layer_idx)


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


__all__ = [
    "FLASH_MAX_HEAD_DIM",
    "PAD_VALUES_FOR_IMPLEMENTATIONS",
    "QKMapAttention",
    "QKMapFeatureMap",
    "QKMapInputRMSNorm",
    "qkmap_native_frequencies",
    "is_paged_cache",
    "single_query_attention",
    "update_cache",
]
