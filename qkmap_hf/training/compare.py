"""``qkmap compare``: train ``standard``, ``qk_norm`` and ``qk_map`` models on equal terms and plot the losses.

Equal terms: one preset (same widths, depths, heads), one tokenized and packed dataset with one held-out split,
the same seeds (a seed fixes the initial weights shared by all modes and the batch order), the same number of
steps, batch, schedule and optimizer. Only ``qk_mode`` (and whatever a ``--variant`` names) differs.

Outputs in ``--output-dir``: ``losses.csv`` (``mode,seed,step,split,loss``; ``split`` is ``train`` or
``validation``), ``train_loss.png`` and ``validation_loss.png`` (mean over seeds with a min/max band),
``summary.csv``/``summary.md`` (final validation loss per mode: mean, std, min, max, paired difference to
``standard``, wall time) and ``compare.json`` (the settings). Finished runs found in ``losses.csv`` are skipped,
so an interrupted comparison continues where it stopped.
"""

from __future__ import annotations

import csv
import json
import math
import statistics
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..fileio import atomic_write_csv, atomic_write_json, atomic_write_text
from ..flags import check_numbers, collected_by, overridden, parse_overrides
from ..modeling.configuration_qkmap import QK_MODES
from ..task_sources import parse_task, source_for
from .data import DataOptions
from .options import SHARED_GROUPS, OptimizationOptions, RunOptions, shared_fields
from .presets import PRESETS, get_preset

CSV_FIELDS = ("mode", "seed", "step", "split", "loss")
TRAIN_KEYS = {"learning_rate", "qkmap_learning_rate", "qkmap_lr_multiplier", "weight_decay", "qkmap_weight_decay"}
# Short names accepted in --variant and --tune for training settings.
TRAIN_KEY_ALIASES = {"qk_lr_multiplier": "qkmap_lr_multiplier"}
# Built-in arms: the three modes and the ablations that say why they differ (docs/method.md, "Ablations").
BUILTIN_ARMS: dict[str, tuple[str, dict[str, Any]]] = {
    "standard": ("standard", {}),
    "qk_norm": ("qk_norm", {}),
    "qk_map": ("qk_map", {}),
    "standard_prior": ("standard", {"qk_position_prior": "constant"}),
    "qk_norm_prior": ("qk_norm", {"qk_position_prior": "constant"}),
    "qk_map_noprior": ("qk_map", {"qkmap_rotate_cos_blocks": False}),
    # Gain treatments (qkmap_lab/notes/stability.md): whether the logit bound the gains set holds under training.
    "qk_map_gains_frozen": ("qk_map", {"qkmap_gain_treatment": "frozen"}),
    "qk_map_gains_decayed": ("qk_map", {"qkmap_gain_treatment": "decayed"}),
    "qk_map_gains_normalized": ("qk_map", {"qkmap_gain_treatment": "normalized"}),
    # The control that isolates magnitude (qkmap_lab/notes/synthetic-tasks.md): constant cos rows, only the sine rows see z.
    "qk_map_constant_cos": ("qk_map", {"qkmap_cos_block": "constant"}),
}


@dataclass
class Variant:
    """One arm of the comparison: a label, an attention mode, config fields and training settings."""

    label: str
    qk_mode: str
    config: dict[str, Any] = field(default_factory=dict)
    train: dict[str, Any] = field(default_factory=dict)


def parse_variant(text: str) -> Variant:
    """``LABEL[:key=value,key=value...]``; a built-in arm name (``BUILTIN_ARMS``) brings its mode and fields.

    Keys are QKMapConfig fields or training settings (``learning_rate``, ``qkmap_lr_multiplier`` alias
    ``qk_lr_multiplier``...), e.g. ``qk_map_wide_range:qk_mode=qk_map,qkmap_max_frequency=10``.
    """
    label, _, spec = text.partition(":")
    label = label.strip()
    if not label:
        raise ValueError(f"--variant {text!r} needs a label before ':' (e.g. qk_map:qkmap_max_frequency=10).")
    builtin_mode, builtin_config = BUILTIN_ARMS.get(label, (None, {}))
    values = parse_overrides([item for item in spec.split(",") if item.strip()]) if spec else {}
    values = {TRAIN_KEY_ALIASES.get(k, k): v for k, v in {**builtin_config, **values}.items()}
    qk_mode = values.pop("qk_mode", builtin_mode)
    if qk_mode not in QK_MODES:
        raise ValueError(
            f"--variant {text!r}: set qk_mode=standard|qk_norm|qk_map (the label is not a built-in arm: "
            f"{', '.join(BUILTIN_ARMS)})."
        )
    train = {k: values.pop(k) for k in list(values) if k in TRAIN_KEYS}
    return Variant(label, qk_mode, values, train)


