"""Accuracy report of a ``qkmap compare --task ... --tune`` sweep (``benchmarks/synthetic_tasks.sh``).

``qkmap-lab task-report SWEEP_DIR [SWEEP_DIR ...] --output-dir DIR`` reads the report runs of each sweep
(``runs/report/ARM/seedS/qkmap_training.json`` or ``models/ARM/seedS/...``: every arm at its tuned setting, fresh
seeds, report split) and writes ``task_report.json``, ``task_report.md`` and ``accuracy_curves.png``: per sweep and
arm the final report-split accuracy (mean over seeds, paired 95 % interval over seeds against ``standard`` and
``qk_norm``), the first evaluated step at which each seed reached 50 % and 90 % (the mean over seeds that did; how
many did), the accuracy against training steps, and each arm's tuning choice (``tuning``: flagged where it sits
on its grid's edge, with the edge's margin, and the best tuning loss at each value of each knob).

With ``--generalize TASK@LENGTH,LENGTH ...`` it also loads each arm's saved report models (``--save-models``) and
scores them on other instances of their task (``task_probes.task_accuracy``: report-split sequences), e.g.
``mqar:num_pairs=4@64,128,256,512``: accuracy against the number of pairs and the length for models trained on
one instance, in ``generalization`` of the JSON, a table and ``generalization.png``; the scores are kept in the
output folder (``generalization_scores.json``, by model digest), so a rerun scores only models that changed. Where a sweep has
``analysis/task_analysis.json`` (``qkmap analyze --task`` on its saved models), ``probes`` holds the probes' headline
numbers per arm (``probe_measures``): the mean over seeds and paired intervals against the baselines.

``--tuning-only`` reads only the tuning runs in the ``sweep_losses.csv`` of each sweep and its shards, so it works
while a sweep runs or on CSVs restored from a committed copy: ``tuning.md`` (the lowest loss so far per arm, the
per-knob profiles, every grid point), ``tuning.json`` and one heatmap per sweep, ``tuning_grid-SWEEP.png`` (also
written by the full report).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import statistics
import textwrap
from pathlib import Path
from typing import Any

from qkmap_hf.fileio import atomic_write_json, atomic_write_text
from qkmap_hf.training.sweep import (
    choose_setting,
    format_interval,
    on_grid_edge,
    paired_interval,
    tuning_losses_so_far,
)
from qkmap_lab.stability import BASELINES, TRAINING_RECORD

THRESHOLDS = (0.5, 0.9)
VERDICT_NOTE = "paper_claims' rule: paired 95 % intervals over report seeds against every judged baseline"


def _sweep_folders(sweep: Path) -> list[Path]:
    """A sweep folder and its ``shard-*`` folders (``benchmarks/sharded_compare.sh``), which share data and seeds."""
    return [sweep, *sorted(sweep.glob("shard-*"))]


def arm_and_seed(run: Path) -> tuple[str, int]:
    """``(arm, seed)`` of a report run or saved model folder, ``.../ARM/seedS``."""
    return run.parent.name, int(run.name.removeprefix("seed"))


def accuracy_curves(sweep: Path) -> dict[str, dict[int, list[tuple[int, float]]]]:
    """``{arm: {seed: [(step, eval_accuracy), ...]}}`` from a sweep's report runs (its ``shard-*`` folders too)."""
    curves: dict[str, dict[int, list[tuple[int, float]]]] = {}
    patterns = (f"runs/report/*/seed*/{TRAINING_RECORD}", f"models/*/seed*/{TRAINING_RECORD}")
    records = [r for folder in _sweep_folders(sweep) for pattern in patterns for r in folder.glob(pattern)]
    for record in sorted(records):
        arm, seed = arm_and_seed(record.parent)
        history = json.loads(record.read_text()).get("log_history", [])
        points = [(int(h["step"]), float(h["eval_accuracy"])) for h in history if "eval_accuracy" in h]
        if points:
            curves.setdefault(arm, {})[seed] = points
    return curves


