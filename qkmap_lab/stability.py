"""Stability report of a learning-rate sweep (``benchmarks/stability.sh``; qkmap_lab/notes/stability.md).

``qkmap-lab stability SWEEP_DIR [--output-dir DIR]`` reads every ``qkmap compare --tune learning_rate=...``
sweep under ``SWEEP_DIR`` (the folder itself or its ``shard-*`` folders, which share data split and seeds) and writes
``stability.json``, ``stability.md`` and three figures:

- ``loss_vs_lr.png``: final tuning-split loss against learning rate per arm (the figure of Wortsman et al. 2023,
  "Small-scale proxies for large-scale Transformer training instabilities"); diverged runs are drawn at ``L0``;
- ``max_logit_vs_lr.png``: the monitor's largest attention logit at the end of each tuning run against learning
  rate (attention-logit growth);
- ``monitor_at_max_stable.png``: the monitor's curves of every arm at the highest learning rate it survived.

Per arm: ``L0`` (the held-out loss at initialisation), the learning-rate sensitivity ``mean_lr [min(L(lr), L0) -
min_lr L(lr)]``, the largest stable rate (not stopped as diverged and ending below ``L0``), the choice (lowest tuning
loss; flagged when it is on the grid's edge, which means the grid was too small) and, from the report runs, the
report-split loss per seed with paired 95 % intervals against ``standard`` and ``qk_norm`` over the report seeds.
A sweep still running gives a partial report: missing runs are listed, never guessed.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qkmap_hf.fileio import atomic_write_json, atomic_write_text
from qkmap_hf.filenames import PROVENANCE_FILES
from qkmap_hf.monitoring import monitor_series
from qkmap_hf.training.sweep import DIVERGED_FILE, forget_diverged, format_interval, on_grid_edge, paired_interval

BASELINES = ("standard", "qk_norm")
LEARNING_RATE = "learning_rate"
TRAINING_RECORD = PROVENANCE_FILES["training"]  # each run's qkmap_training.json: its log history, the monitor's too


@dataclass
class ArmStability:
    """One arm's learning-rate curve and report runs."""

    arm: str
    initial_loss: float | None = None
    tuning: dict[float, float] = field(default_factory=dict)  # learning rate -> final tuning-split loss
    diverged: dict[float, str] = field(default_factory=dict)  # learning rate -> why it was stopped
    final_max_logit: dict[float, float] = field(default_factory=dict)
    report: dict[int, float] = field(default_factory=dict)  # report seed -> final report-split loss
    report_setting: str | None = None
    shard: Path | None = None

    @property
    def choice(self) -> float | None:
        return min(self.tuning, key=self.tuning.get) if self.tuning else None

    def sensitivity(self) -> float | None:
        """Wortsman et al.'s learning-rate sensitivity over the rates run so far."""
        if not self.tuning or self.initial_loss is None:
            return None
        best = min(self.tuning.values())
        return statistics.fmean(min(loss, self.initial_loss) - best for loss in self.tuning.values())

    def largest_stable(self) -> float | None:
        stable = [
            lr
            for lr, loss in self.tuning.items()
            if lr not in self.diverged
            and math.isfinite(loss)
            and (self.initial_loss is None or loss < self.initial_loss)
        ]
        return max(stable) if stable else None


def _learning_rate(setting: str) -> float | None:
    for part in setting.split(";"):  # sweep.setting_id joins knobs with ";"
        name, _, value = part.partition("=")
        if name == LEARNING_RATE:
            return float(value)
    return None


def sweep_folders(root: Path) -> list[Path]:
    """``root`` if it holds a sweep, else its ``shard-*`` folders that do."""
    if (root / "sweep_losses.csv").exists():
        return [root]
    return sorted(p for p in root.glob("shard-*") if (p / "sweep_losses.csv").exists())


