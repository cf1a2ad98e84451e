"""Mean attention distance ``t - s`` per head, with the attention mass per distance bucket (for distributions).

The pure reduction is ``attention_measures.attention_distance``; this unit runs it on every layer of the captured
pass and types the result.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from .. import attention_measures
from .base import Headline
from .hooks import CapturedPass

METRIC = "mean t - s under the attention of query t (tokens), queries >= 1"


@dataclass
class AttentionDistance:
    """Per layer: per-head mean distance, its mean, and the mass per bucket ``[edge_i, edge_i+1)``."""

    KEY: ClassVar[str] = "attention_distance"
    per_head: list[list[float]]
    layer_mean: list[float]
    bucket_edges: list[int]
    bucket_mass: list[list[float]]
    metric: str = METRIC

    @property
    def mean(self) -> float:
        return sum(self.layer_mean) / len(self.layer_mean)

    @property
    def headline(self) -> Headline:
        return Headline("mean attention distance", self.mean, "tokens")

    def to_dict(self) -> dict[str, Any]:
        return {
            "metric": self.metric,
            "per_head": self.per_head,
            "layer_mean": self.layer_mean,
            "mean": self.mean,
            "bucket_edges": self.bucket_edges,
            "bucket_mass": self.bucket_mass,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AttentionDistance:
        return cls(
            data["per_head"], data["layer_mean"], data["bucket_edges"], data["bucket_mass"], data.get("metric", METRIC)
        )

    def plot(self, path: Path, label: str) -> Path:
        from .plots import heatmaps

        return heatmaps(path, f"{label}: mean attention distance (tokens)", [("distance", self.per_head)])


def measure(captured: CapturedPass) -> AttentionDistance:
    """Every layer of the captured pass."""
    distances = [attention_measures.attention_distance(w) for w in captured.weights]
    return AttentionDistance(
        [d.per_head for d in distances],
        [d.mean for d in distances],
        distances[0].bucket_edges,
        [d.bucket_mass for d in distances],
    )


__all__ = ["AttentionDistance", "measure"]
