"""Figures for reports, through matplotlib's object API: no pyplot state, no global backend switch.

Library code must not change the backend of a user's notebook or GUI session; a ``Figure`` with its own Agg
canvas renders PNGs anywhere. Every PNG is written atomically (a temporary file renamed into place).
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from .fileio import atomic_path


def new_figure(width: float = 7.0, height: float = 4.5, *, layout: str | None = None) -> Any:
    """A ``matplotlib.figure.Figure`` with its own Agg canvas (``layout``: e.g. ``"constrained"``)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), layout=layout)
    FigureCanvasAgg(figure)
    return figure


def save_figure(figure: Any, path: str | os.PathLike, *, dpi: int = 110, tight: bool = True) -> Path:
    """Write ``figure`` to ``path`` (PNG) atomically; returns the path."""
    with atomic_path(path) as tmp:
        figure.savefig(tmp, dpi=dpi, bbox_inches="tight" if tight else None)
    return Path(path)


def plot_mean_with_band(
    axis: Any, curves: Mapping[str, Mapping[int, Iterable[float]]], *, tail_fraction: float = 0.2, alpha: float = 0.2
) -> None:
    """One line per label (mean over runs at each step) with a min/max band; the y range fits the curves' tails.

    The first steps (loss near log vocab) would squash the interesting part, so the y limits cover the steps at or
    after ``tail_fraction`` of the last step.
    """
    tail: list[float] = []
    for label, by_step in curves.items():
        if not by_step:
            continue
        steps = sorted(by_step)
        runs = [list(by_step[s]) for s in steps]
        means = [statistics.fmean(values) for values in runs]
        axis.plot(steps, means, label=f"{label} (n={max(len(v) for v in runs)})", linewidth=1.6)
        axis.fill_between(steps, [min(v) for v in runs], [max(v) for v in runs], alpha=alpha)
        tail += [m for s, m in zip(steps, means, strict=True) if s >= tail_fraction * steps[-1]]
    if tail:
        margin = 0.08 * (max(tail) - min(tail) or 1.0)
        axis.set_ylim(min(tail) - margin, max(tail) + margin)


__all__ = ["new_figure", "plot_mean_with_band", "save_figure"]
