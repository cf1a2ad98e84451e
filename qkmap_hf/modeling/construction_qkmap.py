# Copyright 2026 The qkmap-hf authors. Licensed under the Apache License, Version 2.0.
"""QK-MAP as query/key constructions: the feature map (the position stage of ``qk_mode="qk_map"``) and the optional
per-head input norm before it (``qkmap_input_norm``, how a QK-Norm source such as Qwen3 converts exactly).

The feature map's variants are registries of their own, keyed by config fields: ``gain_treatments.GAIN_TREATMENTS``
(``qkmap_gain_treatment``) and ``cos_blocks.COS_BLOCKS`` (``qkmap_cos_block``). The math with its recomputing
backward pass is in feature_map_qkmap.py. Copied into checkpoints: torch and transformers only.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from .cos_blocks import COS_BLOCKS
from .feature_map_qkmap import (
    one_token_query_key_features,
    qkmap_projected_query_key_features,
    stack_query_key_parameters,
)
from .gain_treatments import GAIN_TREATMENTS
from .query_key import QUERY_KEY_GROUP, QueryKeyConstruction


def qkmap_native_frequencies(config: Any) -> torch.Tensor:
    """Geometric grid from ``qkmap_min_frequency`` to ``qkmap_max_frequency`` over blocks and channels."""
    num_freq, m = config.qkmap_num_frequencies, config.resolved_qkmap_input_dim
    per_block = config.qkmap_frequency_sharing == "head"
    count = num_freq if per_block else num_freq * m
    grid = torch.logspace(
        math.log10(config.qkmap_min_frequency), math.log10(config.qkmap_max_frequency), count, dtype=torch.float64
    )
    grid = grid.view(num_freq, 1 if per_block else m)
    return grid.unsqueeze(0).expand(config.num_key_value_heads, -1, -1).float()


def is_plain_linear(module: nn.Module, inputs: torch.Tensor) -> bool:
    """Whether ``module`` is a plain ``nn.Linear`` without hooks in ``inputs``' dtype, outside autocast: what a node
    that calls ``F.linear`` with its weight in place of the module computes the same. A peft adapter, a quantized
    layer, a hook or autocast keeps the module's own call."""
    return (
        type(module) is nn.Linear
        and not (module._forward_hooks or module._forward_pre_hooks)
        and module.weight.dtype == inputs.dtype
        and not torch.is_autocast_enabled(inputs.device.type)
    )


