"""The generalization half of the synthetic-task report: each arm's saved report models scored on other instances
of their task (``qkmap-lab task-report --generalize TASK@LENGTH,...``), with scores cached by model digest."""

from __future__ import annotations

import hashlib
import json
import statistics
import textwrap
from pathlib import Path
from typing import Any

from qkmap_hf.fileio import atomic_write_json
from qkmap_lab.stability import TRAINING_RECORD
from qkmap_lab.task_tuning import _sweep_folders, arm_and_seed


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
