"""Attention mass on the first token (the attention sink), per head, averaged over query positions >= 1.

``uniform_reference`` is what a head attending uniformly to its visible keys would put there, the yardstick a
card prints next to the measured mass.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from .base import Headline, mean2, row_means
from .hooks import CapturedPass


@dataclass
class FirstTokenMass:
    """Per-layer, per-head mass on position 0; whether that position is BOS, and the window length."""

    KEY: ClassVar[str] = "first_token_mass"
    per_head: list[list[float]]
    first_token_is_bos: bool
    tokens: int

    @property
    def layer_mean(self) -> list[float]:
        return row_means(self.per_head)

    @property
    def mean(self) -> float:
        return mean2(self.per_head)

    @property
    def uniform_reference(self) -> float:
        length = self.tokens
        return sum(1.0 / (t + 1) for t in range(1, length)) / (length - 1)

    @property
    def headline(self) -> Headline:
        return Headline("attention mass on the first token", self.mean, "probability")

    def to_dict(self) -> dict[str, Any]:
        return {
            "per_head": self.per_head,
            "layer_mean": self.layer_mean,
            "mean": self.mean,
            "uniform_reference": self.uniform_reference,
            "first_token_is_bos": self.first_token_is_bos,
            "tokens": self.tokens,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> FirstTokenMass:
        return cls(data["per_head"], data["first_token_is_bos"], data["tokens"])

    def plot(self, path: Path, label: str) -> Path:
        from .plots import heatmaps

        return heatmaps(path, f"{label}: attention mass on the first token", [("first-token mass", self.per_head)])


def from_weights(weights: list[torch.Tensor], first_is_bos: bool) -> FirstTokenMass:
    """The measure on per-layer attention weights ``(batch, heads, T, T)``."""
    per_head = [w[:, :, 1:, 0].mean(dim=(0, 2)).tolist() for w in weights]
    return FirstTokenMass(per_head, first_is_bos, weights[0].shape[-1])


def measure(captured: CapturedPass) -> FirstTokenMass:
    """The measure on the captured unscaled pass."""
    return from_weights(captured.weights, captured.first_is_bos)


__all__ = ["FirstTokenMass", "from_weights", "measure"]
