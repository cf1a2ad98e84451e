# Copyright 2026 The qkmap-hf authors. Licensed under the Apache License, Version 2.0.
"""How training treats QK-MAP's gains (``qkmap_gain_treatment``): they set the logit bound
``|logit| <= scale * ||a_q|| * ||a_k||`` (qkmap_lab/notes/stability.md), so the treatment decides whether that bound holds.

Each treatment is a small class; ``GAIN_TREATMENTS`` is its registry, keyed by the config value. The feature map
(``construction_qkmap.QKMapFeatureMap``) asks its treatment whether the gains train, which optimizer group they
join, and what gain the features see. Copied into checkpoints: torch and transformers only. It imports torch alone,
because ``configuration_qkmap.py`` reads its keys and a config must not pull in the modeling code.
"""

from __future__ import annotations

from typing import ClassVar

import torch

# Added to the mean square of a gain row before it is normalized: keeps an all-zero row at zero instead of NaN, and
# is far below the unit RMS the native init starts from.
GAIN_NORMALIZATION_EPS = 1e-12


class GainTreatment:
    """``learned`` (the default): trained in the query/key group (own learning rate, no weight decay)."""

    name: ClassVar[str] = "learned"
    trainable: ClassVar[bool] = True
    trained_like_weights: ClassVar[bool] = False  # True: the weight matrices' group (base rate, weight decay)
    native_init_only: ClassVar[bool] = False

    @staticmethod
    def effective(gain: torch.Tensor) -> torch.Tensor:
        """The gain the features see, from the stored one (after the inverse-frequency parametrization)."""
        return gain


class FrozenGains(GainTreatment):
    """``frozen``: kept at their initial values, so the bound is the initial one for the whole run."""

    name = "frozen"
    trainable = False


class DecayedGains(GainTreatment):
    """``decayed``: trained like a weight matrix (base learning rate, weight decay), which pulls the bound down."""

    name = "decayed"
    trained_like_weights = True


class NormalizedGains(GainTreatment):
    """``normalized``: each cos or sin row of ``m`` gains rescaled to RMS 1 in the forward pass, so the bound is at
    most ``scale * 2 F m`` whatever training does. Native init only: the exact init's rows are not RMS 1."""

    name = "normalized"
    native_init_only = True

    @staticmethod
    def effective(gain: torch.Tensor) -> torch.Tensor:
        return gain * torch.rsqrt(gain.square().mean(dim=-1, keepdim=True) + GAIN_NORMALIZATION_EPS)


GAIN_TREATMENTS: dict[str, type[GainTreatment]] = {
    treatment.name: treatment for treatment in (GainTreatment, FrozenGains, DecayedGains, NormalizedGains)
}

__all__ = [
    "GAIN_NORMALIZATION_EPS",
    "GAIN_TREATMENTS",
    "DecayedGains",
    "FrozenGains",
    "GainTreatment",
    "NormalizedGains",
]
