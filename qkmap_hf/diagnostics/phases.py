"""Phase statistics ``|omega * z|`` of QK-MAP layers, measured only through ``phases.PhaseRecorder``.

The recorder's forward pre-hook on each feature map sees exactly the ``z`` the map is given (after the input norm
of a converted Qwen3), so ``qkmap analyze`` (this unit), ``qkmap verify``, ``qkmap heal`` and the training monitor
report phases of the same ``z``. ``PhaseStatistics`` is the typed reading of a recorder summary (or of
``analysis.json``'s ``phase`` entry, which keeps each layer's per-role quantiles and the regime's description).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from torch import nn

from ..phases import MAX_SAMPLES, REGIME_DESCRIPTIONS, PhaseRecorder, describe, regime, regime_from_roles
from .base import Headline

METRIC = "|omega * z| over tokens, heads, frequencies, channels"


@dataclass(frozen=True)
class Quantiles:
    """Median, mean, p90 and max of the phases of one role of one layer (``phases.quantiles``)."""

    median: float
    mean: float
    p90: float
    max: float

    def to_dict(self) -> dict[str, float]:
        return {"median": self.median, "mean": self.mean, "p90": self.p90, "max": self.max}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Quantiles:
        return cls(data["median"], data["mean"], data["p90"], data["max"])


@dataclass(frozen=True)
class LayerPhases:
    """One QK-MAP layer's phases, per role; ``pooled_p90`` (query and key phases pooled, the regime's rule) where
    the reading comes from a recorder (``analysis.json`` keeps the roles only)."""

    layer: int
    query: Quantiles
    key: Quantiles
    pooled_p90: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"layer": self.layer, "query": self.query.to_dict(), "key": self.key.to_dict()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LayerPhases:
        query, key = Quantiles.from_dict(data["query"]), Quantiles.from_dict(data["key"])
        return cls(data["layer"], query, key, data.get("phase_p90"))


@dataclass
class PhaseStatistics:
    """Per QK-MAP layer its query and key phase quantiles; the regime they put the model in."""

    KEY: ClassVar[str] = "phase"
    layers: list[LayerPhases]
    metric: str = METRIC
    recorded_regime: str | None = None  # the label a file states (older analysis.json files: the roles' rule)

    @property
    def regime_label(self) -> str:
        """``linear``, ``transitional`` or ``periodic``: ``phases.regime`` of the pooled p90s, the rule ``qkmap
        verify`` and ``qkmap heal`` use; read back from a file, the label it states; per-role p90s only as the last
        resort (``phases.regime_from_roles``: the larger role p90 stands in for the pooled one)."""
        pooled = [layer.pooled_p90 for layer in self.layers]
        if all(p90 is not None for p90 in pooled):
            return regime(pooled)
        return self.recorded_regime or regime_from_roles([layer.to_dict() for layer in self.layers])

    @property
    def regime(self) -> str:
        return describe(self.regime_label)

    @property
    def headline(self) -> Headline:
        return Headline("largest per-layer p90 phase", max(max(x.query.p90, x.key.p90) for x in self.layers), "rad")

    def to_dict(self) -> dict[str, Any]:
        return {"metric": self.metric, "layers": [layer.to_dict() for layer in self.layers], "regime": self.regime}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PhaseStatistics:
        """Reads ``analysis.json``'s ``phase`` entry and a ``PhaseRecorder.summary()`` (verify's ``phase``) alike."""
        labels = {description: label for label, description in REGIME_DESCRIPTIONS.items()}
        stated = data.get("regime")
        recorded = stated if stated in REGIME_DESCRIPTIONS else labels.get(stated)
        return cls([LayerPhases.from_dict(layer) for layer in data["layers"]], METRIC, recorded)

    def plot(self, path: Path, label: str) -> Path:
        from .plots import lines

        xs = [p.layer for p in self.layers]
        series = {
            f"{side} {stat}": (xs, [getattr(getattr(p, side), stat) for p in self.layers])
            for side in ("query", "key")
            for stat in ("median", "p90")
        }
        return lines(path, f"{label}: typical phase |omega z| per layer", "layer", "phase (rad)", series)


def recorder(model: nn.Module) -> AbstractContextManager[PhaseRecorder]:
    """The recorder analyze runs during its unscaled pass: every phase kept (up to ``phases.MAX_SAMPLES``), as
    ``qkmap verify`` keeps them."""
    return PhaseRecorder(model, samples_per_pass=MAX_SAMPLES)


def from_recorder(recorded: PhaseRecorder) -> PhaseStatistics | None:
    """The typed statistics of what the recorder saw; None for a model without a QK-MAP feature map."""
    summary = recorded.summary()
    return PhaseStatistics.from_dict(summary) if summary else None


def measure(model: nn.Module, input_ids) -> PhaseStatistics | None:
    """One forward pass of ``input_ids`` with the recorder on (the standalone form of what analyze records)."""
    from .hooks import forward_without_cache

    with recorder(model) as recording:
        forward_without_cache(model, input_ids)
    return from_recorder(recording)


__all__ = ["LayerPhases", "PhaseStatistics", "Quantiles", "from_recorder", "measure", "recorder"]
