"""Provenance: typed records of how a model folder came about, written by conversion, training and healing and
read by the model card (``qkmap_hf.cards``).

Each kind is a dataclass saved as JSON next to the weights under its file name (``PROVENANCE_FILES``), with the
same keys as the dicts written before these classes existed, so old folders load and render unchanged. Keys a
record does not know (an older or newer writer, a hand-made file) are kept in ``extra`` and written back as they are.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from .fileio import atomic_write_json
from .filenames import PROVENANCE_FILES


@dataclass
class ProvenanceRecord:
    """Base of the records: a ``kind``, typed fields, and ``extra`` for keys this version does not know."""

    kind: ClassVar[str] = "provenance"
    writes_kind: ClassVar[bool] = True  # whether the saved JSON carries "kind" (the training record never did)
    kept_when_none: ClassVar[frozenset[str]] = frozenset()  # keys written as null; other unset fields are left out
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ProvenanceRecord:
        """A record from its JSON dict; unknown keys go to ``extra``, missing ones keep their defaults."""
        known = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        values = {key: value for key, value in data.items() if key in known}
        extra = {key: value for key, value in data.items() if key not in known and key != "kind"}
        return cls(**values, extra=extra)

    def to_dict(self) -> dict[str, Any]:
        """The JSON dict: ``kind`` first (where this kind writes it), the set fields in order, then ``extra``."""
        data: dict[str, Any] = {"kind": self.kind} if self.writes_kind else {}
        for item in dataclasses.fields(self):
            value = getattr(self, item.name)
            if item.name == "extra" or (value is None and item.name not in self.kept_when_none):
                continue
            data[item.name] = value
        return {**data, **self.extra}

    @property
    def file_name(self) -> str:
        return PROVENANCE_FILES.get(self.kind, "provenance")

    def save(self, folder: str | Path) -> Path:
        """Write ``folder/<file_name>`` atomically."""
        return atomic_write_json(Path(folder) / self.file_name, self.to_dict())


@dataclass
class ConversionRecord(ProvenanceRecord):
    """``qkmap_conversion.json``: what was converted, how, and with which versions (``qkmap convert``)."""

    kind: ClassVar[str] = "conversion"
    kept_when_none: ClassVar[frozenset[str]] = frozenset({"base_model", "omega_0"})

    source: str | None = None
    source_architecture: str | None = None
    base_model: str | None = None
    init: str | None = None  # "exact" or "native" (QKMapConfig.qkmap_init); old folders may say "canonical"
    omega_0: float | None = None
    num_frequencies: int | None = None
    gain_parametrization: str | None = None
    input_norm: bool | None = None
    dtype: Any = None
    qkmap_hf_version: str | None = None
    transformers_version: str | None = None
    torch_version: str | None = None
    timestamp: str | None = None
    frequency_range: list[float] | None = None
    gguf_file: str | None = None
    source_path: str | None = None
    verification: dict[str, Any] | None = None


@dataclass
class TrainingRecord(ProvenanceRecord):
    """``qkmap_training.json``: the options, resolved settings, data, metrics and log history of ``qkmap train``."""

    kind: ClassVar[str] = "training"
    writes_kind: ClassVar[bool] = False

    kept_when_none: ClassVar[frozenset[str]] = frozenset({"resumed_from"})

    command: str | None = None  # "qkmap train"
    options: dict[str, Any] | None = None  # TrainOptions as a dict
    resolved: dict[str, Any] | None = None
    resumed_from: str | None = None
    world_size: int | None = None
    parallel: dict[str, Any] | None = None
    model: dict[str, Any] | None = None
    data: dict[str, Any] | None = None
    train_metrics: dict[str, Any] | None = None
    eval_metrics: dict[str, Any] | None = None
    log_history: list[dict[str, Any]] | None = None
    wall_seconds: float | None = None
    versions: dict[str, Any] | None = None


@dataclass
class HealingRecord(ProvenanceRecord):
    """``qkmap_healing.json``: the converted model, its teacher, the recipe and where the heal ended (``qkmap heal``)."""

    kind: ClassVar[str] = "healing"

    command: str | None = None  # "qkmap heal"
    converted_model: str | None = None
    source: str | None = None
    recipe: dict[str, Any] | None = None  # HealOptions as a dict
    tokens_seen: int | None = None
    steps: int | None = None
    final: dict[str, Any] | None = None
    gain_parametrization: str | None = None


RECORD_CLASSES: dict[str, type[ProvenanceRecord]] = {
    cls.kind: cls for cls in (ConversionRecord, TrainingRecord, HealingRecord)
}


def record_from_dict(data: dict[str, Any], kind: str | None = None) -> ProvenanceRecord:
    """The typed record for ``kind`` (default: the dict's ``"kind"``); another kind becomes a generic record."""
    if not isinstance(data, dict):
        raise TypeError(f"a provenance record must be a dict, got {type(data).__name__}.")
    kind = kind or str(data.get("kind") or "provenance")
    cls = RECORD_CLASSES.get(kind)
    if cls is not None:
        return cls.from_dict(data)
    generic = type(f"{kind.title()}Record", (ProvenanceRecord,), {"kind": kind, "__annotations__": {}})
    return dataclass(generic).from_dict(data)


def load_provenance(
    model_dir: str | Path, provenance: ProvenanceRecord | dict | None = None
) -> dict[str, ProvenanceRecord]:
    """The records by kind: the files in ``model_dir``, then ``provenance`` (which wins for its kind)."""
    records: dict[str, ProvenanceRecord] = {}
    for kind, name in PROVENANCE_FILES.items():
        path = Path(model_dir) / name
        if path.is_file():
            try:
                data = json.loads(path.read_text(encoding="utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as error:
                raise ValueError(f"{path} (the {kind} record) is not valid JSON: {error}.") from error
            records[kind] = record_from_dict(data, kind)
    if provenance is not None:
        record = provenance if isinstance(provenance, ProvenanceRecord) else record_from_dict(provenance)
        records[record.kind] = record
    return records


__all__ = [
    "PROVENANCE_FILES",
    "ConversionRecord",
    "HealingRecord",
    "ProvenanceRecord",
    "TrainingRecord",
    "load_provenance",
    "record_from_dict",
]
