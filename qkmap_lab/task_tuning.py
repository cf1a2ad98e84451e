"""The tuning half of the synthetic-task report: each arm's choice, its grid's edges and margins, the per-knob
profiles and the heatmaps, read from the sweeps' ``sweep_losses.csv`` (``qkmap-lab task-report``, ``--tuning-only``)."""

from __future__ import annotations

import json
import math
import statistics
import textwrap
from pathlib import Path
from typing import Any

from qkmap_hf.training.sweep import choose_setting, on_grid_edge, tuning_losses_so_far


def _sweep_folders(sweep: Path) -> list[Path]:
    """A sweep folder and its ``shard-*`` folders (``benchmarks/sharded_compare.sh``), which share data and seeds."""
    return [sweep, *sorted(sweep.glob("shard-*"))]


def arm_and_seed(run: Path) -> tuple[str, int]:
    """``(arm, seed)`` of a report run or saved model folder, ``.../ARM/seedS``."""
    return run.parent.name, int(run.name.removeprefix("seed"))


def _setting_values(setting: str) -> dict[str, Any] | None:
    """``learning_rate=0.001;logit_scale_multiplier=4`` -> its values (None for a name that is not such a list)."""
    values: dict[str, Any] = {}
    for item in setting.split(";"):
        name, sep, value = item.partition("=")
        if not sep:
            return None
        try:
            values[name] = float(value)
        except ValueError:
            values[name] = value
    return values


def _value_order(text: str) -> tuple:
    """The order of a knob's values in the tables: numbers by value, then other values by name."""
    try:
        return (0, float(text), "")
    except ValueError:
        return (1, 0.0, text)


def edge_margins(choice_setting: str, edges: list[str], tuning_losses: dict[str, dict]) -> dict[str, float | None]:
    """Per edge knob: the best tuning loss among points with another value of that knob, minus the choice's. A
    margin near 0 (saturated runs: 3.5e-5 against 4.1e-5) is a tie, not a trend that a wider grid would follow."""
    means = {s: statistics.fmean(v.values()) for s, v in tuning_losses.items() if v}
    parsed = {s: values for s in means if (values := _setting_values(s))}
    choice, chosen = _setting_values(choice_setting) or {}, means.get(choice_setting)
    margins: dict[str, float | None] = {}
    for knob in edges:
        others = [means[s] for s, values in parsed.items() if values.get(knob) != choice.get(knob)]
        margins[knob] = min(others) - chosen if others and chosen is not None else None
    return margins