def _help(text: str, **extra: Any) -> dict[str, Any]:
    return {"help": text, **extra}


@dataclass
class CompareOptions(*SHARED_GROUPS):
    """Settings of one comparison; every run shares them (see the module docstring). Field ``steps`` is ``--steps``.

    The data, optimization and run groups are ``qkmap train``'s (``training/options.py``); ``max_eval_blocks``
    keeps this command's own default (64: every run of every arm evaluates on them)."""

    output_dir: str = field(metadata=_help("where losses.csv, the plots, the summary and the runs go"))
    data: list[str] = field(
        default_factory=list, metadata=_help("text, JSONL or dataset folders (or give --task)", metavar="PATH")
    )
    task: str | None = field(
        default=None,
        metadata=_help(
            "a generated task instead of --data, NAME[:FIELD=VALUE,...] from an installed task source "
            "(the lab's synthetic tasks: mqar, salience, copy)"
        ),
    )
    preset: str = field(default="tiny", metadata=_help(f"size preset: {', '.join(PRESETS)}"))
    steps: int = field(default=200, metadata=_help("optimizer steps per run"))
    seeds: int = field(default=3, metadata=_help("number of seeds (first-seed, first-seed+1, ...)"))
    first_seed: int = field(default=0, metadata=_help("first seed"))
    variants: list[Variant] = field(
        default_factory=lambda: [Variant(mode, mode) for mode in QK_MODES],
        metadata=_help(
            "an arm of the comparison (default: standard, qk_norm, qk_map); repeatable, e.g. "
            "qk_map_f2:qk_mode=qk_map,qkmap_num_frequencies=2",
            aliases=["--variant"],
            action=collected_by(parse_variant),
            metavar="LABEL[:FIELD=VALUE,...]",
        ),
    )
    config: dict[str, Any] = overridden(RunOptions, "config", help="QKMapConfig field for every run; repeatable")
    max_eval_blocks: int | None = overridden(DataOptions, "max_eval_blocks", default=64)
    eval_steps: int | None = field(default=None, metadata=_help("steps between evaluations (default: steps / 10)"))
    logging_steps: int | None = field(default=None, metadata=_help("steps between loss logs (default: steps / 50)"))

    def __post_init__(self) -> None:
        """Finite numbers, no negative counts or rates (the zero counts are refused by ``qkmap compare``)."""
        check_numbers(
            self,
            non_negative=(
                "first_seed",
                "learning_rate",
                "qkmap_lr_multiplier",
                "weight_decay",
                "warmup",
                "max_eval_blocks",
                "split_seed",
            ),  # fmt: skip
        )
        if not 0 <= self.eval_fraction < 1:
            raise ValueError(f"--eval-fraction {self.eval_fraction}: must lie in [0, 1).")


@dataclass
class ComparisonResult:
    csv_path: Path
    plot_paths: list[Path]
    summary_path: Path
    summary: list[dict]


# --------------------------------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------------------------------


def _read_rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    with path.open() as handle:
        return [
            {
                "mode": r["mode"],
                "seed": int(r["seed"]),
                "step": int(r["step"]),
                "split": r["split"],
                "loss": float(r["loss"]),
            }
            for r in csv.DictReader(handle)
        ]


def _write_rows(path: Path, rows: list[dict]) -> None:
    atomic_write_csv(path, CSV_FIELDS, rows)


def rows_from_history(label: str, seed: int, history: list[dict]) -> list[dict]:
    """CSV rows from a Trainer log history: ``loss`` -> train, ``eval_loss`` -> validation."""
    rows = []
    for entry in history:
        if "loss" in entry:
            rows.append(
                {
                    "mode": label,
                    "seed": seed,
                    "step": int(entry["step"]),
                    "split": "train",
                    "loss": float(entry["loss"]),
                }
            )
        if "eval_loss" in entry:
            rows.append(
                {
                    "mode": label,
                    "seed": seed,
                    "step": int(entry["step"]),
                    "split": "validation",
                    "loss": float(entry["eval_loss"]),
                }
            )
    return rows


def initial_loss(log_history: list[dict], diverged: dict) -> float:
    """``L0`` of a run: its held-out loss before the first step (``eval_on_start``), else its first training loss."""
    at_start = [entry["eval_loss"] for entry in log_history if "eval_loss" in entry and entry.get("step") == 0]
    return float(at_start[0]) if at_start else float(diverged["initial_loss"])


