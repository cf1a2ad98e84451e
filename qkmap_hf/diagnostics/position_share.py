"""Position-only share: how much of the within-row logit variance relative position ``t - s`` alone explains.

The pure reduction is ``attention_measures.position_only_share`` (an adjusted eta-squared); this unit runs it on
every layer of the captured pass and types the result.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from .. import attention_measures
from .base import Headline
from .hooks import CapturedPass

METRIC = "share of within-row logit variance explained by t - s alone (eta squared)"


@dataclass
class PositionOnlyShare:
    """Per layer: per-head share and its mean."""

    KEY: ClassVar[str] = "position_only_share"
    per_head: list[list[float]]
    layer_mean: list[float]
    metric: str = METRIC

    @property
    def mean(self) -> float:
        return sum(self.layer_mean) / len(self.layer_mean)

    @property
    def headline(self) -> Headline:
        return Headline("position-only share of logit variance", self.mean, "share")

    def to_dict(self) -> dict[str, Any]:
        return {"metric": self.metric, "per_head": self.per_head, "layer_mean": self.layer_mean, "mean": self.mean}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PositionOnlyShare:
        return cls(data["per_head"], data["layer_mean"], data.get("metric", METRIC))

    def plot(self, path: Path, label: str) -> Path:
        from .plots import heatmaps

        return heatmaps(path, f"{label}: position-only share of logit variance", [("share", self.per_head)])


def measure(captured: CapturedPass) -> PositionOnlyShare:
    """Every layer of the captured pass."""
    shares = [attention_measures.position_only_share(w) for w in captured.weights]
    return PositionOnlyShare([s.per_head for s in shares], [s.mean for s in shares])


__all__ = ["PositionOnlyShare", "measure"]
