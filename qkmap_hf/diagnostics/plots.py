"""The two figure kinds the diagnostics draw: layer x head heatmaps and per-layer or per-length curves."""

from __future__ import annotations

from pathlib import Path

from ..plotting import new_figure, save_figure


def heatmaps(path: Path, title: str, panels: list[tuple[str, list[list[float]]]], *, diverging: bool = False) -> Path:
    """One layer x head heatmap per panel, values written in the cells when there is room."""
    values = [v for _, rows in panels for r in rows for v in r]
    vmax = max(abs(v) for v in values) or 1.0
    vmin = -vmax if diverging else min(0.0, min(values))
    layers, heads = len(panels[0][1]), len(panels[0][1][0])
    width = 1.5 + len(panels) * (0.9 + 0.45 * heads)
    fig = new_figure(width, 1.6 + 0.3 * layers, layout="constrained")
    axes = fig.subplots(1, len(panels), squeeze=False)
    image = None
    for index, (ax, (name, rows)) in enumerate(zip(axes[0], panels, strict=True)):
        image = ax.imshow(
            rows, aspect="auto", cmap="RdBu_r" if diverging else "viridis", vmin=vmin, vmax=vmax, origin="lower"
        )
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("head")
        if index == 0:
            ax.set_ylabel("layer")
        ax.set_xticks(range(heads))
        ax.set_yticks(range(layers))
        ax.tick_params(labelsize=6)
        if layers * heads <= 64:
            for i, row in enumerate(rows):
                for j, v in enumerate(row):
                    ax.text(j, i, f"{v:.2g}", ha="center", va="center", fontsize=5, color="white")
    fig.colorbar(image, ax=axes[0].tolist(), shrink=0.8)
    fig.suptitle(title, fontsize=10)
    save_figure(fig, path)
    return path


def lines(path: Path, title: str, xlabel: str, ylabel: str, series: dict[str, tuple], *, xlog: bool = False) -> Path:
    """Line plot; a series is ``(xs, ys)`` or ``(xs, ys, matplotlib style kwargs)``."""
    fig = new_figure(6, 4)
    ax = fig.add_subplot()
    ticks: set = set()
    for name, (xs, ys, *style) in series.items():
        ax.plot(xs, ys, marker="o", label=name, **(style[0] if style else {}))
        ticks.update(xs)
    if xlog:
        ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(ticks))
    ax.set_xticklabels([f"{t:g}" for t in sorted(ticks)], fontsize=8)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    save_figure(fig, path)
    return path


__all__ = ["heatmaps", "lines"]