def collect(root: Path) -> dict[str, ArmStability]:
    """Every arm's numbers from the sweep folders under ``root``."""
    arms: dict[str, ArmStability] = {}
    for folder in sweep_folders(root):
        with (folder / "sweep_losses.csv").open() as handle:
            rows = list(csv.DictReader(handle))
        steps = max((int(r["step"]) for r in rows), default=0)
        diverged = json.loads((folder / DIVERGED_FILE).read_text()) if (folder / DIVERGED_FILE).exists() else {}
        settings_path = folder / "compare.json"
        if settings_path.exists():
            steps = json.loads(settings_path.read_text()).get("steps", steps)
        starts: dict[str, list[float]] = defaultdict(list)
        for r in rows:
            arm = arms.setdefault(r["arm"], ArmStability(r["arm"], shard=folder))
            lr, loss, step = _learning_rate(r["setting"]), float(r["loss"]), int(r["step"])
            if r["split"] != "validation":
                continue
            if r["phase"] == "tune" and step == 0:
                starts[r["arm"]].append(loss)
            if step != steps:
                continue
            if r["phase"] == "tune" and lr is not None:
                arm.tuning[lr] = loss
            elif r["phase"] == "report":
                arm.report[int(r["seed"])] = loss
                arm.report_setting = r["setting"]
        for arm_name, values in starts.items():
            arms[arm_name].initial_loss = statistics.fmean(values)
        for key, record in diverged.items():
            arm_name, phase, setting, _seed = key.split("/")
            lr = _learning_rate(setting)
            if phase == "tune" and lr is not None and arm_name in arms:
                arms[arm_name].diverged[lr] = record["reason"]
        for arm in arms.values():
            if arm.shard != folder:
                continue
            for lr in arm.tuning:
                history = tuning_history(folder, arm.arm, lr)
                curve = monitor_series(history).get("max_logit") if history else None
                if curve:
                    arm.final_max_logit[lr] = curve[-1][1]
    return arms


def _setting_folder(folder: Path, arm: str, lr: float) -> Path | None:
    for run in (folder / "runs" / "tune").glob(f"{arm}-{LEARNING_RATE}=*"):
        value = run.name[len(arm) + 1 :].rsplit("-seed", 1)[0]
        if _learning_rate(value) == lr:
            return run
    return None


def tuning_history(folder: Path, arm: str, lr: float) -> list[dict] | None:
    """The Trainer log history of one tuning run (its ``qkmap_training.json``), or None when it is not there."""
    run = _setting_folder(folder, arm, lr)
    record = run / TRAINING_RECORD if run else None
    if record is None or not record.exists():
        return None
    return json.loads(record.read_text()).get("log_history")


def summarize(arms: dict[str, ArmStability], grid: list[float]) -> dict[str, Any]:
    """The report's numbers: per arm the curve, sensitivity, largest stable rate, choice and paired intervals."""
    result: dict[str, Any] = {"grid": grid, "arms": {}}
    for name, arm in arms.items():
        choice = arm.choice
        missing = [lr for lr in grid if lr not in arm.tuning]
        entry = {
            "initial_loss": arm.initial_loss,
            "loss_by_lr": {repr(lr): arm.tuning[lr] for lr in sorted(arm.tuning)},
            "diverged": {repr(lr): why for lr, why in sorted(arm.diverged.items())},
            "final_max_logit_by_lr": {repr(lr): v for lr, v in sorted(arm.final_max_logit.items())},
            "missing_rates": missing,
            "sensitivity": arm.sensitivity(),
            "largest_stable_rate": arm.largest_stable(),
            "choice": choice,
            "choice_on_grid_edge": bool(choice is not None and not missing and on_grid_edge(choice, grid)),
            "report_setting": arm.report_setting,
            "report_loss_by_seed": {str(s): v for s, v in sorted(arm.report.items())},
            "report_loss_mean": statistics.fmean(arm.report.values()) if arm.report else None,
        }
        for baseline in BASELINES:
            reference = arms.get(baseline)
            if name == baseline or reference is None:
                continue
            seeds = sorted(set(arm.report) & set(reference.report))
            if seeds:
                entry[f"vs_{baseline}"] = paired_interval([arm.report[s] - reference.report[s] for s in seeds])
        result["arms"][name] = entry
    return result