def prepare_data(options: CompareOptions) -> tuple[Any, tuple, int]:
    """Tokenizer, ``(train, held-out, stats)`` datasets and block size shared by every run of a comparison."""
    from .data import build_datasets, byte_level_tokenizer
    from .trainer import TrainOptions, load_tokenizer

    block_size = options.block_size or get_preset(options.preset).block_size
    if options.task:
        batch = options.batch_size or get_preset(options.preset).batch_size
        source, task = parse_task(options.task)
        datasets = source.datasets(task, block_size, options.steps * batch, options.max_eval_blocks)
        return byte_level_tokenizer(), datasets, block_size
    if not options.data:
        raise ValueError(
            "qkmap compare needs --data PATH... or --task NAME (synthetic tasks: qkmap_lab/notes/synthetic-tasks.md)."
        )
    runs = str(Path(options.output_dir) / "runs")
    base = TrainOptions(options.preset, list(options.data), runs, **shared_fields(options, DataOptions))
    tokenizer = load_tokenizer(base)
    datasets = build_datasets(options.data, tokenizer, block_size, options)
    return tokenizer, datasets, block_size


def run_comparison(options: CompareOptions) -> ComparisonResult:
    """Train every variant x seed, then write the CSV, the plots and the summary."""
    out = Path(options.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    labels = [v.label for v in options.variants]
    if len(set(labels)) != len(labels):
        raise ValueError(f"variant labels must be unique; got {labels}.")
    eval_steps = options.eval_steps or max(1, options.steps // 10)
    logging_steps = options.logging_steps or max(1, options.steps // 50)
    seeds = list(range(options.first_seed, options.first_seed + options.seeds))
    tokenizer, datasets, block_size = prepare_data(options)
    settings = {
        **asdict(options),
        "block_size": block_size,
        "eval_steps": eval_steps,
        "logging_steps": logging_steps,
        "data_stats": datasets[2].to_dict(),
    }
    atomic_write_json(out / "compare.json", settings)

    csv_path = out / "losses.csv"
    rows = _read_rows(csv_path)
    timing_path = out / "timing.json"
    timing = json.loads(timing_path.read_text()) if timing_path.exists() else {}
    finished = {(r["mode"], r["seed"]) for r in rows if r["split"] == "validation" and r["step"] == options.steps}
    for seed in seeds:  # seed-major order: a partial comparison already holds every mode for the first seeds
        for variant in options.variants:
            if (variant.label, seed) in finished:
                continue
            rows = [r for r in rows if not (r["mode"] == variant.label and r["seed"] == seed)]
            started = time.time()
            result = train_run(
                options,
                variant,
                seed,
                datasets,
                tokenizer,
                out / "runs" / f"{variant.label}-seed{seed}",
                block_size=block_size,
                eval_steps=eval_steps,
                logging_steps=logging_steps,
            )
            timing[f"{variant.label}/{seed}"] = time.time() - started
            rows += rows_from_history(variant.label, seed, result.log_history)
            if result.diverged is not None:  # recorded with L0 as its final loss; the comparison goes on
                loss = initial_loss(result.log_history, result.diverged)
                rows.append(
                    {"mode": variant.label, "seed": seed, "step": options.steps, "split": "validation"} | {"loss": loss}
                )
            _write_rows(csv_path, rows)
            atomic_write_json(timing_path, timing)
    return report(out, options.steps, labels)


def train_run(
    options: CompareOptions,
    variant: Variant,
    seed: int,
    datasets: tuple,
    tokenizer,
    output_dir: Path,
    *,
    block_size: int,
    eval_steps: int,
    logging_steps: int,
    save: bool = False,
):
    """One run of one arm and seed with the comparison's shared settings (the one place they are assembled)."""
    from .trainer import TrainOptions, train

    # the run and optimization groups as they are (the data group is in ``datasets``), then the arm's own settings
    shared = shared_fields(options, RunOptions, OptimizationOptions) | variant.train
    run_options = TrainOptions(
        options.preset,
        list(options.data),
        str(output_dir),
        **shared | {"config": {**options.config, **variant.config}},
        qk_mode=variant.qk_mode,
        block_size=block_size,
        max_steps=options.steps,
        seed=seed,
        logging_steps=logging_steps,
        eval_steps=eval_steps,
        save_steps=0,
        disable_tqdm=True,
        bf16="no",
        stop_on_divergence=True,  # a diverged run is recorded with L0 and the comparison goes on
    )
    task_metrics = None
    if options.task:
        source = source_for(options.task)
        task_metrics = {
            "compute_metrics": source.compute_metrics,
            "preprocess_logits_for_metrics": source.preprocess_logits_for_metrics,
        }
    return train(
        run_options,
        datasets=datasets,
        tokenizer=tokenizer,
        save=save,
        trainer_kwargs=task_metrics,
    )


# --------------------------------------------------------------------------------------------------
# Reporting
# --------------------------------------------------------------------------------------------------


def summarize(rows: list[dict], final_step: int, labels: Sequence[str], timing: dict | None = None) -> list[dict]:
    """Final validation loss per mode over seeds, and the paired difference to ``standard`` (same seeds)."""
    final = defaultdict(dict)
    for r in rows:
        if r["split"] == "validation" and r["step"] == final_step:
            final[r["mode"]][r["seed"]] = r["loss"]
    reference = final.get("standard", {})
    summary = []
    for label in labels:
        losses = final.get(label, {})
        if not losses:
            continue
        values = list(losses.values())
        paired = [losses[s] - reference[s] for s in losses if s in reference]
        seconds = [v for k, v in (timing or {}).items() if k.split("/")[0] == label]
        summary.append(
            {
                "mode": label,
                "seeds": len(values),
                "val_loss_mean": statistics.fmean(values),
                "val_loss_std": statistics.stdev(values) if len(values) > 1 else 0.0,
                "val_loss_min": min(values),
                "val_loss_max": max(values),
                "delta_vs_standard": statistics.fmean(paired) if paired and label != "standard" else 0.0,
                "wins_vs_standard": f"{sum(d < 0 for d in paired)}/{len(paired)}" if label != "standard" else "",
                "seconds_per_run": statistics.fmean(seconds) if seconds else math.nan,
            }
        )
    return summary


def _plot(rows: list[dict], split: str, labels: Sequence[str], path: Path, title: str) -> None:
    from ..plotting import new_figure, plot_mean_with_band, save_figure

    curves: dict[str, dict[int, list[float]]] = {label: defaultdict(list) for label in labels}
    for r in rows:
        if r["mode"] in curves and r["split"] == split:
            curves[r["mode"]][r["step"]].append(r["loss"])
    figure = new_figure()
    axis = figure.add_subplot()
    plot_mean_with_band(axis, curves)
    axis.set_xlabel("optimizer step")
    axis.set_ylabel(f"{split} loss (nats/token)")
    axis.set_title(title)
    axis.grid(alpha=0.3)
    axis.legend()
    save_figure(figure, path, dpi=120)


def report(out: Path, final_step: int, labels: Sequence[str] | None = None) -> ComparisonResult:
    """(Re)write plots and summary from ``out/losses.csv``."""
    rows = _read_rows(out / "losses.csv")
    labels = list(labels or dict.fromkeys(r["mode"] for r in rows))
    timing_path = out / "timing.json"
    timing = json.loads(timing_path.read_text()) if timing_path.exists() else {}
    plots = []
    for split, name in (("train", "train_loss.png"), ("validation", "validation_loss.png")):
        _plot(rows, split, labels, out / name, f"{split} loss: mean and min/max over seeds")
        plots.append(out / name)
    summary = summarize(rows, final_step, labels, timing)
    atomic_write_csv(out / "summary.csv", list(summary[0]) if summary else ["mode"], summary)
    lines = [
        f"Final validation loss at step {final_step} (nats/token):",
        "",
        "| mode | seeds | mean | std | min | max | mean paired delta vs standard | wins vs standard | s/run |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summary:
        lines.append(
            f"| {s['mode']} | {s['seeds']} | {s['val_loss_mean']:.4f} | {s['val_loss_std']:.4f} | {s['val_loss_min']:.4f} "
            f"| {s['val_loss_max']:.4f} | {s['delta_vs_standard']:+.4f} | {s['wins_vs_standard']} | {s['seconds_per_run']:.0f} |"
        )
    atomic_write_text(out / "summary.md", "\n".join(lines) + "\n")
    return ComparisonResult(out / "losses.csv", plots, out / "summary.md", summary)


__all__ = [
    "BUILTIN_ARMS",
    "CompareOptions",
    "ComparisonResult",
    "Variant",
    "parse_variant",
    "initial_loss",
    "prepare_data",
    "report",
    "run_comparison",
    "summarize",
    "train_run",
]