class QKMapFeatureMap(nn.Module):
    """Frequencies and gains of one attention layer, owned by the key/value heads.

    Query heads of a GQA group share their key head's frequencies, so the logit depends on phase
    differences only; queries and keys have separate gains (like QK-Norm's separate weights).
    ``log_frequency`` stores ``log(omega)`` so up-training can travel from ``omega ~ 1e-3`` to ``~1``.
    """

    def __init__(self, config: Any):
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
        self.gain_treatment = GAIN_TREATMENTS[getattr(config, "qkmap_gain_treatment", "learned")]
        self.cos_blocks = COS_BLOCKS[getattr(config, "qkmap_cos_block", "phase")]
        self._decoding_parameters: tuple[tuple, tuple[torch.Tensor, torch.Tensor]] | None = None
        # Set by transformers' activation (gradient) checkpointing enable/disable, which sets it on every module that
        # has it: with ``every_n_layers > 1`` the layers it leaves unchecked keep the plain path (and ``z``) too.
        self.gradient_checkpointing = False
        self.reset_trainability()

    def reset_trainability(self) -> None:
        """Freeze what the config keeps fixed: omega (``qkmap_learnable_frequencies``), the gains (a treatment
        that does not train them). Run at construction and after loading, because transformers' loader makes every
        loaded float tensor trainable."""
        self.log_frequency.requires_grad_(self.config.qkmap_learnable_frequencies)
        self.query_gain.requires_grad_(self.gain_treatment.trainable)
        self.key_gain.requires_grad_(self.gain_treatment.trainable)

    def frequency(self) -> torch.Tensor:
        """``omega`` in float32, ``(kv_heads, F, m or 1)``."""
        log_frequency = self.log_frequency  # float32 already under _keep_in_fp32_modules: no call per token
        return (log_frequency if log_frequency.dtype == torch.float32 else log_frequency.float()).exp()

    def map_parameters(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``omega`` and the effective query and key gains: what every path of the map is given."""
        frequency = self.frequency()
        return frequency, self.effective_gain(self.query_gain, frequency), self.effective_gain(self.key_gain, frequency)

    def effective_gain(self, gain: torch.Tensor, frequency: torch.Tensor) -> torch.Tensor:
        """Gain applied to the features: ``stored / omega`` under the inverse-frequency parametrization, then as the
        gain treatment has it (``normalized``: each row at RMS 1)."""
        gain = gain if gain.dtype == torch.float32 else gain.float()
        if self.inverse_frequency_gains:
            gain = gain / frequency.repeat_interleave(2, dim=1)
        return self.gain_treatment.effective(gain)

    def forward(
        self, query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        rotate = self.config.qkmap_rotate_cos_blocks
        if query.shape[-2] == 1 and self.cos_blocks.stacks_decoding and self.parameters_are_constant(query):
            stacked = self.decoding_parameters(query.shape[1] // key.shape[1])
            return one_token_query_key_features(query, key, *stacked, cos, sin, rotate, self.fuses())
        parameters = self.map_parameters()
        return self.cos_blocks.features(rotate, query, key, *parameters, cos, sin, self.compiles(), self.fuses())

    def project(
        self, q_proj: nn.Module, k_proj: nn.Module, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The projections and the map in one node that recomputes ``z`` in the backward pass instead of keeping it
        (``qkmap_recompute_projections``), or None where that node does not apply (``recomputes_projections``)."""
        if not self.recomputes_projections(q_proj, k_proj, hidden_states):
            return None
        return qkmap_projected_query_key_features(
            hidden_states, q_proj.weight, q_proj.bias, k_proj.weight, k_proj.bias, *self.map_parameters(), cos, sin,
            self.config.qkmap_rotate_cos_blocks, self.compiles(), self.fuses(),
        )  # fmt: skip

    def compiles(self) -> bool:
        """Whether the map runs as compiled expressions (``qkmap_compile_feature_map``; a config saved before the
        field existed has it off)."""
        return getattr(self.config, "qkmap_compile_feature_map", False)

    def fuses(self) -> bool:
        """Whether the map runs the fused CPU kernel where it is loaded (``qkmap_fused_feature_map``; a config saved
        before the field existed has the field's default)."""
        return getattr(self.config, "qkmap_fused_feature_map", True)

    def recomputes_projections(self, q_proj: nn.Module, k_proj: nn.Module, hidden_states: torch.Tensor) -> bool:
        """Whether a training forward pass maps ``q_proj``/``k_proj``'s outputs in one recomputing node: asked for
        (``resolved_qkmap_recompute_projections``), gradients on, no gradient checkpointing, the default cos blocks,
        no hooks on this module (``PhaseRecorder`` reads ``z`` with one), and projections that are plain
        ``nn.Linear`` layers without hooks in the input's dtype, outside autocast. A peft adapter, a quantized layer
        or a hook sees its module called as usual; the values are the same either way."""
        if not (getattr(self.config, "resolved_qkmap_recompute_projections", False) and torch.is_grad_enabled()):
            return False
        if self.gradient_checkpointing and self.training:  # the layer keeps only its input: nothing left to save
            return False
        if self.cos_blocks.name != "phase":
            return False
        if self._forward_hooks or self._forward_pre_hooks:
            return False
        return all(is_plain_linear(p, hidden_states) for p in (q_proj, k_proj))

    @staticmethod
    def parameters_are_constant(query: torch.Tensor) -> bool:
        """No gradients, no compilation, no CUDA graph capture: what the parameters imply may be kept between calls
        (a tensor made while capturing lives in the graph's memory pool)."""
        if torch.is_grad_enabled() or torch.compiler.is_compiling():
            return False
        return not (query.is_cuda and torch.cuda.is_current_stream_capturing())

    def decoding_parameters(self, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``stack_query_key_parameters`` of omega and the effective gains, kept between decoded tokens.

        Computing them is ~5 small ops per layer and token (more under GQA) that only change when the parameters
        do; they are recomputed when a parameter object, its version counter (every in-place update, ``copy_``, an
        optimizer step), storage, dtype or device changes. A write through ``parameter.data`` bypasses the version
        counter: call ``forget_decoding_parameters`` after one.
        """
        parameters = (self.log_frequency, self.query_gain, self.key_gain)
        key = (groups, *((id(p), p._version, p.data_ptr(), p.dtype, p.device) for p in parameters))
        if self._decoding_parameters is None or self._decoding_parameters[0] != key:
            self._decoding_parameters = (key, stack_query_key_parameters(*self.map_parameters(), groups))
        return self._decoding_parameters[1]

    def forget_decoding_parameters(self) -> None:
        self._decoding_parameters = None

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

    def __init__(self, config: Any, num_heads: int):
        super().__init__(config.projection_dim, eps=config.rms_norm_eps)
        self.config = config
        self.reference_scale = nn.Parameter(torch.ones(num_heads))
        self.reset_trainability()

    def reset_trainability(self) -> None:
        """``r`` is calibrated, never trained (see ``QKMapFeatureMap.reset_trainability`` for why this runs twice)."""
        self.reference_scale.requires_grad_(False)

    @torch.no_grad()
    def initial_values(self) -> dict[str, torch.Tensor]:
        return {"weight": torch.ones_like(self.weight), "reference_scale": torch.ones_like(self.reference_scale)}

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


def qkmap_gain_bound(query_gain: torch.Tensor, key_gain: torch.Tensor) -> torch.Tensor:
    """Per key/value head, ``sqrt(sum max(a_cos^2, a_sin^2))`` of the query gains times the same of the key gains.

    ``||phi(z)||^2 = sum_j a_cos,j^2 cos^2(omega_j z_j) + a_sin,j^2 sin^2(omega_j z_j) <= sum_j max(a_cos,j^2,
    a_sin,j^2)`` whatever ``z`` is, RoPE keeps norms, and Cauchy-Schwarz bounds the product of two features: times
    the logit scale this bounds every logit of the head. Gains are effective gains ``(kv_heads, 2F, m)``.
    """

    def side(gain: torch.Tensor) -> torch.Tensor:
        rows = gain.detach().float().unflatten(1, (-1, 2))  # (kv_heads, F, 2, m)
        return rows.square().amax(dim=2).sum(dim=(1, 2)).sqrt()

    return side(query_gain) * side(key_gain)


class QKMapFeatures(QueryKeyConstruction):
    """The QK-MAP feature map with block-wise RoPE (``qk_mode="qk_map"``): keys ``2 F m`` wide."""

    name = "qk_map"
    stage = "position"
    modules = ("qk_map",)
    float32_modules = ("qk_map",)
    float32_positions = True  # the feature blocks are rotated in float32

    @classmethod
    def applies_to(cls, config: Any) -> bool:
        return getattr(config, "qk_mode", "standard") == "qk_map"

    @classmethod
    def build(cls, config: Any) -> dict[str, nn.Module]:
        return {"qk_map": QKMapFeatureMap(config)}

    @classmethod
    def apply(cls, attention, query, key, cos, sin):
        return attention.qk_map(query, key, cos, sin)

    @classmethod
    def project(cls, attention, hidden_states, cos, sin):
        return attention.qk_map.project(attention.q_proj, attention.k_proj, hidden_states, cos, sin)

    @classmethod
    def width(cls, config: Any, width: int) -> int:
        return 2 * config.qkmap_num_frequencies * config.resolved_qkmap_input_dim

    @classmethod
    def projection_dim(cls, config: Any) -> int:
        return config.resolved_qkmap_input_dim

    @classmethod
    def logit_scale(cls, config: Any) -> float:
        return config.qkmap_logit_scale or config.resolved_qkmap_input_dim**-0.5

    @classmethod
    def parameter_group(cls, config: Any, module_name: str, parameter_name: str) -> str | None:
        if parameter_name.endswith("_gain"):
            treatment = GAIN_TREATMENTS[getattr(config, "qkmap_gain_treatment", "learned")]
            return "decay" if treatment.trained_like_weights else QUERY_KEY_GROUP
        return QUERY_KEY_GROUP

    @classmethod
    def created_tensors(cls, config: Any) -> dict[str, torch.Tensor]:
        return {f"qk_map.{name}": value.float() for name, value in QKMapFeatureMap(config).initial_values().items()}

    @classmethod
    def statistics(cls, attention: nn.Module, scaling: float) -> dict[str, float]:
        frequency, query_gain, key_gain = (tensor.detach() for tensor in attention.qk_map.map_parameters())
        return {
            "logit_bound": float(scaling * qkmap_gain_bound(query_gain, key_gain).max()),
            "query_gain_norm": float(query_gain.flatten(1).norm(dim=-1).max()),
            "key_gain_norm": float(key_gain.flatten(1).norm(dim=-1).max()),
            "frequency_min": float(frequency.min()),
            "frequency_max": float(frequency.max()),
        }


class QKMapInputNorm(QueryKeyConstruction):
    """The per-head input norm before the feature map (``qkmap_input_norm``): Qwen3's ``q_norm``/``k_norm``."""

    name = "qkmap_input_norm"
    stage = "input"
    modules = ("q_norm", "k_norm")

    @classmethod
    def applies_to(cls, config: Any) -> bool:
        return getattr(config, "qk_mode", "standard") == "qk_map" and bool(getattr(config, "qkmap_input_norm", False))

    @classmethod
    def build(cls, config: Any) -> dict[str, nn.Module]:
        return {
            "q_norm": QKMapInputRMSNorm(config, config.num_attention_heads),
            "k_norm": QKMapInputRMSNorm(config, config.num_key_value_heads),
        }

    @classmethod
    def apply(cls, attention, query, key, cos, sin):
        return attention.q_norm(query), attention.k_norm(key)

    @classmethod
    def parameter_group(cls, config: Any, module_name: str, parameter_name: str) -> str | None:
        return None  # a norm's weight (the reference scale never trains)

    @classmethod
    def created_tensors(cls, config: Any) -> dict[str, torch.Tensor]:
        """The reference scales (calibrated later, ``calibrate_reference_scale``); the weights come from the source."""
        return {
            "q_norm.reference_scale": torch.ones(config.num_attention_heads),
            "k_norm.reference_scale": torch.ones(config.num_key_value_heads),
        }


__all__ = [
    "QKMapFeatureMap",
    "QKMapFeatures",
    "QKMapInputNorm",
    "QKMapInputRMSNorm",
    "qkmap_gain_bound",
    "qkmap_native_frequencies",
]