def first_step_reaching(points: list[tuple[int, float]], threshold: float) -> int | None:
    return next((step for step, accuracy in points if accuracy >= threshold), None)


def summarize(curves: dict[str, dict[int, list[tuple[int, float]]]]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    final = {arm: {seed: points[-1][1] for seed, points in seeds.items()} for arm, seeds in curves.items()}
    for arm, seeds in curves.items():
        entry: dict[str, Any] = {
            "seeds": sorted(seeds),
            "final_accuracy_by_seed": {str(s): v for s, v in sorted(final[arm].items())},
            "final_accuracy_mean": statistics.fmean(final[arm].values()),
        }
        for threshold in THRESHOLDS:
            reached = [first_step_reaching(points, threshold) for points in seeds.values()]
            hit = [s for s in reached if s is not None]
            entry[f"steps_to_{round(threshold * 100)}"] = {
                "mean": statistics.fmean(hit) if hit else None,
                "reached": f"{len(hit)}/{len(reached)}",
            }
        entry.update(versus_baselines(final, arm))
        summary[arm] = entry
    return summary


def versus_baselines(values: dict[str, dict[int, float]], arm: str) -> dict[str, Any]:
    """``{"vs_standard": paired interval, "vs_qk_norm": ...}`` of ``values[arm][seed]`` over the seeds it shares
    with each baseline (none for the baseline itself or a missing one)."""
    entry = {}
    for baseline in BASELINES:
        if arm != baseline and baseline in values:
            common = sorted(set(values[arm]) & set(values[baseline]))
            if common:
                entry[f"vs_{baseline}"] = paired_interval([values[arm][s] - values[baseline][s] for s in common])
    return entry


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


PROBE_ANALYSIS = Path("analysis") / "task_analysis.json"  # where benchmarks/synthetic_tasks.sh writes the probes


def probe_measures(entry: dict[str, Any]) -> dict[str, float]:
    """The headline numbers of one model's ``task_probes`` result: accuracy, the evidence contrast (mean over
    heads and layers; the best head) and, per key scale, the share of answers changed and the change of the
    attention mass on the evidence key (mean over layers)."""
    contrast, scale = entry["evidence_contrast"], entry["evidence_key_scale"]
    measures = {
        "accuracy": entry["accuracy"],
        # MQAR's later answers can be had by elimination (the context value not yet answered); its first answer
        # cannot: above chance only by matching the asked key (docs/synthetic-tasks.md).
        "first_answer_accuracy": scale["accuracy_first_query"],
        "evidence_log2_lift": contrast["mean_log2_lift"],
        "best_head_log2_lift": contrast["best_head_log2_lift"],
    }
    for factor, result in scale["by_factor"].items():
        measures[f"answers_changed_x{factor}"] = result["answers_changed"]
        measures[f"key_mass_change_x{factor}"] = statistics.fmean(result["layer_key_mass_change"])
    return measures


def probe_summary(sweep: Path) -> dict[str, Any]:
    """Per arm and measure of ``probe_measures``: the mean over the seeds probed and paired intervals against the
    baselines, from the sweep's ``analysis/task_analysis.json`` (models named ``.../ARM/seedS``). Empty when the
    sweep has no probes."""
    path = sweep / PROBE_ANALYSIS
    if not path.is_file():
        return {}
    by_measure: dict[str, dict[str, dict[int, float]]] = {}
    for entry in json.loads(path.read_text())["models"]:
        arm, seed = arm_and_seed(Path(entry["model"]))
        for name, value in probe_measures(entry).items():
            by_measure.setdefault(name, {}).setdefault(arm, {})[seed] = value
    summary: dict[str, Any] = {}
    for name, values in by_measure.items():
        for arm, seeds in values.items():
            summary.setdefault(arm, {})[name] = {
                "mean": statistics.fmean(seeds.values()),
                "seeds": sorted(seeds),
                **versus_baselines(values, arm),
            }
    return summary


def task_claims() -> dict[str, Any]:
    """The claims judged on a task, each a ``paper_claims.Metric`` named after a measure of ``probe_measures`` (or
    the final accuracy): the paper's direction and the baselines judged, for ``paper_claims``' one verdict rule
    (the values come from the report's tables, so no ``extract`` is needed)."""
    from qkmap_lab.paper_claims import Metric
    from qkmap_lab.task_probes import DEFAULT_KEY_SCALES

    return {
        "final_accuracy": Metric("final_accuracy", "higher accuracy (claim 1 on the task)", lambda _: None, +1),
        "evidence_log2_lift": Metric(
            "evidence_log2_lift", "stronger contrast on the evidence (claim 4)", lambda _: None, +1
        ),
        **{
            f"answers_changed_x{factor:g}": Metric(
                f"answers_changed_x{factor:g}",
                f"answers follow the evidence key's scale, x{factor:g} (claim 2)",
                lambda _: None,
                +1,
                baselines=("qk_norm",),
            )
            for factor in sorted(DEFAULT_KEY_SCALES, reverse=True)
        },
    }


def claim_verdicts(accuracy: dict[str, Any], probes: dict[str, Any]) -> dict[str, str]:
    """``{claim label: verdict}`` for one sweep: ``qk_map`` against the baselines, over the report seeds."""
    from qkmap_lab.paper_claims import verdict

    verdicts = {}
    for name, metric in task_claims().items():
        if name == "final_accuracy":
            table = accuracy
        else:
            table = {arm: measures[name] for arm, measures in probes.items() if name in measures}
        if table:
            verdicts[metric.label] = verdict(table, metric)
    return verdicts


def probe_markdown(probes: dict[str, dict[str, Any]]) -> str:
    lines = []
    for sweep, arms in probes.items():
        factors = sorted(
            {k.removeprefix("answers_changed_x") for a in arms.values() for k in a if "answers" in k}, key=float
        )
        lines += [
            f"### {sweep}: probes (qkmap analyze --task; mean over seeds, paired 95 % intervals)",
            "",
            "| arm | seeds | accuracy | first answer | evidence log2 lift | vs standard | vs qk_norm | best head | "
            + " | ".join(f"answers changed, key x{f}" for f in factors)
            + " | "
            + " | ".join(f"key mass change x{f}" for f in factors)
            + " |",
            "|---|---|---|---|---|---|---|---|" + "---|" * (2 * len(factors)),
        ]
        for arm, m in arms.items():
            lift = m["evidence_log2_lift"]
            cells = [
                arm, str(len(m["accuracy"]["seeds"])), f"{m['accuracy']['mean']:.3f}",
                f"{m['first_answer_accuracy']['mean']:.3f}", f"{lift['mean']:+.2f}",
                format_interval(lift.get("vs_standard"), ".2f"),
                format_interval(lift.get("vs_qk_norm"), ".2f"), f"{m['best_head_log2_lift']['mean']:+.2f}",
                *(f"{m[f'answers_changed_x{f}']['mean']:.3f}" for f in factors),
                *(f"{m[f'key_mass_change_x{f}']['mean']:+.4f}" for f in factors),
            ]  # fmt: skip
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def markdown(reports: dict[str, dict[str, Any]]) -> str:
    lines = []
    for sweep, summary in reports.items():
        lines += [
            f"### {sweep}",
            "",
            "| arm | seeds | final accuracy | steps to 50 % (reached) | steps to 90 % (reached) | vs standard | vs qk_norm |",
            "|---|---|---|---|---|---|---|",
        ]
        for arm, e in summary.items():
            steps = [
                f"{e[k]['mean']:.0f} ({e[k]['reached']})" if e[k]["mean"] is not None else f"- ({e[k]['reached']})"
                for k in ("steps_to_50", "steps_to_90")
            ]
            lines.append(
                f"| {arm} | {len(e['seeds'])} | {e['final_accuracy_mean']:.3f} | {steps[0]} | {steps[1]} "
                f"| {format_interval(e.get('vs_standard'), '.3f')} | {format_interval(e.get('vs_qk_norm'), '.3f')} |"
            )
        lines.append("")
    return "\n".join(lines)


def plot(all_curves: dict[str, dict], path: Path) -> Path | None:
    from qkmap_hf.plotting import new_figure, plot_mean_with_band, save_figure

    if not all_curves:
        return None
    figure = new_figure(6.0 * len(all_curves), 4.2)
    for index, (sweep, curves) in enumerate(all_curves.items(), 1):
        axis = figure.add_subplot(1, len(all_curves), index)
        by_arm = {
            arm: {step: [dict(points)[step] for points in seeds.values() if step in dict(points)] for step in
                  sorted({s for points in seeds.values() for s, _ in points})}
            for arm, seeds in curves.items()
        }  # fmt: skip
        plot_mean_with_band(axis, by_arm)
        axis.set_ylim(0, 1)
        axis.set_title(sweep, fontsize=9)
        axis.set_xlabel("optimizer step")
        axis.set_ylabel("report-split answer accuracy")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=7)
    return save_figure(figure, path)


