"""Key-scale sensitivity: the attention mass one token gains when only its key projection is scaled.

The token-specific test of "a key's norm decides how strongly that token attracts queries": one token's ``k_proj``
output (at that position only) is scaled by ``factor`` and the layer re-run on its captured inputs; the mass that
token gains from later queries is averaged over tokens, windows and heads. QK-Norm divides the scale out (0 up to
its epsilon); standard attention scales that key's logits; QK-MAP moves its phases. Reported signed and absolute
(a key can lose mass too).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from ..attention_measures import token_mass_change
from .base import Headline, mean2, row_means
from .hooks import CapturedPass

KEY_SCALE_FACTOR = 2.0
KEY_SCALE_TOKENS = 16


def key_positions(length: int, count: int = KEY_SCALE_TOKENS) -> list[int]:
    """``count`` key positions spread over ``[1, length/2]``: each has at least half the window of later queries."""
    high = max(1, length // 2)
    return sorted({1 + round(i * (high - 1) / max(1, count - 1)) for i in range(count)})


@dataclass
class KeyScaleSensitivity:
    """Per layer and head: the signed mass gain and the absolute change, averaged over the scaled positions."""

    KEY: ClassVar[str] = "key_scale_sensitivity"
    factor: float
    positions: list[int]
    per_head_gain: list[list[float]]
    per_head_abs_change: list[list[float]]

    @property
    def metric(self) -> str:
        return f"attention mass a token gains from later queries when its k_proj output is scaled x{self.factor:g}"

    @property
    def mean_gain(self) -> float:
        return mean2(self.per_head_gain)

    @property
    def mean_abs_change(self) -> float:
        return mean2(self.per_head_abs_change)

    @property
    def headline(self) -> Headline:
        return Headline(f"|attention mass change| of a token whose key is scaled x{self.factor:g}",
                        self.mean_abs_change, "probability")  # fmt: skip

    def to_dict(self) -> dict[str, Any]:
        return {
            "metric": self.metric,
            "factor": self.factor,
            "positions": self.positions,
            "per_head_gain": self.per_head_gain,
            "per_head_abs_change": self.per_head_abs_change,
            "layer_mean_gain": row_means(self.per_head_gain),
            "layer_mean_abs_change": row_means(self.per_head_abs_change),
            "mean_gain": self.mean_gain,
            "mean_abs_change": self.mean_abs_change,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KeyScaleSensitivity:
        return cls(data["factor"], data["positions"], data["per_head_gain"], data["per_head_abs_change"])

    def plot(self, path: Path, label: str) -> Path:
        from .plots import heatmaps

        panels = [("signed gain", self.per_head_gain), ("absolute change", self.per_head_abs_change)]
        return heatmaps(path, f"{label}: {self.metric}", panels, diverging=True)


@torch.no_grad()
def measure(
    captured: CapturedPass, progress: Callable[[int], Any] = lambda _n: None, factor: float = KEY_SCALE_FACTOR
) -> KeyScaleSensitivity:
    """Each layer re-run on its captured inputs once per scaled position."""
    positions = key_positions(captured.weights[0].shape[-1])
    signed, absolute = [], []
    for layer in captured.layers:
        layer_signed, layer_abs = [], []
        base = captured.weights[layer.index]
        for token in positions:

            def scale_one(_module, _inputs, output, token=token):
                output = output.clone()
                output[:, token] = output[:, token] * factor
                return output

            handle = layer.k_proj.register_forward_hook(scale_one)
            try:
                changed = captured.rerun(layer)
            finally:
                handle.remove()
            layer_signed.append(token_mass_change(base, changed, token).per_head)
            layer_abs.append(token_mass_change(base, changed, token, absolute=True).per_head)
        signed.append(torch.tensor(layer_signed).mean(0).tolist())
        absolute.append(torch.tensor(layer_abs).mean(0).tolist())
        progress(1)
    return KeyScaleSensitivity(factor, positions, signed, absolute)


__all__ = ["KEY_SCALE_FACTOR", "KEY_SCALE_TOKENS", "KeyScaleSensitivity", "key_positions", "measure"]
