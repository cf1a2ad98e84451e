"""What every diagnostic shares: its headline number and the JSON helpers its typed result is written with.

A measure's typed result is a dataclass with ``KEY`` (its entry in ``analysis.json``), ``headline`` (the one
number a summary line, a card or a claim table quotes), ``to_dict()``/``from_dict()`` (the JSON ``qkmap analyze``
writes, unchanged) and ``plot(path, label)``. Readers go through ``from_dict``, so a key is spelled in one place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch


@dataclass(frozen=True)
class Headline:
    """The number that stands for a measure: what it is called, its value and its unit."""

    name: str
    value: float | None
    unit: str


class Diagnostic(Protocol):
    """The typed result of one measure (see the module docstring)."""

    KEY: str

    @property
    def headline(self) -> Headline: ...

    def to_dict(self) -> dict[str, Any]: ...


T = TypeVar("T")


def read(entry: dict[str, Any] | None, result_type: type[T]) -> T | None:
    """``result_type.from_dict`` of the entry's section for that measure; None where a file has none (older files,
    models without a feature map)."""
    section = (entry or {}).get(result_type.KEY)  # type: ignore[attr-defined]
    return result_type.from_dict(section) if section else None  # type: ignore[attr-defined]


def mean2(rows: list[list[float]]) -> float:
    """Mean over every value of per-layer, per-head rows."""
    values = [v for r in rows for v in r]
    return sum(values) / len(values)


def row_means(rows: list[list[float]]) -> list[float]:
    """Per-layer means of per-head rows."""
    return [sum(r) / len(r) for r in rows]


def average(samples: list[list[list[float]]]) -> list[list[float]]:
    """Mean over samples of ``(layers, heads)`` values, in float64."""
    return torch.tensor(samples, dtype=torch.float64).mean(0).tolist()


__all__ = ["Diagnostic", "Headline", "average", "mean2", "read", "row_means"]