def parse_generalize(spec: str) -> tuple[str, list[int]]:
    """``TASK@LENGTH,LENGTH,...`` -> ``(task spec, lengths)``; the task is checked by ``parse_task``."""
    from qkmap_lab.synthetic import parse_task, task_spec

    task, at, lengths = spec.rpartition("@")
    try:
        values = [int(v) for v in lengths.split(",")]
    except ValueError:
        values = []
    if not at or not values or min(values) <= 0:
        raise ValueError(f"--generalize {spec!r}: expected TASK@LENGTH[,LENGTH...], e.g. mqar:num_pairs=4@64,128.")
    return task_spec(parse_task(task)), values


def saved_models(sweep: Path) -> dict[str, dict[int, Path]]:
    """``{arm: {seed: folder}}`` of a sweep's saved report models (its ``shard-*`` folders too)."""
    found: dict[str, dict[int, Path]] = {}
    for folder in sorted(f for base in _sweep_folders(sweep) for f in base.glob("models/*/seed*")):
        if (folder / "config.json").is_file():
            arm, seed = arm_and_seed(folder)
            found.setdefault(arm, {})[seed] = folder
    return found


SCORES_FILE = "generalization_scores.json"  # in the report's output folder: scores already computed, by model digest


def model_digest(folder: Path) -> str:
    """sha256 of a saved model's config and weights: a score computed for these bytes holds for them alone (a report
    run retrained at a new tuning choice overwrites its folder, and gets a new digest)."""
    digest = hashlib.sha256()
    for name in ["config.json", *sorted(p.name for p in folder.glob("*.safetensors"))]:
        digest.update(name.encode())
        digest.update((folder / name).read_bytes())
    return digest.hexdigest()


