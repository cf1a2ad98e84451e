"""The attention diagnostics as units: one module per measure, each a function of the model and its probe inputs
returning a typed result (its headline number, its per-layer and per-head data, its JSON and its plot).

``qkmap_hf.analysis`` runs them and writes ``analysis.json``; the card, the paper's claim tables, the summary line
of ``qkmap analyze`` and the training monitor read them back through the typed results (``ModelDiagnostics``,
``PhaseStatistics``), never by dictionary keys. docs/architecture.md ("Diagnostics") says how to add one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .attention_distance import AttentionDistance
from .base import Headline, read
from .contrast import ANSWER, EVIDENCE, ContrastAtLength, NeedleContrast
from .first_token_mass import FirstTokenMass
from .key_scale import KeyScaleSensitivity
from .phases import PhaseStatistics
from .position_share import PositionOnlyShare
from .scale_sensitivity import ScaleSensitivity

IDENTITY = ("label", "model_class", "model_type", "qk_mode", "num_layers", "num_heads")
MEASURE_KEYS = (
    "scale_sensitivity",
    "first_token_mass",
    "phase",
    "attention_distance",
    "position_only_share",
    "key_scale_sensitivity",
    "evidence_contrast",
    "answer_contrast",
)


@dataclass
class ModelDiagnostics:
    """One model's entry of ``analysis.json``: what the model is, every measure's typed result, and what else the
    entry carries (``path``, ``plots``, a claim run's ``val_loss``...) in ``extra``, written back unchanged.

    Measures a file lacks (an older one) are None; ``phase`` is None for a model without a QK-MAP feature map.
    """

    label: str
    model_class: str | None
    model_type: str | None
    qk_mode: str | None
    num_layers: int
    num_heads: int
    scale_sensitivity: ScaleSensitivity
    first_token_mass: FirstTokenMass
    phase: PhaseStatistics | None = None
    attention_distance: AttentionDistance | None = None
    position_only_share: PositionOnlyShare | None = None
    key_scale_sensitivity: KeyScaleSensitivity | None = None
    evidence_contrast: NeedleContrast | None = None
    answer_contrast: NeedleContrast | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def measures(self) -> dict[str, Any]:
        """Every measure by its JSON key, in the order ``analysis.json`` lists them (None where absent)."""
        return {key: getattr(self, key) for key in MEASURE_KEYS}

    def headlines(self) -> dict[str, Headline]:
        return {key: result.headline for key, result in self.measures().items() if result is not None}

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {name: getattr(self, name) for name in IDENTITY}
        for key, result in self.measures().items():
            if result is not None or key == "phase":
                data[key] = result.to_dict() if result is not None else None
        return {**data, **self.extra}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelDiagnostics:
        known = {*IDENTITY, *MEASURE_KEYS}
        evidence, answer = data.get("evidence_contrast"), data.get("answer_contrast")
        return cls(
            label=data.get("label", "model"),
            model_class=data.get("model_class"),
            model_type=data.get("model_type"),
            qk_mode=data.get("qk_mode"),
            num_layers=data.get("num_layers", 0),
            num_heads=data.get("num_heads", 0),
            scale_sensitivity=ScaleSensitivity.from_dict(data["scale_sensitivity"]),
            first_token_mass=FirstTokenMass.from_dict(data["first_token_mass"]),
            phase=read(data, PhaseStatistics),
            attention_distance=read(data, AttentionDistance),
            position_only_share=read(data, PositionOnlyShare),
            key_scale_sensitivity=read(data, KeyScaleSensitivity),
            evidence_contrast=NeedleContrast.from_dict(evidence, EVIDENCE) if evidence else None,
            answer_contrast=NeedleContrast.from_dict(answer, ANSWER) if answer else None,
            extra={k: v for k, v in data.items() if k not in known},
        )


__all__ = [
    "AttentionDistance",
    "ContrastAtLength",
    "FirstTokenMass",
    "Headline",
    "KeyScaleSensitivity",
    "ModelDiagnostics",
    "NeedleContrast",
    "PhaseStatistics",
    "PositionOnlyShare",
    "ScaleSensitivity",
]