def _label(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def knob_profiles(tuning_losses: dict[str, dict]) -> dict[str, dict[str, float]]:
    """Per tuned knob and value: the best tuning loss over the other knobs (``{"logit_scale_multiplier": {"0.5":
    0.01, "1": 0.2}}``): the trend along one knob, which says whether a choice on an edge would move further."""
    profiles: dict[str, dict[str, float]] = {}
    for setting, seeds in tuning_losses.items():
        values = _setting_values(setting)
        if not values or not seeds:
            continue
        loss = statistics.fmean(seeds.values())
        for knob, value in values.items():
            best = profiles.setdefault(knob, {})
            label = _label(value)
            best[label] = min(best.get(label, math.inf), loss)
    return {knob: dict(sorted(best.items(), key=lambda item: _value_order(item[0]))) for knob, best in profiles.items()}


def tuning_choices(sweep: Path) -> dict[str, dict[str, Any]]:
    """``{arm: {"choice", "tuning_loss", "points", "edges", "edge_margins", "profiles"}}`` from the ``summary.json``
    of a sweep and its shards: the setting each arm was reported at, its tuning-split loss (mean over tuning seeds),
    how many grid points ran, the tuned knobs whose choice sits on an edge of their grid (there the grid was too
    small to say it is best), per such knob by how much the edge beat the other values (``edge_margins``), and the
    best loss at each value of each knob over every tuning run in ``sweep_losses.csv`` so far (``profiles``)."""
    choices: dict[str, dict[str, Any]] = {}
    for folder in _sweep_folders(sweep):
        path = folder / "summary.json"
        if not path.is_file():
            continue
        summary = json.loads(path.read_text())
        grid = summary.get("settings", {}).get("tune", {})
        so_far = tuning_losses_so_far(folder, summary.get("settings", {}).get("steps", -1))
        for arm, entry in summary.get("arms", {}).items():
            if not entry.get("choice"):
                continue
            values = entry.get("choice_values", {})
            losses = entry.get("tuning_losses", {}).get(entry["choice"], {})
            edges = [k for k, v in values.items() if len(grid.get(k, [])) > 1 and on_grid_edge(v, grid[k])]
            choices[arm] = {
                "choice": values,
                "tuning_loss": statistics.fmean(losses.values()) if losses else None,
                "points": len(entry.get("tuning_losses", {})),
                "edges": edges,
                "edge_margins": edge_margins(entry["choice"], edges, entry.get("tuning_losses", {})),
                # from every tuning run finished so far: a sweep widening its grid shows where the new points lead
                "profiles": knob_profiles(so_far.get(arm) or entry.get("tuning_losses", {})),
            }
    return choices


def tuning_so_far(sweep: Path) -> dict[str, dict[str, Any]]:
    """Per arm, what the tuning runs finished so far say, from the ``sweep_losses.csv`` of the sweep and its shards
    alone (a sweep still running, or one whose CSVs were restored from a committed copy): ``tuning_choices``'
    entries with the lowest loss so far as the choice and the values run so far as the grid, and ``losses``, every
    grid point's mean loss over its tuning seeds."""
    runs: dict[str, dict[str, dict[str, float]]] = {}
    for folder in _sweep_folders(sweep):
        for arm, settings in tuning_losses_so_far(folder).items():
            runs.setdefault(arm, {}).update(settings)
    entries: dict[str, dict[str, Any]] = {}
    for arm, settings in sorted(runs.items()):
        means = {setting: statistics.fmean(seeds.values()) for setting, seeds in settings.items() if seeds}
        choice = choose_setting(means, {}, {})  # the sweep's rule without a tie tolerance: the lowest loss so far
        values = _setting_values(choice) or {}
        grid: dict[str, set] = {}
        for setting in means:
            for knob, value in (_setting_values(setting) or {}).items():
                grid.setdefault(knob, set()).add(value)
        edges = [k for k, v in values.items() if len(grid.get(k, ())) > 1 and on_grid_edge(v, list(grid[k]))]
        entries[arm] = {
            "choice": values,
            "tuning_loss": means[choice],
            "points": len(means),
            "edges": edges,
            "edge_margins": edge_margins(choice, edges, settings),
            "profiles": knob_profiles(settings),
            "losses": means,
        }
    return entries


def tuning_grid(losses: dict[str, float]) -> dict[str, Any]:
    """A tuning grid as a table: one column per value of the last knob, one row per combination of the others
    (``rows``, ``columns`` in value order; ``cells`` keyed ``(row, column)``; ``row_knobs``, ``column_knob``)."""
    cells: dict[tuple[str, str], float] = {}
    row_order: dict[str, tuple] = {}
    row_knobs: list[str] = []
    column_knob = ""
    for setting, loss in losses.items():
        values = _setting_values(setting)
        if not values:
            continue
        *others, (column_knob, column) = values.items()
        row_knobs = [knob for knob, _ in others]
        row = ", ".join(_label(value) for _, value in others) or "-"
        row_order[row] = tuple(_value_order(_label(value)) for _, value in others)
        cells[(row, _label(column))] = loss
    columns = sorted({column for _, column in cells}, key=_value_order)
    return {
        "rows": sorted(row_order, key=row_order.get),
        "columns": columns,
        "cells": cells,
        "row_knobs": row_knobs,
        "column_knob": column_knob,
    }


def _choice_cell(entry: dict[str, Any]) -> tuple[str, str]:
    *others, last = entry["choice"].values()
    return ", ".join(_label(value) for value in others) or "-", _label(last)


CHOICE_NOTE = "the sweep's choice, or the lowest so far where the sweep has not chosen yet"


def with_sweep_choices(entries: dict[str, dict[str, Any]], chosen: dict[str, dict[str, Any]]) -> dict[str, dict]:
    """``tuning_so_far``'s entries with each arm's choice replaced by the sweep's own where its summary has one (the
    sweep's rule, a tie tolerance included, can choose other than the lowest loss)."""
    return {
        arm: {**entry, **({"choice": chosen[arm]["choice"]} if arm in chosen else {})} for arm, entry in entries.items()
    }


def tuning_grid_markdown(sweep: str, entries: dict[str, dict[str, Any]]) -> str:
    """Every tuning loss of every arm, one table per arm (the entry's choice in bold; "-": not run)."""
    lines = [f"### {sweep}: every tuning loss so far (mean over tuning seeds; bold: {CHOICE_NOTE})", ""]
    for arm, entry in entries.items():
        grid = tuning_grid(entry["losses"])
        corner = f"{', '.join(grid['row_knobs']) or '-'} (rows) / {grid['column_knob']} (columns)"
        lines += [f"**{arm}**", "", f"| {corner} | " + " | ".join(grid["columns"]) + " |"]
        lines.append("|---|" + "---|" * len(grid["columns"]))
        for row in grid["rows"]:
            cells = []
            for column in grid["columns"]:
                loss = grid["cells"].get((row, column))
                text = "-" if loss is None else f"{loss:.4f}"
                cells.append(f"**{text}**" if (row, column) == _choice_cell(entry) else text)
            lines.append(f"| {row} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


LOSS_FLOOR = 1e-5  # the heatmaps' lowest colour: tuning losses below it are saturated runs, equal for a reader


def plot_tuning_grids(entries: dict[str, dict[str, Any]], path: Path, title: str) -> Path | None:
    """One heatmap per arm of its tuning losses (log colour scale shared by all arms; grey: not run; the entry's
    choice outlined), the picture of where each arm learns that the tables spell out."""
    import numpy as np
    from matplotlib import colormaps
    from matplotlib.patches import Rectangle

    from qkmap_hf.plotting import new_figure, save_figure

    if not entries:
        return None
    grids = {arm: tuning_grid(entry["losses"]) for arm, entry in entries.items()}
    whole = tuning_grid({s: loss for entry in entries.values() for s, loss in entry["losses"].items()})
    row_labels, column_labels = whole["rows"], whole["columns"]  # every panel on the union: grey where not run
    finite = [v for g in grids.values() for v in g["cells"].values() if math.isfinite(v)]
    top = math.log10(max(max(finite, default=1.0), LOSS_FLOOR * 10))
    columns = min(3, len(grids))
    rows = math.ceil(len(grids) / columns)
    figure = new_figure(4.0 * columns + 1.0, 0.5 + 2.6 * rows, layout="constrained")
    axes = figure.subplots(rows, columns, squeeze=False)
    image, colours = None, colormaps["viridis"].with_extremes(bad="lightgrey")
    for axis, (arm, grid) in zip(axes.flat, grids.items(), strict=False):
        values = np.full((len(row_labels), len(column_labels)), np.nan)
        middle = (math.log10(LOSS_FLOOR) + top) / 2
        for (row, column), loss in grid["cells"].items():
            y, x, shade = row_labels.index(row), column_labels.index(column), math.log10(max(loss, LOSS_FLOOR))
            values[y, x] = shade
            colour = "white" if shade < middle else "black"
            axis.text(x, y, f"{loss:.2g}", ha="center", va="center", fontsize=6, color=colour)
        image = axis.imshow(
            np.ma.masked_invalid(values), cmap=colours, vmin=math.log10(LOSS_FLOOR), vmax=top, aspect="auto"
        )
        row, column = _choice_cell(entries[arm])
        if (row, column) in grid["cells"]:
            corner = (column_labels.index(column) - 0.5, row_labels.index(row) - 0.5)
            axis.add_patch(Rectangle(corner, 1, 1, fill=False, edgecolor="red", linewidth=2))
        axis.set_xticks(range(len(column_labels)), column_labels, fontsize=7)
        axis.set_yticks(range(len(row_labels)), row_labels, fontsize=7)
        axis.set_xlabel(grid["column_knob"], fontsize=8)
        axis.set_ylabel(", ".join(grid["row_knobs"]), fontsize=8)
        axis.set_title(arm, fontsize=9)
    for axis in list(axes.flat)[len(grids) :]:
        axis.set_visible(False)
    figure.colorbar(image, ax=axes, label="log10 tuning loss (nats/token)", shrink=0.8)
    figure.suptitle(textwrap.fill(title, 100), fontsize=9)
    return save_figure(figure, path)


def _edge_mark(margin: float | None) -> str:
    return "*" if margin is None else f"* (by {margin:.2g})"


def tuning_markdown(tuning: dict[str, dict[str, dict[str, Any]]]) -> str:
    lines = []
    for sweep, arms in tuning.items():
        knobs = sorted({k for a in arms.values() for k in a["choice"]})
        lines += [
            f"### {sweep}: tuning choices (lowest tuning-split loss; * on its grid's edge, with the edge's margin: the"
            " best loss at another value of that knob minus the choice's)",
            "",
            "| arm | " + " | ".join(knobs) + " | tuning loss | grid points |",
            "|---|" + "---|" * (len(knobs) + 2),
        ]
        for arm, a in sorted(arms.items()):
            margins = a.get("edge_margins", {})
            cells = [
                f"{a['choice'][k]:g}" + (_edge_mark(margins.get(k)) if k in a["edges"] else "")
                if k in a["choice"]
                else "-"
                for k in knobs
            ]
            loss = f"{a['tuning_loss']:.4f}" if a["tuning_loss"] is not None else "-"
            lines.append(f"| {arm} | " + " | ".join(cells) + f" | {loss} | {a['points']} |")
        lines.append("")
        for knob in knobs:
            values = list(dict.fromkeys(v for a in arms.values() for v in a.get("profiles", {}).get(knob, {})))
            if len(values) < 2:
                continue
            values.sort(key=_value_order)
            lines += [
                f"### {sweep}: best tuning loss at each {knob} (the lowest over the other knobs)",
                "",
                "| arm | " + " | ".join(values) + " |",
                "|---|" + "---|" * len(values),
            ]
            for arm, a in sorted(arms.items()):
                profile = a.get("profiles", {}).get(knob, {})
                lines.append(
                    f"| {arm} | " + " | ".join(f"{profile[v]:.4f}" if v in profile else "-" for v in values) + " |"
                )
            lines.append("")
    return "\n".join(lines)
