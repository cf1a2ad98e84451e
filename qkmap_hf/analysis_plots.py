"""Plots of ``qkmap analyze`` results: each measure's own figure, and per-layer comparison curves of several models.

Pure rendering of typed results (``qkmap_hf.diagnostics``); nothing here touches a model.
"""

from __future__ import annotations

from pathlib import Path

from .diagnostics import ModelDiagnostics
from .diagnostics.plots import lines

OWN_PLOTS = ("scale_sensitivity", "first_token_mass", "evidence_contrast", "phase")  # the PNGs of one model


def plot_model(result: ModelDiagnostics, folder: Path, relative_to: Path) -> dict[str, str]:
    """Per-model PNGs (each measure's ``plot``); returns {name: path relative to ``relative_to``}."""
    folder.mkdir(parents=True, exist_ok=True)
    plots = {}
    measures = result.measures()
    for name in OWN_PLOTS:
        if (measured := measures[name]) is not None:
            path = measured.plot(folder / f"{name}.png", result.label)
            if path is not None:
                plots[name] = path
    return {name: p.relative_to(relative_to).as_posix() for name, p in plots.items()}


def plot_comparison(results: list[ModelDiagnostics], folder: Path) -> dict[str, str]:
    """Per-layer and per-length curves of every model on shared axes."""
    plots = {}
    largest = results[0].scale_sensitivity.largest
    path = folder / "comparison_scale_sensitivity.png"
    lines(
        path,
        f"attention change (TV) at input scale x{largest}, mean over heads",
        "layer",
        "total variation",
        {r.label: (list(range(r.num_layers)), r.scale_sensitivity.layer_mean[largest]) for r in results},
    )
    plots["scale_sensitivity"] = path.name
    path = folder / "comparison_first_token_mass.png"
    lines(
        path,
        "attention mass on the first token, mean over heads",
        "layer",
        "mass",
        {r.label: (list(range(r.num_layers)), r.first_token_mass.layer_mean) for r in results},
    )
    plots["first_token_mass"] = path.name
    if all(r.evidence_contrast is not None and r.evidence_contrast.by_length for r in results):
        path = folder / "comparison_evidence_contrast.png"
        series = {}
        for number, r in enumerate(results):
            by_length = r.evidence_contrast.by_length  # type: ignore[union-attr]
            xs = [v.tokens_mean for v in by_length.values()]
            color = f"C{number % 10}"
            series[f"{r.label} (mean head)"] = (xs, [v.mean_log2_lift for v in by_length.values()], {"color": color})
            series[f"{r.label} (best head)"] = (
                xs,
                [v.max_head_log2_lift for v in by_length.values()],
                {"color": color, "linestyle": "--"},
            )
        lines(path, "evidence contrast by context length", "context tokens", "log2 lift", series, xlog=True)
        plots["evidence_contrast"] = path.name
    return plots


__all__ = ["plot_comparison", "plot_model"]