def generalization(
    sweep: Path, specs: list[tuple[str, list[int]]], examples: int = 128, scores: Path | None = None
) -> dict[str, Any]:
    """``{task spec: {arm: {length: [accuracy per seed]}}}`` of a sweep's saved models on the given instances; only
    the instances of the sweep's own task (by name) are scored.

    ``scores`` (a JSON file) keeps every accuracy under its model's digest, spec, length and example count, written
    after each model: a rerun after a widened tuning grid scores only the retrained models, and an interrupted
    one loses at most one model's work. Scoring is deterministic (fixed report-split sequences), so a kept score is
    the score."""
    from tqdm.auto import tqdm

    from qkmap_hf.analysis import load_for_analysis
    from qkmap_lab.synthetic import parse_task
    from qkmap_lab.task_probes import task_accuracy

    models = saved_models(sweep)
    trained = _trained_task(models)
    specs = [(spec, lengths) for spec, lengths in specs if trained is None or spec.partition(":")[0] == trained]
    tasks = {spec: parse_task(spec) for spec, _ in specs}
    kept: dict[str, float] = json.loads(scores.read_text()) if scores is not None and scores.is_file() else {}
    folders = [(arm, folder) for arm, seeds in models.items() for _, folder in sorted(seeds.items())]
    result: dict[str, Any] = {}
    for arm, folder in tqdm(folders, desc=f"generalization {sweep.name}", unit="model"):
        digest, model = model_digest(folder), None
        for spec, lengths in specs:
            for length in lengths:
                key = f"{digest} {spec} {length} {examples}"
                if key not in kept:
                    model = model if model is not None else load_for_analysis(folder)[0]
                    kept[key] = task_accuracy(model, tasks[spec], length, examples)
                result.setdefault(spec, {}).setdefault(arm, {}).setdefault(str(length), []).append(kept[key])
        if scores is not None and model is not None:
            atomic_write_json(scores, kept)
    return {spec: result[spec] for spec, _ in specs if spec in result}


