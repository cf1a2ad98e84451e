# Copyright 2026 The qkmap-hf authors. Licensed under the Apache License, Version 2.0.
"""``QKMapAttention``: Llama's attention running the query/key constructions its config selects, and its kernels.

The constructions (QK-Norm, QK-MAP's feature map and input norm, the position prior) are units of their own
(query_key.py, construction_qkmap.py, position_prior.py) chosen by qk_registry.py; modeling_qkmap.py keeps Llama's
decoder layout around this module. Copied into every checkpoint next to modeling_qkmap.py (it imports it
relatively): torch and transformers only.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F
from transformers.cache_utils import Cache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import eager_attention_forward

from .configuration_qkmap import QKMapConfig
from .construction_qkmap import QKMapFeatureMap, QKMapInputRMSNorm, is_plain_linear, qkmap_native_frequencies
from .feature_map_qkmap import FusedOps
from .qk_registry import constructions_for, position_construction

# Kernels that want queries, keys and values of one width. Values are zero-padded to the key width and
# the output sliced back: exact, and it keeps the fused kernels (CPU sdpa leaves its fused path otherwise). On CPUs
# the fused attention below (``FUSED_ATTENTION_OPS``) takes sdpa's plain causal calls without padding.
# vLLM's attention ("vllm", its Transformers backend) keeps one head size for keys and values on CPU (and its own
# padding needs contiguous values). flex_attention takes values narrower than queries/keys as they are. A single
# query token (decoding) skips the padding for sdpa too: its T x 1 scores cost nothing on the unfused path, the copy
# of the whole value cache does.
PAD_VALUES_FOR_IMPLEMENTATIONS = ("sdpa", "flash_attention_2", "flash_attention_3", "vllm")
FLASH_MAX_HEAD_DIM = 256
# Causal attention for keys wider than values on CPUs (qkmap_hf/kernels/attention_cpu.cpp), looked up in torch.ops as
# the feature map's kernel is: where it is loaded and takes the call (``QKMapAttention.runs_fused_attention``), the
# values keep their width; elsewhere sdpa runs with values padded.
FUSED_ATTENTION_OPS = FusedOps(("causal_attention", "causal_attention_backward"))


class QKMapAttention(nn.Module):
    """Llama attention whose queries and keys are built by the constructions ``config`` selects
    (``qk_registry.constructions_for``); values and output are Llama's."""

    def __init__(self, config: QKMapConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.qk_mode = config.qk_mode
        # Model surgery that changes the config in place (``fold_input_norm``) sets this again.
        self.qk_constructions = constructions_for(config)
        self.head_dim = config.head_dim
        self.projection_dim = config.projection_dim
        self.query_key_dim = config.query_key_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.attention_dropout = config.attention_dropout
        self.is_causal = True
        # logit_scale_multiplier 1.0 leaves Llama's float unchanged
        self.scaling = position_construction(config).logit_scale(config) * config.logit_scale_multiplier

        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * self.projection_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.projection_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=bias)
        for construction in self.qk_constructions:
            for name, module in construction.build(config).items():
                self.add_module(name, module)

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
        cos, sin = position_embeddings
        stages = self.qk_constructions
        # The position stage may build queries and keys from the layer input itself (QK-MAP's recomputing node).
        projected = None if stages[0].stage == "input" else stages[0].project(self, hidden_states, cos, sin)
        if projected is None:
            query_states = self.q_proj(hidden_states).view(*input_shape, -1, self.projection_dim)
            key_states = self.k_proj(hidden_states).view(*input_shape, -1, self.projection_dim)
        else:
            (query_states, key_states), stages = projected, stages[1:]
        value_states = self.v_proj(hidden_states).view(*input_shape, -1, self.head_dim).transpose(1, 2)
        transposed = projected is not None
        for construction in stages:  # input stage on (batch, seq, heads, width), the rest transposed
            if construction.stage != "input" and not transposed:
                query_states, key_states, transposed = query_states.transpose(1, 2), key_states.transpose(1, 2), True
            query_states, key_states = construction.apply(self, query_states, key_states, cos, sin)

        paged = is_paged_cache(cache)
        if paged:  # the paged cache keeps keys and values at one width (the key width): pad values before storing
            value_states = self.pad_values_to_key_width(value_states)
        if cache is not None:
            key_states, value_states = update_cache(cache, key_states, value_states, self.layer_idx, kwargs)

        implementation = self.config._attn_implementation or "eager"
        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(implementation, eager_attention_forward)
        if self.decodes_one_query_over_wider_keys(implementation, query_states.shape[-2], paged):
            attention_interface = single_query_attention
        elif self.runs_fused_attention(implementation, query_states, key_states, attention_mask, kwargs):
            attention_interface = fused_causal_attention
        if not paged and attention_interface is not fused_causal_attention:
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
        heads = attn_output[..., : self.head_dim]
        if heads.shape[-1] < attn_output.shape[-1] and self.projects_padded_output(implementation, heads):
            return padded_output_projection(heads, self.o_proj.weight, self.o_proj.bias), attn_weights
        return self.o_proj(heads.reshape(*input_shape, -1).contiguous()), attn_weights

    def projects_padded_output(self, implementation: str, heads: torch.Tensor) -> bool:
        """Whether ``o_proj`` of the kernel's padded output runs as ``PaddedOutputProjection``: where sdpa's fused
        kernels keep that output for their own backward pass, i.e. gradients flow into the kernel (``heads``
        requires grad) and no dropout (with it sdpa takes its math path, which keeps no output), and a plain
        ``o_proj`` (``is_plain_linear``). Elsewhere the view would keep the wider output alive for nothing."""
        if implementation != "sdpa" or not (torch.is_grad_enabled() and heads.requires_grad):
            return False
        if self.drops_attention():
            return False
        return is_plain_linear(self.o_proj, heads)

    def drops_attention(self) -> bool:
        """Whether this call applies attention dropout (training with a rate above 0): the kernels' special paths
        (the padded-output view, the one-query path, the fused attention) take no dropout and leave it to sdpa."""
        return self.training and self.attention_dropout > 0

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
            and not self.drops_attention()
        )

    def runs_fused_attention(
        self,
        implementation: str,
        query: torch.Tensor,
        key: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        kwargs: dict | None = None,
    ) -> bool:
        """Whether sdpa's call runs ``fused_causal_attention`` instead (values at their own width): keys wider than
        values, the kernel asked for (``qkmap_fused_attention``) and loaded, float32 CPU tensors, plain causal
        attention (no mask tensor, as many queries as keys, more than one), no dropout, not under torch.compile."""
        return (
            implementation == "sdpa"
            and getattr(self.config, "qkmap_fused_attention", True)
            and self.query_key_dim > self.head_dim
            and attention_mask is None
            and (kwargs or {}).get("is_causal", True)
            and 1 < query.shape[-2] == key.shape[-2]
            and query.device.type == key.device.type == "cpu"
            and query.dtype == key.dtype == torch.float32
            and not self.drops_attention()
            and not torch.compiler.is_compiling()
            and FUSED_ATTENTION_OPS() is not None
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


class PaddedOutputProjection(torch.autograd.Function):
    """``o_proj`` of the heads' outputs when they are views into the kernel's wider, padded output.

    With values padded to the key width, each head's output is the first ``head_dim`` columns of the kernel's
    output. The plain path copies them into a contiguous ``(batch, seq, heads * head_dim)`` tensor, and ``o_proj``
    keeps that copy for its weight's gradient: a second activation of the layer's width next to the padded output
    that the fused kernel keeps anyway. This node keeps the view instead (no storage of its own) and makes the copy
    again in the backward pass. Values are the plain path's bit for bit; gradients the same matmuls.
    """

    @staticmethod
    def forward(ctx, heads: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(heads, weight)  # ctx in forward: see feature_map_qkmap (no setup_context binding cost)
        return F.linear(heads.reshape(*heads.shape[:-2], -1), weight, bias)

    @staticmethod
    def backward(ctx, grad_output):
        heads, weight = ctx.saved_tensors
        need_heads, need_weight, need_bias = ctx.needs_input_grad
        rows = grad_output.reshape(-1, weight.shape[0])
        grad_heads = grad_output.matmul(weight).view(heads.shape) if need_heads else None
        grad_weight = rows.t().mm(heads.reshape(rows.shape[0], -1)) if need_weight else None
        grad_bias = rows.sum(dim=0) if need_bias else None
        return grad_heads, grad_weight, grad_bias


def padded_output_projection(heads: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(heads.reshape(..., -1), weight, bias)`` keeping ``heads`` (a strided view) for the backward pass
    instead of its contiguous copy (``PaddedOutputProjection``)."""
    return PaddedOutputProjection.apply(heads, weight, bias)


class FusedCausalAttention(torch.autograd.Function):
    """``qkmap_v1.causal_attention`` and its backward pass: flash attention with values narrower than keys. Saves
    what sdpa's flash kernel saves (queries, keys, values, output, log-sum-exp), values and output at their own
    width."""

    @staticmethod
    def forward(ctx, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
        output, logsumexp = FUSED_ATTENTION_OPS().causal_attention(query, key, value, scale)
        ctx.save_for_backward(query, key, value, output, logsumexp)
        ctx.scale = scale
        return output

    @staticmethod
    def backward(ctx, grad_output):
        query, key, value, output, logsumexp = ctx.saved_tensors
        ops = FUSED_ATTENTION_OPS()
        grads = ops.causal_attention_backward(grad_output, query, key, value, output, logsumexp, ctx.scale)
        return (*grads, None)


def fused_causal_attention(
    module: QKMapAttention,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Causal attention of ``(batch, heads, T, Dk)`` queries over keys as wide and values narrower, by the CPU
    kernel (``runs_fused_attention`` says where). Returns ``(batch, T, heads, Dv)`` as sdpa's interface does."""
    if torch.is_grad_enabled() and any(tensor.requires_grad for tensor in (query, key, value)):
        return FusedCausalAttention.apply(query, key, value, scaling), None
    return FUSED_ATTENTION_OPS().causal_attention(query, key, value, scaling)[0], None


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
    kv_heads, length = key.shape[1], key.shape[-2]
    # bmm on 3-D views: ``matmul`` of the 4-D tensors dispatches expands and reshapes around its bmm (per layer
    # and token, where dispatch is the cost); the cache is contiguous, so its reshapes are views (the query of a
    # batch is a slice of the stacked query/key features: a copy of one token's rows).
    grouped = query.reshape(batch * kv_heads, heads // kv_heads, width)
    keys = key.reshape(batch * kv_heads, length, width).transpose(1, 2)
    scores = (torch.bmm(grouped, keys) * scaling).view(batch, kv_heads, -1, length)  # (batch, kv_heads, groups, T)
    if attention_mask is not None:
        mask = attention_mask[:, :, -1, :length]  # (batch, 1 or heads, T)
        mask = mask.unsqueeze(2) if mask.shape[1] == 1 else mask.reshape(mask.shape[0], kv_heads, -1, mask.shape[-1])
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    probs = scores.softmax(dim=-1, dtype=torch.float32).to(value.dtype)
    values = value.reshape(batch * kv_heads, length, value.shape[-1])
    output = torch.bmm(probs.view(batch * kv_heads, -1, length), values)  # (batch * kv_heads, groups, d)
    return output.view(batch, 1, heads, value.shape[-1]), None


__all__ = [
    "FLASH_MAX_HEAD_DIM",
    "FUSED_ATTENTION_OPS",
    "FusedCausalAttention",
    "PAD_VALUES_FOR_IMPLEMENTATIONS",
    "PaddedOutputProjection",
    "QKMapAttention",
    "QKMapFeatureMap",
    "QKMapInputRMSNorm",
    "qkmap_native_frequencies",
    "is_paged_cache",
    "padded_output_projection",
    "fused_causal_attention",
    "single_query_attention",
    "update_cache",
]
