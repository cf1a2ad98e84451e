"""Accuracy report of a ``qkmap compare --task ... --tune`` sweep (``benchmarks/synthetic_tasks.sh``).

``python -m qkmap_hf.task_report SWEEP_DIR [SWEEP_DIR ...] --output-dir DIR`` reads the report runs of each sweep
(``runs/report/ARM/seedS/qkmap_training.json`` or ``models/ARM/seedS/...``: every arm at its tuned setting, fresh
seeds, report split) and writes ``task_report.json``, ``task_report.md`` and ``accuracy_curves.png``: per sweep and
arm the final report-split accuracy (mean over seeds, paired 95 % interval over seeds against ``standard`` and
``qk_norm``), the first evaluated step at which each seed reached 50 % and 90 % (the mean over seeds that did; how
many did), and the accuracy against training steps.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from .fileio import atomic_write_json, atomic_write_text
from .stability import BASELINES, TRAINING_RECORD
from .training.sweep import format_interval, paired_interval

THRESHOLDS = (0.5, 0.9)


def accuracy_curves(sweep: Path) -> dict[str, dict[int, list[tuple[int, float]]]]:
    """``{arm: {seed: [(step, eval_accuracy), ...]}}`` from a sweep's report runs (its ``shard-*`` folders too)."""
    curves: dict[str, dict[int, list[tuple[int, float]]]] = {}
    patterns = (f"runs/report/*/seed*/{TRAINING_RECORD}", f"models/*/seed*/{TRAINING_RECORD}")
    records = [r for folder in (sweep, *sweep.glob("shard-*")) for pattern in patterns for r in folder.glob(pattern)]
    for record in sorted(records):
        arm, seed = record.parent.parent.name, int(record.parent.name.removeprefix("seed"))
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
        for baseline in BASELINES:
            if arm != baseline and baseline in final:
                common = sorted(set(final[arm]) & set(final[baseline]))
                if common:
                    entry[f"vs_{baseline}"] = paired_interval([final[arm][s] - final[baseline][s] for s in common])
        summary[arm] = entry
    return summary


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
    from .plotting import new_figure, plot_mean_with_band, save_figure

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


def build_report(sweeps: list[Path], output: Path) -> dict[str, Any]:
    all_curves = {sweep.name: accuracy_curves(sweep) for sweep in sweeps}
    empty = [name for name, curves in all_curves.items() if not curves]
    if len(empty) == len(all_curves):
        raise FileNotFoundError(f"{', '.join(map(str, sweeps))}: no report runs with eval_accuracy yet.")
    reports = {name: summarize(curves) for name, curves in all_curves.items() if curves}
    output.mkdir(parents=True, exist_ok=True)
    atomic_write_json(output / "task_report.json", reports)
    atomic_write_text(output / "task_report.md", markdown(reports))
    plot({k: v for k, v in all_curves.items() if v}, output / "accuracy_curves.png")
    return reports


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m qkmap_hf.task_report", description=__doc__.splitlines()[0])
    parser.add_argument("sweeps", nargs="+", type=Path, help="qkmap compare --task --tune output folders")
    parser.add_argument("--output-dir", type=Path, required=True)
    args = parser.parse_args(argv)
    print(markdown(build_report(args.sweeps, args.output_dir)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