def _cell(value: float | None, spec: str = ".4f") -> str:
    return "" if value is None else f"{value:{spec}}"


def markdown(summary: dict[str, Any]) -> str:
    grid = summary["grid"]
    lines = [
        "Final tuning-split loss (nats/token) per learning rate; `div` = stopped as diverged (recorded at L0).",
        "",
        "| arm | L0 | " + " | ".join(f"{lr:g}" for lr in grid) + " | sensitivity | largest stable | choice |",
        "|---|---|" + "---|" * len(grid) + "---|---|---|",
    ]
    for name, arm in summary["arms"].items():
        cells = []
        for lr in grid:
            loss = arm["loss_by_lr"].get(repr(lr))
            cells.append("" if loss is None else ("div" if repr(lr) in arm["diverged"] else f"{loss:.3f}"))
        edge = " (grid edge)" if arm["choice_on_grid_edge"] else ""
        lines.append(
            f"| {name} | {_cell(arm['initial_loss'], '.3f')} | "
            + " | ".join(cells)
            + f" | {_cell(arm['sensitivity'])} | "
            f"{_cell(arm['largest_stable_rate'], 'g')} | {_cell(arm['choice'], 'g')}{edge} |"
        )
    lines += [
        "",
        "Report split, each arm at its own chosen rate, report seeds; paired differences mean [95 % t interval over "
        "seeds]:",
        "",
        "| arm | rate | seeds | mean loss | vs standard | vs qk_norm |",
        "|---|---|---|---|---|---|",
    ]
    for name, arm in summary["arms"].items():
        if not arm["report_loss_by_seed"]:
            continue
        lines.append(
            f"| {name} | {arm['report_setting']} | {len(arm['report_loss_by_seed'])} | {_cell(arm['report_loss_mean'])} "
            f"| {format_interval(arm.get('vs_standard'))} | {format_interval(arm.get('vs_qk_norm'))} |"
        )
    missing = {name: arm["missing_rates"] for name, arm in summary["arms"].items() if arm["missing_rates"]}
    if missing:
        lines += [
            "",
            "Not run yet: " + "; ".join(f"{k}: {', '.join(f'{lr:g}' for lr in v)}" for k, v in missing.items()),
        ]
    return "\n".join(lines) + "\n"


def plot_curves(arms: dict[str, ArmStability], output: Path) -> list[Path]:
    """``loss_vs_lr.png`` and ``max_logit_vs_lr.png`` (diverged runs marked with a cross)."""
    from qkmap_hf.plotting import new_figure, save_figure

    paths = []
    for name, values_of, label, yscale in (
        ("loss_vs_lr.png", lambda a: a.tuning, "final tuning-split loss (nats/token)", "linear"),
        ("max_logit_vs_lr.png", lambda a: a.final_max_logit, "largest attention logit at the end", "symlog"),
    ):
        figure = new_figure(7.5, 4.8)
        axis = figure.add_subplot()
        for arm in arms.values():
            points = sorted(values_of(arm).items())
            if not points:
                continue
            rates, values = zip(*points, strict=True)
            (line,) = axis.plot(rates, values, marker="o", label=arm.arm, linewidth=1.3)
            crosses = [(lr, v) for lr, v in points if lr in arm.diverged]
            if crosses:
                axis.plot(*zip(*crosses, strict=True), "x", color=line.get_color(), markersize=10)
        axis.set_xscale("log")
        axis.set_yscale(yscale)  # logits grow by orders of magnitude where attention collapses
        axis.set_xlabel("learning rate (every parameter group)")
        axis.set_ylabel(label)
        axis.grid(alpha=0.3)
        axis.legend(fontsize=7)
        paths.append(save_figure(figure, output / name))
    return paths


