"""Plots of ``qkmap analyze`` results: per-model layer x head heatmaps and per-layer comparison curves.

Pure rendering of the JSON-ready dicts that ``qkmap_hf.analysis`` measures; nothing here touches a model.
"""

from __future__ import annotations

import math
from pathlib import Path

from .plotting import new_figure, save_figure


def _heatmaps(path: Path, title: str, panels: list[tuple[str, list[list[float]]]], *, diverging: bool = False) -> None:
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


def _lines(path: Path, title: str, xlabel: str, ylabel: str, series: dict[str, tuple], *, xlog: bool = False) -> None:
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


def plot_model(result: dict, folder: Path, relative_to: Path) -> dict[str, str]:
    """Per-model PNGs (layer x head heatmaps); returns {name: path relative to ``relative_to``}."""
    folder.mkdir(parents=True, exist_ok=True)
    label, plots = result["label"], {}
    scale = result["scale_sensitivity"]
    path = folder / "scale_sensitivity.png"
    _heatmaps(
        path,
        f"{label}: attention change (TV) when q/k inputs are scaled",
        [(f"x{s}", rows) for s, rows in scale["per_head"].items()],
    )
    plots["scale_sensitivity"] = path
    path = folder / "first_token_mass.png"
    _heatmaps(
        path,
        f"{label}: attention mass on the first token",
        [("first-token mass", result["first_token_mass"]["per_head"])],
    )
    plots["first_token_mass"] = path
    contrast = result["evidence_contrast"]["by_length"]
    if contrast:
        path = folder / "evidence_contrast.png"
        panels = [(f"{v['tokens_mean']} tokens", v["per_head_log2_lift"]) for v in contrast.values()]
        _heatmaps(path, f"{label}: log2 evidence/distractor attention per token", panels, diverging=True)
        plots["evidence_contrast"] = path
    if result.get("phase"):
        path = folder / "phase.png"
        layers = result["phase"]["layers"]
        xs = [p["layer"] for p in layers]
        _lines(
            path,
            f"{label}: typical phase |omega z| per layer",
            "layer",
            "phase (rad)",
            {
                f"{side} {stat}": (xs, [p[side][stat] for p in layers])
                for side in ("query", "key")
                for stat in ("median", "p90")
            },
        )
        plots["phase"] = path
    return {name: p.relative_to(relative_to).as_posix() for name, p in plots.items()}


def plot_comparison(results: list[dict], folder: Path) -> dict[str, str]:
    """Per-layer and per-length curves of every model on shared axes."""
    plots = {}
    # the scale farthest from 1, by its key in the results ("0.5", "2", ...)
    largest = max(results[0]["scale_sensitivity"]["layer_mean"], key=lambda key: abs(math.log(float(key))))
    path = folder / "comparison_scale_sensitivity.png"
    _lines(
        path,
        f"attention change (TV) at input scale x{largest}, mean over heads",
        "layer",
        "total variation",
        {r["label"]: (list(range(r["num_layers"])), r["scale_sensitivity"]["layer_mean"][largest]) for r in results},
    )
    plots["scale_sensitivity"] = path.name
    path = folder / "comparison_first_token_mass.png"
    _lines(
        path,
        "attention mass on the first token, mean over heads",
        "layer",
        "mass",
        {r["label"]: (list(range(r["num_layers"])), r["first_token_mass"]["layer_mean"]) for r in results},
    )
    plots["first_token_mass"] = path.name
    if all(r["evidence_contrast"]["by_length"] for r in results):
        path = folder / "comparison_evidence_contrast.png"
        series = {}
        for number, r in enumerate(results):
            by_length = r["evidence_contrast"]["by_length"]
            xs = [v["tokens_mean"] for v in by_length.values()]
            color = f"C{number % 10}"
            series[f"{r['label']} (mean head)"] = (
                xs,
                [v["mean_log2_lift"] for v in by_length.values()],
                {"color": color},
            )
            series[f"{r['label']} (best head)"] = (
                xs,
                [v["max_head_log2_lift"] for v in by_length.values()],
                {"color": color, "linestyle": "--"},
            )
        _lines(path, "evidence contrast by context length", "context tokens", "log2 lift", series, xlog=True)
        plots["evidence_contrast"] = path.name
    return plots


__all__ = ["plot_comparison", "plot_model"]