def _trained_task(models: dict[str, dict[int, Path]]) -> str | None:
    """The task name a sweep's models trained on, from a training record (None when no record says)."""
    for seeds in models.values():
        for folder in seeds.values():
            record = folder / TRAINING_RECORD
            if record.is_file():
                task = json.loads(record.read_text()).get("data", {}).get("extra", {}).get("task")
                if task:
                    return str(task).partition(":")[0]
    return None


def generalization_markdown(results: dict[str, dict[str, Any]]) -> str:
    lines = []
    for sweep, by_spec in results.items():
        for spec, arms in by_spec.items():
            lengths = sorted({int(n) for values in arms.values() for n in values})
            lines += [
                f"### {sweep}: scored on {spec} (mean accuracy over seeds [min-max])",
                "",
                "| arm | " + " | ".join(f"T = {n}" for n in lengths) + " |",
                "|---|" + "---|" * len(lengths),
            ]
            for arm, values in arms.items():
                cells = [
                    f"{statistics.fmean(v):.3f} [{min(v):.2f}-{max(v):.2f}]" if (v := values.get(str(n))) else "-"
                    for n in lengths
                ]
                lines.append(f"| {arm} | " + " | ".join(cells) + " |")
            lines.append("")
    return "\n".join(lines)


def plot_generalization(results: dict[str, dict[str, Any]], path: Path) -> Path | None:
    from qkmap_hf.plotting import new_figure, save_figure

    panels = [(sweep, spec, arms) for sweep, by_spec in results.items() for spec, arms in by_spec.items()]
    if not panels:
        return None
    figure = new_figure(5.0 * len(panels), 4.0)
    for index, (sweep, spec, arms) in enumerate(panels, 1):
        axis = figure.add_subplot(1, len(panels), index)
        for arm, values in arms.items():
            lengths = sorted(values, key=int)
            axis.plot([int(n) for n in lengths], [statistics.fmean(values[n]) for n in lengths], marker="o", label=arm)
        axis.set_xscale("log", base=2)
        axis.set_ylim(0, 1)
        scored = textwrap.fill(f"scored on {spec.replace(',', ', ')}", 60)  # full specs are wider than a panel
        axis.set_title(f"{sweep}\n{scored}", fontsize=7)
        axis.set_xlabel("sequence length")
        axis.set_ylabel("answer accuracy (mean over seeds)")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=6)
    return save_figure(figure, path)


