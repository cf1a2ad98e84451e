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
import json
import statistics
from pathlib import Path
from typing import Any

from qkmap_hf.fileio import atomic_write_json, atomic_write_text
from qkmap_hf.training.sweep import (
    format_interval,
    paired_interval,
)
from qkmap_lab.stability import BASELINES, TRAINING_RECORD
from qkmap_lab.task_generalization import (
    SCORES_FILE,
    generalization,
    generalization_markdown,
    parse_generalize,
    plot_generalization,
)
from qkmap_lab.task_tuning import (
    _sweep_folders,
    arm_and_seed,
    plot_tuning_grids,
    tuning_choices,
    tuning_grid_markdown,
    tuning_markdown,
    tuning_so_far,
    with_sweep_choices,
)

THRESHOLDS = (0.5, 0.9)
VERDICT_NOTE = "paper_claims' rule: paired 95 % intervals over report seeds against every judged baseline"


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


PROBE_ANALYSIS = Path("analysis") / "task_analysis.json"  # where benchmarks/synthetic_tasks.sh writes the probes


def probe_measures(entry: dict[str, Any]) -> dict[str, float]:
    """The headline numbers of one model's ``task_probes`` result: accuracy, the evidence contrast (mean over
    heads and layers; the best head) and, per key scale, the share of answers changed and the change of the
    attention mass on the evidence key (mean over layers)."""
    contrast, scale = entry["evidence_contrast"], entry["evidence_key_scale"]
    measures = {
        "accuracy": entry["accuracy"],
        # MQAR's later answers can be had by elimination (the context value not yet answered); its first answer
        # cannot: above chance only by matching the asked key (qkmap_lab/notes/synthetic-tasks.md).
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
