"""Input-scale sensitivity: how far a layer's attention moves when its ``q_proj``/``k_proj`` outputs are scaled.

The outputs of one layer's projections (``z = W x + b``, the input of the query/key construction) are multiplied by
``s`` and the layer is re-run on the inputs it saw in the unscaled pass, so each number isolates one layer. The
rows are compared with the unscaled ones by total-variation distance, per head, over query positions >= 1 (query 0
attends to itself in every mode). QK-Norm divides the scale out (0 up to its epsilon), standard attention sharpens
or flattens with ``s**2``, QK-MAP moves its phases ``omega * z``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from .base import Headline, mean2, row_means
from .hooks import CapturedPass

METRIC = "mean total-variation distance of attention rows (query positions >= 1) vs. unscaled"
SCALED = "outputs of q_proj and k_proj of one layer at a time"


def scale_key(scale: float) -> str:
    """How a factor names its entries in the JSON (``0.5``, ``2``)."""
    return f"{scale:g}"


@dataclass
class ScaleSensitivity:
    """Per scale (keyed ``scale_key``): per-layer, per-head TV distances, their layer means, mean and max."""

    KEY: ClassVar[str] = "scale_sensitivity"
    scales: list[float]
    per_head: dict[str, list[list[float]]]
    metric: str = METRIC
    scaled: str = SCALED

    @property
    def layer_mean(self) -> dict[str, list[float]]:
        return {s: row_means(rows) for s, rows in self.per_head.items()}

    @property
    def mean(self) -> dict[str, float]:
        return {s: mean2(rows) for s, rows in self.per_head.items()}

    @property
    def max(self) -> dict[str, float]:
        return {s: max(max(r) for r in rows) for s, rows in self.per_head.items()}

    @property
    def largest(self) -> str:
        """The scale farthest from 1, by its key (the one comparison plots show)."""
        return max(self.per_head, key=lambda key: abs(math.log(float(key))))

    @property
    def headline(self) -> Headline:
        return Headline(f"attention change at input scale x{self.largest}", self.mean[self.largest], "TV")

    def to_dict(self) -> dict[str, Any]:
        return {
            "metric": self.metric,
            "scaled": self.scaled,
            "scales": list(self.scales),
            "per_head": self.per_head,
            "layer_mean": self.layer_mean,
            "mean": self.mean,
            "max": self.max,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ScaleSensitivity:
        return cls(list(data["scales"]), dict(data["per_head"]), data.get("metric", METRIC), data.get("scaled", SCALED))

    def plot(self, path: Path, label: str) -> Path:
        from .plots import heatmaps

        panels = [(f"x{s}", rows) for s, rows in self.per_head.items()]
        return heatmaps(path, f"{label}: attention change (TV) when q/k inputs are scaled", panels)


def _scale_hook(factor: float) -> Callable:
    def hook(_module, _inputs, output):
        return output * factor

    return hook


@torch.no_grad()
def measure(
    captured: CapturedPass, scales: Sequence[float], progress: Callable[[int], Any] = lambda _n: None
) -> ScaleSensitivity:
    """Each layer re-run on its captured inputs with both projections scaled, for each scale."""
    per_head: dict[str, list[list[float]]] = {}
    for scale in scales:
        rows = []
        for layer in captured.layers:
            handles = [
                layer.q_proj.register_forward_hook(_scale_hook(scale)),
                layer.k_proj.register_forward_hook(_scale_hook(scale)),
            ]
            try:
                weights = captured.rerun(layer)
            finally:
                for handle in handles:
                    handle.remove()
            tv = 0.5 * (weights - captured.weights[layer.index]).abs().sum(-1)[:, :, 1:]
            rows.append(tv.mean(dim=(0, 2)).tolist())
            progress(1)
        per_head[scale_key(scale)] = rows
    return ScaleSensitivity(list(scales), per_head)


__all__ = ["ScaleSensitivity", "measure", "scale_key"]