def build_report(
    sweeps: list[Path], output: Path, generalize: list[tuple[str, list[int]]] | None = None
) -> dict[str, Any]:
    all_curves = {sweep.name: accuracy_curves(sweep) for sweep in sweeps}
    empty = [name for name, curves in all_curves.items() if not curves]
    if len(empty) == len(all_curves):
        raise FileNotFoundError(f"{', '.join(map(str, sweeps))}: no report runs with eval_accuracy yet.")
    reports = {name: summarize(curves) for name, curves in all_curves.items() if curves}
    output.mkdir(parents=True, exist_ok=True)
    text = markdown(reports)
    tuning = {sweep.name: choices for sweep in sweeps if (choices := tuning_choices(sweep))}
    if tuning:
        text += "\n" + tuning_markdown(tuning)
        reports = {**reports, "tuning": tuning}
    probes = {sweep.name: summary for sweep in sweeps if (summary := probe_summary(sweep))}
    if probes:
        text += "\n" + probe_markdown(probes)
        reports = {**reports, "probes": probes}
    verdicts = {name: claim_verdicts(reports[name], probes.get(name, {})) for name in all_curves if name in reports}
    reports = {**reports, "verdicts": verdicts}
    for name, by_claim in verdicts.items():
        text += f"\n### {name}: verdicts for qk_map ({VERDICT_NOTE})\n\n"
        text += "\n".join(f"- {claim}: **{result}**" for claim, result in by_claim.items()) + "\n"
    for name, entries in (
        (sweep.name, with_sweep_choices(tuning_so_far(sweep), tuning.get(sweep.name, {}))) for sweep in sweeps
    ):
        if entries:
            text += "\n" + tuning_grid_markdown(name, entries)
            plot_tuning_grids(entries, output / f"tuning_grid-{name}.png", f"{name}: tuning loss per grid point")
    plot({k: v for k, v in all_curves.items() if v}, output / "accuracy_curves.png")
    if generalize:
        scored = {sweep.name: generalization(sweep, generalize, scores=output / SCORES_FILE) for sweep in sweeps}
        scored = {name: by_spec for name, by_spec in scored.items() if by_spec}
        text += "\n" + generalization_markdown(scored)
        plot_generalization(scored, output / "generalization.png")
        reports = {**reports, "generalization": scored}
    atomic_write_json(output / "task_report.json", reports)
    atomic_write_text(output / "task_report.md", text)
    return reports


def build_tuning_report(sweeps: list[Path], output: Path) -> dict[str, Any]:
    """The tuning part alone, from the sweeps' CSVs (no report run needed, so it reads a sweep still running):
    ``tuning.md`` (choices so far, per-knob profiles, every grid point), ``tuning.json``, ``tuning_grid-SWEEP.png``."""
    tuning = {sweep.name: entries for sweep in sweeps if (entries := tuning_so_far(sweep))}
    if not tuning:
        raise FileNotFoundError(f"{', '.join(map(str, sweeps))}: no finished tuning run in any sweep_losses.csv.")
    output.mkdir(parents=True, exist_ok=True)
    runs = sum(entry["points"] for entries in tuning.values() for entry in entries.values())
    text = (
        f"From every tuning run finished so far ({runs} grid points): a choice here is the lowest loss so far, the "
        "sweep's own choice only once its grid has run.\n\n" + tuning_markdown(tuning)
    )
    for name, entries in tuning.items():
        text += "\n" + tuning_grid_markdown(name, entries)
        plot_tuning_grids(entries, output / f"tuning_grid-{name}.png", f"{name}: tuning loss per grid point")
    atomic_write_json(output / "tuning.json", tuning)
    atomic_write_text(output / "tuning.md", text)
    return tuning


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="qkmap-lab task-report", description=__doc__.splitlines()[0])
    parser.add_argument("sweeps", nargs="+", type=Path, help="qkmap compare --task --tune output folders")
    parser.add_argument("--output-dir", type=Path, required=True)
    parser.add_argument(
        "--generalize", nargs="+", default=[], metavar="TASK@LENGTHS",
        help="score the saved report models on these instances too, e.g. mqar:num_pairs=4@64,128,256",
    )  # fmt: skip
    parser.add_argument(
        "--tuning-only", action="store_true",
        help="only the tuning tables and heatmaps, from sweep_losses.csv (works while the sweep runs): tuning.md",
    )  # fmt: skip
    args = parser.parse_args(argv)
    try:
        generalize = [parse_generalize(spec) for spec in args.generalize]
    except ValueError as error:
        parser.error(str(error))
    if args.tuning_only:
        if generalize:
            parser.error("--generalize scores saved report models; --tuning-only reads tuning runs only.")
        build_tuning_report(args.sweeps, args.output_dir)
        print((args.output_dir / "tuning.md").read_text())
        return 0
    build_report(args.sweeps, args.output_dir, generalize)
    print((args.output_dir / "task_report.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