def plot_monitor_at_max_stable(arms: dict[str, ArmStability], output: Path) -> Path | None:
    """Max logit and mean entropy (worst layer) against step for each arm at its largest stable rate."""
    from qkmap_hf.plotting import new_figure, save_figure

    curves = {}
    for arm in arms.values():
        lr = arm.largest_stable()
        history = tuning_history(arm.shard, arm.arm, lr) if lr is not None and arm.shard else None
        if history:
            curves[f"{arm.arm} @ {lr:g}"] = monitor_series(history)
    if not curves:
        return None
    figure = new_figure(12, 4.2)
    for index, (measure, label) in enumerate(
        (("max_logit", "largest attention logit"), ("entropy_min", "attention entropy, lowest layer/head mean")), 1
    ):
        axis = figure.add_subplot(1, 2, index)
        for name, series in curves.items():
            if measure in series:
                steps, values = zip(*series[measure], strict=True)
                axis.plot(steps, values, label=name, linewidth=1.2)
        axis.set_xlabel("optimizer step")
        if measure == "max_logit":
            axis.set_yscale("symlog")
        axis.set_title(label, fontsize=10)
        axis.grid(alpha=0.3)
        if index == 1:
            axis.legend(fontsize=7)
    return save_figure(figure, output / "monitor_at_max_stable.png")


def build_report(root: Path, output: Path, grid: list[float] | None = None) -> dict[str, Any]:
    """Collect, summarize, write ``stability.json``/``stability.md`` and the figures into ``output``."""
    arms = collect(root)
    if not arms:
        raise FileNotFoundError(f"{root}: no sweep_losses.csv here or in shard-*/; run benchmarks/stability.sh first.")
    grid = grid or sorted({lr for arm in arms.values() for lr in arm.tuning})
    output.mkdir(parents=True, exist_ok=True)
    summary = summarize(arms, grid)
    atomic_write_json(output / "stability.json", summary)
    atomic_write_text(output / "stability.md", markdown(summary))
    plot_curves(arms, output)
    plot_monitor_at_max_stable(arms, output)
    return summary


ARCHIVED = ("sweep_losses.csv", "timing.json", DIVERGED_FILE, "compare.json", "summary.json", "summary.md")


def archive(root: Path, destination: Path) -> list[Path]:
    """Copy what a sweep needs to be reported or resumed (the CSVs, records and each run's ``qkmap_training.json``,
    not weights or plots) from ``root`` into ``destination``, same layout; ``cp -r DEST/. ROOT/`` restores it."""
    from qkmap_hf.fileio import atomic_write_text

    copied = []
    for folder in sweep_folders(root):
        relative = folder.relative_to(root)
        files = [folder / name for name in ARCHIVED if (folder / name).is_file()]
        files += sorted(folder.glob(f"runs/*/*/{TRAINING_RECORD}")) + sorted(
            folder.glob(f"runs/report/*/*/{TRAINING_RECORD}")
        )
        files += sorted(folder.glob(f"models/*/*/{TRAINING_RECORD}"))
        for source in files:
            target = destination / relative / source.relative_to(folder)
            target.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(target, source.read_text())
            copied.append(target)
    return copied


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="qkmap-lab stability", description=__doc__.splitlines()[0])
    parser.add_argument("sweep_dir", type=Path, help="a qkmap compare --tune folder, or one with shard-* folders")
    parser.add_argument("--output-dir", type=Path, help="where the report goes (default: SWEEP_DIR/report)")
    parser.add_argument("--grid", help="the learning rates of the sweep, comma-separated (default: those found)")
    parser.add_argument("--archive", type=Path, help="also copy the sweep's records (no weights) into this folder")
    parser.add_argument(
        "--forget-diverged",
        action="store_true",
        help="remove the runs recorded as diverged (records and folders) so that resuming the sweep makes them again "
        "under the current divergence rule; writes no report",
    )
    args = parser.parse_args(argv)
    if args.forget_diverged:
        for folder in sweep_folders(args.sweep_dir):
            for key in forget_diverged(folder):
                print(f"{folder}: forgot {key}")
        return 0
    grid = [float(v) for v in args.grid.split(",")] if args.grid else None
    if args.archive:
        print(f"archived {len(archive(args.sweep_dir, args.archive))} files into {args.archive}")
    summary = build_report(args.sweep_dir, args.output_dir or args.sweep_dir / "report", grid)
    print(markdown(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
