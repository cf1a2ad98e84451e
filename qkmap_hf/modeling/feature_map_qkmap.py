# Copyright 2026 The qkmap-hf authors. Licensed under the Apache License, Version 2.0.
"""The QK-MAP feature map ``phi`` of docs/method.md, with a backward pass that recomputes instead of storing.

Copied into every checkpoint next to modeling_qkmap.py (it imports only torch). Plain autograd over the
elementwise chain keeps phases, cos, sin and the gained features of every query and key for the backward
pass: about five times the bytes of ``z``. ``QKMapFeatureFunction`` keeps ``z`` and the small parameter
tensors only and recomputes cos/sin in the backward pass; its gradients are autograd's up to float rounding
(tests/test_feature_map.py checks them against autograd of the written-out formula).
"""

from __future__ import annotations

import torch


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Llama's RoPE on the last dimension: ``x * cos + rotate_half(x) * sin``, written on the two halves."""
    x1, x2 = x.chunk(2, dim=-1)
    cos1, cos2 = cos.chunk(2, dim=-1)
    sin1, sin2 = sin.chunk(2, dim=-1)
    return torch.cat((x1 * cos1 - x2 * sin1, x2 * cos2 + x1 * sin2), dim=-1)


def _rotate_transposed(grad: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The adjoint of ``_rotate`` (its gradient with respect to ``x``)."""
    g1, g2 = grad.chunk(2, dim=-1)
    cos1, cos2 = cos.chunk(2, dim=-1)
    sin1, sin2 = sin.chunk(2, dim=-1)
    return torch.cat((g1 * cos1 + g2 * sin2, g2 * cos2 - g1 * sin1), dim=-1)


def _rotate_blocks(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotate_cos_blocks: bool, adjoint: bool):
    """RoPE (or its adjoint) per block of ``x`` shaped ``(..., F, 2, m)``; cos blocks (index 0) only if asked."""
    rotate = _rotate_transposed if adjoint else _rotate
    if rotate_cos_blocks:
        return rotate(x, cos, sin)
    return torch.cat((x[..., :1, :], rotate(x[..., 1:, :], cos, sin)), dim=-2)


class _Layout:
    """Views of the inputs that broadcast to ``(batch, kv_heads, groups, seq, F, 2, m)`` in the compute dtype."""

    def __init__(self, z: torch.Tensor, frequency: torch.Tensor, gain: torch.Tensor, cos: torch.Tensor):
        self.batch, self.heads, self.seq, self.m = z.shape
        self.kv_heads, self.num_freq, self.freq_width = frequency.shape
        self.groups = self.heads // self.kv_heads
        # float32 at least (docs/method.md: a bf16 phase of magnitude 100 is off by 0.5 rad); float64 stays.
        self.dtype = torch.promote_types(z.dtype, torch.float32)
        self.table_batch = cos.shape[0]

    def z(self, z: torch.Tensor) -> torch.Tensor:
        return z.to(self.dtype).view(self.batch, self.kv_heads, self.groups, self.seq, 1, self.m)

    def frequency(self, frequency: torch.Tensor) -> torch.Tensor:
        return frequency.to(self.dtype).view(1, self.kv_heads, 1, 1, self.num_freq, self.freq_width)

    def gain(self, gain: torch.Tensor) -> torch.Tensor:
        return gain.to(self.dtype).view(1, self.kv_heads, 1, 1, self.num_freq, 2, self.m)

    def table(self, table: torch.Tensor) -> torch.Tensor:
        return table.to(self.dtype).view(self.table_batch, 1, 1, self.seq, 1, 1, self.m)

    def phase(self, z: torch.Tensor, frequency: torch.Tensor) -> torch.Tensor:
        """``omega * z`` per frequency block: ``(batch, kv_heads, groups, seq, F, m)``."""
        return self.z(z) * self.frequency(frequency)

    def output(self, features: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return features.reshape(self.batch, self.heads, self.seq, 2 * self.num_freq * self.m).to(dtype)


def _features(z, frequency, gain, cos, sin, rotate_cos_blocks: bool) -> torch.Tensor:
    """The forward formula (plain torch ops: differentiable by autograd too, which the fallback path uses)."""
    layout = _Layout(z, frequency, gain, cos)
    phase = layout.phase(z, frequency)
    trig = torch.stack((phase.cos(), phase.sin()), dim=-2)  # (..., F, 2, m): rows cos_f, sin_f
    features = trig * layout.gain(gain)
    features = _rotate_blocks(features, layout.table(cos), layout.table(sin), rotate_cos_blocks, adjoint=False)
    return layout.output(features, z.dtype)


class QKMapFeatureFunction(torch.autograd.Function):
    """``phi`` with a recomputing backward pass: saves ``z``, ``omega``, gains and the RoPE tables only."""

    @staticmethod
    def forward(z, frequency, gain, cos, sin, rotate_cos_blocks: bool):
        return _features(z, frequency, gain, cos, sin, rotate_cos_blocks)

    @staticmethod
    def setup_context(ctx, inputs, output):
        z, frequency, gain, cos, sin, rotate_cos_blocks = inputs
        ctx.save_for_backward(z, frequency, gain, cos, sin)
        ctx.rotate_cos_blocks = rotate_cos_blocks

    @staticmethod
    def backward(ctx, grad_output):
        z, frequency, gain, cos, sin = ctx.saved_tensors
        need_z, need_frequency, need_gain = ctx.needs_input_grad[:3]
        layout = _Layout(z, frequency, gain, cos)
        grad = grad_output.to(layout.dtype).reshape(
            layout.batch, layout.kv_heads, layout.groups, layout.seq, layout.num_freq, 2, layout.m
        )
        # Through the rotation (orthogonal and linear): d features = R^T grad.
        grad = _rotate_blocks(grad, layout.table(cos), layout.table(sin), ctx.rotate_cos_blocks, adjoint=True)
        phase = layout.phase(z, frequency)  # recomputed bit for bit as in the forward pass
        cos_phase, sin_phase = phase.cos(), phase.sin()
        # Reduce over what the parameters broadcast across: batch, the query heads of a group, positions.
        grad_gain = None
        if need_gain:
            trig = torch.stack((cos_phase, sin_phase), dim=-2)
            grad_gain = (grad * trig).sum(dim=(0, 2, 3)).view(gain.shape).to(gain.dtype)
        grad_z = grad_frequency = None
        if need_z or need_frequency:
            grad = grad * layout.gain(gain)
            # d/dphase of (a cos(phase), b sin(phase)) = (-a sin(phase), b cos(phase)).
            grad_phase = grad[..., 1, :] * cos_phase - grad[..., 0, :] * sin_phase
            if need_z:
                grad_z = (grad_phase * layout.frequency(frequency)).sum(dim=-2)
                grad_z = grad_z.reshape(z.shape).to(z.dtype)
            if need_frequency:
                grad_frequency = (grad_phase * layout.z(z)).sum(dim=(0, 2, 3))
                if layout.freq_width == 1:
                    grad_frequency = grad_frequency.sum(dim=-1, keepdim=True)
                grad_frequency = grad_frequency.to(frequency.dtype)
        return grad_z, grad_frequency, grad_gain, None, None, None


def qkmap_features(
    z: torch.Tensor,
    frequency: torch.Tensor,
    gain: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    rotate_cos_blocks: bool = True,
) -> torch.Tensor:
    """Map projected queries or keys to RoPE-rotated periodic features, ``phi`` of docs/method.md.

    Args:
        z: ``(batch, heads, seq, m)`` projections; ``heads`` is a multiple of the key/value heads.
        frequency: ``(kv_heads, F, m)`` or ``(kv_heads, F, 1)`` positive frequencies ``omega``.
        gain: ``(kv_heads, 2F, m)`` effective gains, rows ordered ``cos_0, sin_0, cos_1, ...``.
        cos, sin: ``(batch or 1, seq, m)`` RoPE tables for dimension ``m``.
        rotate_cos_blocks: rotate the cos blocks with RoPE like the sin blocks (False: cos blocks unrotated).

    Returns ``(batch, heads, seq, 2F*m)`` in ``z.dtype``. Phases, cos/sin and the rotation run in float32
    (float64 inputs stay float64); one broadcasted expression, no loop over blocks. When gradients are needed
    the recomputing ``QKMapFeatureFunction`` runs; RoPE tables that need gradients take plain autograd.
    """
    if not torch.is_grad_enabled() or cos.requires_grad or sin.requires_grad:
        return _features(z, frequency, gain, cos, sin, rotate_cos_blocks)
    if not (z.requires_grad or frequency.requires_grad or gain.requires_grad):
        return _features(z, frequency, gain, cos, sin, rotate_cos_blocks)
    return QKMapFeatureFunction.apply(z, frequency, gain, cos, sin, rotate_cos_blocks)
