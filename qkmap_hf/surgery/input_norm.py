"""The input norm of converted QK-Norm models (``qkmap_input_norm``): set its power, calibrate ``r``, fold it away.

A converted Qwen3 starts at power ``beta = 1`` (its own ``q_norm``/``k_norm``, exact). Healing anneals
``beta`` to 0 (``set_input_norm_power``), with ``r`` set to each head's typical ``rms(z)`` so the scale of
``z`` stays put along the way (``calibrate_reference_scale``). At ``beta = 0`` the norm is the fixed
per-channel scale ``weight / r``; ``fold_input_norm`` multiplies it into ``q_proj``/``k_proj`` and removes
the norm, leaving a plain QK-MAP model whose config says ``qkmap_input_norm = false``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ..errors import ConversionError
from ..modeling.qk_registry import constructions_for


def _norm_pairs(model: torch.nn.Module) -> list[tuple[torch.nn.Module, str, str]]:
    """(attention, norm name, projection name) for every input norm of ``model``."""
    from ..modeling.modeling_qkmap import QKMapInputRMSNorm

    pairs = []
    for module in model.modules():
        for norm, projection in (("q_norm", "q_proj"), ("k_norm", "k_proj")):
            if isinstance(getattr(module, norm, None), QKMapInputRMSNorm):
                pairs.append((module, norm, projection))
    return pairs


def set_input_norm_power(model: torch.nn.Module, power: float) -> None:
    """Set ``beta`` (``config.qkmap_input_norm_power``, shared by every layer) to ``power`` in [0, 1]."""
    if not isinstance(power, (int, float)) or isinstance(power, bool) or not 0.0 <= power <= 1.0:
        raise ValueError(f"power={power!r} is invalid; the input norm power is a number in [0, 1].")
    if not model.config.qkmap_input_norm:
        raise ValueError("this model has no input norm (config.qkmap_input_norm is false); nothing to anneal.")
    model.config.qkmap_input_norm_power = float(power)


@torch.no_grad()
def calibrate_reference_scale(model: torch.nn.Module, batches: Iterable[torch.Tensor]) -> None:
    """Set every norm's ``r`` to its head's mean ``rms(z)`` over the tokens of ``batches`` (input ids)."""
    pairs = _norm_pairs(model)
    if not pairs:
        raise ValueError("this model has no input norm (config.qkmap_input_norm is false); nothing to calibrate.")
    sums: dict[int, torch.Tensor] = {}
    counts: dict[int, int] = {}

    def record(module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        z = args[0].float()  # (batch, seq, heads, dim)
        rms = (z.pow(2).mean(-1) + module.variance_epsilon).sqrt()
        key = id(module)
        sums[key] = sums.get(key, 0) + rms.sum(dim=(0, 1))
        counts[key] = counts.get(key, 0) + rms.shape[0] * rms.shape[1]

    handles = [getattr(attention, norm).register_forward_pre_hook(record) for attention, norm, _ in pairs]
    try:
        for ids in batches:
            model(input_ids=ids.to(next(model.parameters()).device))
    finally:
        for handle in handles:
            handle.remove()
    for attention, norm, _ in pairs:
        module = getattr(attention, norm)
        if id(module) not in sums:
            raise ValueError("no tokens reached the input norms; pass at least one non-empty batch.")
        module.reference_scale.copy_(sums[id(module)] / counts[id(module)])


@torch.no_grad()
def fold_input_norm(model: torch.nn.Module) -> torch.nn.Module:
    """At ``beta = 0`` multiply ``weight / r`` into ``q_proj``/``k_proj`` and remove the norms (exact).

    The model becomes plain QK-MAP: ``config.qkmap_input_norm`` is false and saves as such.
    """
    config = model.config
    if not config.qkmap_input_norm:
        raise ConversionError("config.qkmap_input_norm is false: the model has no input norm to fold.")
    if config.qkmap_input_norm_power != 0:
        raise ConversionError(
            f"config.qkmap_input_norm_power={config.qkmap_input_norm_power}: only a norm at power 0 is a fixed scale "
            "that folds exactly; anneal it to 0 first (set_input_norm_power)."
        )
    pairs = _norm_pairs(model)
    for attention, norm_name, projection_name in pairs:
        norm, projection = getattr(attention, norm_name), getattr(attention, projection_name)
        scale = norm.weight.float().unsqueeze(0) / norm.reference_scale.float().unsqueeze(-1)  # (heads, dim)
        weight = projection.weight
        weight.copy_((weight.float().view(*scale.shape, -1) * scale.unsqueeze(-1)).view_as(weight))
        if projection.bias is not None:
            projection.bias.copy_((projection.bias.float().view_as(scale) * scale).view_as(projection.bias))
        delattr(attention, norm_name)
    config.qkmap_input_norm = False
    config.qkmap_input_norm_power = 1.0
    for attention, _, _ in pairs:
        attention.qk_constructions = constructions_for(config)  # the input-norm stage is gone
    return model


__all__ = ["calibrate_reference_scale", "fold_input_norm", "set_input_norm_power"]
