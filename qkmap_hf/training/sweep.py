"""``qkmap compare --tune``: equal tuning effort for every arm, chosen on one split and reported on another.

Protocol (docs/compare.md, "Equal tuning effort"):

1. The held-out blocks are cut in two disjoint halves: the **tuning split** (first half) and the **report split**
   (second half). Every arm gets the same grid (the cross product of the ``--tune`` values); knobs that cannot
   change an arm (``qk_lr_multiplier`` for an arm without query/key-side parameters) are dropped for that arm
   instead of training identical copies.
2. Tuning runs use the **tuning seeds** and are evaluated on the tuning split only; each arm's choice is the
   setting with the lowest mean final tuning loss.
3. Report runs rerun each arm's choice with fresh **report seeds** (disjoint from the tuning seeds) and are
   evaluated on the report split only; with ``save_models`` each report run is kept as a checkpoint.

Outputs in the output folder: ``sweep_losses.csv`` (``arm,phase,setting,seed,step,split,loss``),
``summary.json`` (grid, tuning losses, choice, report losses per seed, paired differences with 95 % intervals,
the seeds and block fingerprints of both splits), ``summary.md``, ``validation_loss.png`` and, with
``save_models``, ``models/ARM/seedS``. Finished runs found in the CSV are skipped, so a sweep resumes;
a report run whose kept model is gone runs again.
"""

from __future__ import annotations

import csv
import functools
import hashlib
import itertools
import json
import math
import shutil
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..fileio import atomic_write_json, atomic_write_text
from ..flags import check_numbers, collected_by
from .compare import TRAIN_KEY_ALIASES, TRAIN_KEYS, CompareOptions, Variant, initial_loss, prepare_data, train_run

SWEEP_FORMAT = "qkmap-sweep/1"
SWEEP_CSV_FIELDS = ("arm", "phase", "setting", "seed", "step", "split", "loss")
QK_LR_KNOB = "qkmap_lr_multiplier"
DEFAULT_SETTING = "default"
DIVERGED_FILE = "diverged.json"  # runs stopped as diverged: why, at which step, and the L0 recorded for them


@dataclass(kw_only=True)
class TuningOptions:
    """The tuning group of ``qkmap compare`` (``--tune`` and its seeds), declared once: given a grid, each arm's
    setting is chosen on a tuning split and reported on fresh seeds (the module docstring)."""

    tune: list[str] | None = field(
        default=None,
        metadata={
            "help": "tuning grid (repeatable; the cross product is run for every arm), e.g. learning_rate=1e-3,2e-3 "
            "logit_scale_multiplier=1,4 qk_lr_multiplier=1,10; each arm's choice on the tuning split and "
            "tuning seeds is rerun on --seeds fresh seeds and reported on a disjoint split",
            "metavar": "NAME=V1,V2,...",
            "action": collected_by(str),
        },
    )
    tuning_seeds: int = field(default=1, metadata={"help": "seeds per grid point in tuning"})
    tuning_first_seed: int = field(default=1000, metadata={"help": "first tuning seed"})
    save_models: bool = field(default=False, metadata={"help": "keep each report run as a checkpoint in OUT/models"})
    tie_tolerance: float = field(
        default=0.0,
        metadata={
            "help": "tuning losses within this much of the lowest are ties (saturated runs differ by noise); "
            "among ties the choice is the setting nearest the arm's untuned values (summed |log ratio| per "
            "knob), then the lower loss. 0: the lowest loss"
        },
    )
    tune_only: bool = field(
        default=False,
        metadata={
            "help": "run the tuning grid only, no choice, report runs or summary: a sweep split over several "
            "sittings or machines (copy sweep_losses.csv along); run again without it to choose and report"
        },
    )

    def __post_init__(self) -> None:
        check_numbers(self, positive=("tuning_seeds",), non_negative=("tuning_first_seed", "tie_tolerance"))
        if self.tune_only and not self.tune:
            raise ValueError("--tune-only runs a tuning grid: give it one with --tune NAME=V1,V2,...")

    @property
    def grid(self) -> dict[str, list]:
        """``--tune`` as ``{name: [values]}`` (``parse_tune``)."""
        return parse_tune(self.tune or [])

    @property
    def seeds(self) -> list[int]:
        return list(range(self.tuning_first_seed, self.tuning_first_seed + self.tuning_seeds))

    @property
    def requested(self) -> bool:
        """Whether these options turn a comparison into a sweep (a grid, or report runs to keep)."""
        return bool(self.tune) or self.save_models


@dataclass
class SweepOptions:
    """A comparison (its arms, report seeds ``first_seed..``, steps...) plus its tuning group."""

    compare: CompareOptions
    tuning: TuningOptions = field(default_factory=TuningOptions)

    @property
    def tune(self) -> dict[str, list]:
        return self.tuning.grid

    @property
    def tuning_seeds(self) -> list[int]:
        return self.tuning.seeds

    @property
    def save_models(self) -> bool:
        return self.tuning.save_models

    @property
    def report_seeds(self) -> list[int]:
        return list(range(self.compare.first_seed, self.compare.first_seed + self.compare.seeds))


def parse_tune(items: list[str]) -> dict[str, list]:
    """``["NAME=V1,V2", ...]`` -> ``{name: [v1, v2]}``; names are training settings or QKMapConfig fields."""
    from ..modeling.configuration_qkmap import QKMapConfig
    from .options import parse_overrides

    config_fields = set(QKMapConfig().to_dict())
    grid: dict[str, list] = {}
    for item in items:
        name, sep, values = item.partition("=")
        name = TRAIN_KEY_ALIASES.get(name.strip(), name.strip())
        if not sep or not values.strip():
            raise ValueError(f"--tune {item!r} must look like NAME=V1,V2,... (e.g. learning_rate=1e-3,2e-3).")
        if name not in TRAIN_KEYS and name not in config_fields:
            raise ValueError(
                f"--tune {item!r}: {name!r} is neither a training setting ({', '.join(sorted(TRAIN_KEYS))}, "
                "qk_lr_multiplier) nor a QKMapConfig field."
            )
        grid[name] = [parse_overrides([f"{name}={v.strip()}"])[name] for v in values.split(",") if v.strip()]
    return grid


def setting_id(point: dict[str, Any]) -> str:
    """A readable, stable name for one grid point (``default`` for the empty point)."""
    return ";".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in point.items()) or DEFAULT_SETTING


def grid_points(tune: dict[str, list]) -> list[dict[str, Any]]:
    """The cross product of the tuning values, in the order given."""
    names = list(tune)
    return [dict(zip(names, values, strict=True)) for values in itertools.product(*(tune[n] for n in names))]


def has_qk_side_parameters(variant: Variant, options: CompareOptions) -> bool:
    """Whether the arm has parameters in the query/key-side optimizer group (built on the meta device)."""
    import torch

    from ..modeling.modeling_qkmap import QKMapForCausalLM
    from .optim import classify_parameters
    from .presets import preset_config

    config = preset_config(options.preset, variant.qk_mode, **{**options.config, **variant.config})
    with torch.device("meta"):
        model = QKMapForCausalLM(config)
    return bool(classify_parameters(model, qk_norm_in_qk_group=True)["qkmap"])


def arm_grid(variant: Variant, tune: dict[str, list], options: CompareOptions) -> tuple[list[dict], list[str]]:
    """The grid points that can change this arm, and the knobs dropped as inert for it."""
    inert = [QK_LR_KNOB] if QK_LR_KNOB in tune and not has_qk_side_parameters(variant, options) else []
    points = []
    for point in grid_points({k: v for k, v in tune.items() if k not in inert}):
        if point not in points:
            points.append(point)
    return points, inert


def untuned_values(variant: Variant, knobs: list[str], options: CompareOptions) -> dict[str, Any]:
    """What each tuned knob is for this arm without tuning: its own or the comparison's setting, else the preset's
    learning rate or the config default (``logit_scale_multiplier`` 1)."""
    from .presets import get_preset, preset_config

    config = preset_config(options.preset, variant.qk_mode, **{**options.config, **variant.config})
    values: dict[str, Any] = {}
    for knob in knobs:
        if knob in TRAIN_KEYS:
            value = variant.train.get(knob, getattr(options, knob, None))
            if value is None and knob == "learning_rate":
                value = get_preset(options.preset).learning_rate
        else:
            value = getattr(config, knob, None)
        values[knob] = value
    return values


def distance_to(values: dict[str, Any], reference: dict[str, Any]) -> float:
    """Summed ``|log(value / reference)|`` over the knobs (1 for a non-numeric or missing value that differs)."""
    total = 0.0
    for knob, value in values.items():
        other = reference.get(knob)
        numeric = all(isinstance(v, int | float) and not isinstance(v, bool) and v > 0 for v in (value, other))
        total += abs(math.log(value / other)) if numeric else float(value != other)
    return total


def choose_setting(
    losses: dict[str, float], values: dict[str, dict[str, Any]], untuned: dict[str, Any], tolerance: float = 0.0
) -> str:
    """The tuning choice among ``losses`` (setting -> mean tuning loss): the lowest; with a ``tolerance``, among
    the settings within it of the lowest, the one nearest the untuned values (``values``: each setting's knobs),
    then the lower loss. A diverged run (NaN) ranks last; equal keys keep the grid's order."""
    best = min(loss_rank(loss) for loss in losses.values())
    tied = [setting for setting, loss in losses.items() if loss_rank(loss) <= best + tolerance]
    if tolerance <= 0:
        return min(tied, key=lambda setting: loss_rank(losses[setting]))
    return min(tied, key=lambda setting: (distance_to(values[setting], untuned), loss_rank(losses[setting])))


def apply_point(variant: Variant, point: dict[str, Any]) -> Variant:
    """The arm with one grid point applied (training settings and config fields go to their places)."""
    train = {**variant.train, **{k: v for k, v in point.items() if k in TRAIN_KEYS}}
    config = {**variant.config, **{k: v for k, v in point.items() if k not in TRAIN_KEYS}}
    return replace(variant, config=config, train=train)


def split_heldout(eval_dataset) -> tuple[Any, Any]:
    """Tuning split (first half of the held-out blocks) and report split (second half): disjoint by construction."""
    blocks = eval_dataset.blocks
    half = len(blocks) // 2
    if half < 1:
        raise ValueError(
            f"{len(blocks)} held-out block(s) cannot be cut into a tuning and a report split; raise --max-eval-blocks "
            "or --eval-fraction (at least 2 blocks)."
        )
    return eval_dataset.subset(slice(None, half)), eval_dataset.subset(slice(half, None))


def block_fingerprints(dataset) -> list[str]:
    """SHA-1 (12 hex digits) of every block's token ids: lets a reader check the splits share no block."""
    return [hashlib.sha1(block.numpy().tobytes()).hexdigest()[:12] for block in dataset.blocks]


@functools.lru_cache(maxsize=64)
def t_quantile_975(df: int) -> float:
    """Student t quantile t(0.975, df), by bisection on the density integrated with Simpson's rule (no scipy)."""
    norm = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)

    def mass(x: float, n: int = 2000) -> float:  # P(0 < T < x)
        h = x / n
        f = [norm * (1 + (i * h) ** 2 / df) ** (-(df + 1) / 2) for i in range(n + 1)]
        return h / 3 * (f[0] + f[-1] + 4 * sum(f[1:-1:2]) + 2 * sum(f[2:-1:2]))

    low, high = 0.0, 100.0
    for _ in range(50):
        middle = (low + high) / 2
        low, high = (middle, high) if mass(middle) < 0.475 else (low, middle)
    return (low + high) / 2


def paired_interval(differences: list[float]) -> dict[str, Any]:
    """Mean of paired differences with a two-sided 95 % Student t interval (``None`` bounds for one pair)."""
    n = len(differences)
    mean = statistics.fmean(differences)
    if n < 2:
        return {"n": n, "mean": mean, "low": None, "high": None, "wins": sum(d < 0 for d in differences)}
    half = t_quantile_975(n - 1) * statistics.stdev(differences) / math.sqrt(n)
    return {"n": n, "mean": mean, "low": mean - half, "high": mean + half, "wins": sum(d < 0 for d in differences)}


# --------------------------------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------------------------------


def _read(path: Path) -> list[dict]:
    if not path.exists():
        return []
    with path.open() as handle:
        return [
            {**r, "seed": int(r["seed"]), "step": int(r["step"]), "loss": float(r["loss"])}
            for r in csv.DictReader(handle)
        ]


def _write(path: Path, rows: list[dict]) -> None:
    lines = [",".join(SWEEP_CSV_FIELDS)] + [",".join(str(r[k]) for k in SWEEP_CSV_FIELDS) for r in rows]
    atomic_write_text(path, "\n".join(lines) + "\n")


def run_folder(out: Path, arm: str, phase: str, setting: str, seed: int, save_models: bool = False) -> Path:
    """Where a sweep keeps one run: ``runs/tune/ARM-SETTING-seedS``, ``runs/report/ARM/seedS`` (or ``models/...``)."""
    if phase == "tune":
        return out / "runs" / "tune" / f"{arm}-{setting}-seed{seed}"
    return out / ("models" if save_models else "runs/report") / arm / f"seed{seed}"


def forget_diverged(out: Path) -> list[str]:
    """Remove every run recorded as diverged from a sweep folder (its rows, timing, record and run folder), so that
    resuming the sweep makes it again: how runs stopped by an earlier divergence rule are judged by the current one.
    Returns the keys (``ARM/PHASE/SETTING/SEED``) forgotten."""
    diverged_path = out / DIVERGED_FILE
    diverged = json.loads(diverged_path.read_text()) if diverged_path.exists() else {}
    if not diverged:
        return []
    runs = set()
    for key in diverged:
        arm, phase, setting, seed = key.rsplit("/", 3)
        runs.add((arm, phase, setting, int(seed)))
        for folder in (run_folder(out, arm, phase, setting, int(seed), save) for save in (False, True)):
            if folder.is_dir():
                shutil.rmtree(folder)
    _write(out / "sweep_losses.csv", [r for r in _read(out / "sweep_losses.csv") if _run_of(r) not in runs])
    timing_path = out / "timing.json"
    if timing_path.exists():
        timing = json.loads(timing_path.read_text())
        atomic_write_json(timing_path, {k: v for k, v in timing.items() if k not in diverged})
    atomic_write_json(diverged_path, {})
    return sorted(diverged)


def reshard(sources: list[Path], out: Path, arms: list[str], shards: int) -> dict[str, list[str]]:
    """Lay the runs of sweep folders out again as ``out/shard-K``, shard K holding every ``shards``-th arm of
    ``arms`` (the assignment of ``benchmarks/sharded_compare.sh``): the rows of ``sweep_losses.csv``, ``timing.json``,
    ``diverged.json`` and the report runs' folders (``models/ARM``, ``runs/report/ARM``). A sweep can then change its
    number of processes between sittings (one arm per process keeps every core busy to the end) and rerun nothing.
    A run found in several sources is taken from the one holding most of its rows (a finished copy over a partial
    one). Returns ``{shard folder name: its arms}``."""
    if shards < 1:
        raise ValueError(f"shards must be at least 1, got {shards}")
    taken = sorted(p.name for p in out.glob("shard-*")) if out.exists() else []
    if taken:
        raise ValueError(f"{out} already holds {', '.join(taken)}; give an empty or new output folder")
    runs: dict[tuple, tuple[Path, list[dict]]] = {}
    records: dict[Path, tuple[dict, dict]] = {}  # per source: its timing.json and diverged.json
    for source in sources:
        if not (source / "sweep_losses.csv").exists():
            raise ValueError(f"{source} holds no sweep_losses.csv: give the folders of a qkmap compare --tune sweep")
        by_run: dict[tuple, list[dict]] = defaultdict(list)
        for row in _read(source / "sweep_losses.csv"):
            by_run[_run_of(row)].append(row)
        for run, rows in by_run.items():
            if len(rows) > len(runs.get(run, (None, []))[1]):
                runs[run] = (source, rows)
        records[source] = tuple(
            json.loads(path.read_text()) if path.exists() else {}
            for path in (source / "timing.json", source / DIVERGED_FILE)
        )
    unknown = sorted({run[0] for run in runs} - set(arms))
    if unknown:
        raise ValueError(f"arms {unknown} are in the sources but not in the arms given")
    layout = {f"shard-{k}": arms[k::shards] for k in range(shards)}
    for name, shard_arms in layout.items():
        folder = out / name
        folder.mkdir(parents=True)
        mine = sorted(run for run in runs if run[0] in shard_arms)
        _write(folder / "sweep_losses.csv", [row for run in mine for row in runs[run][1]])
        timing, diverged = {}, {}  # each run's records from the source its rows came from
        for run in mine:
            key, (source_timing, source_diverged) = _run_key(*run), records[runs[run][0]]
            timing |= {key: source_timing[key]} if key in source_timing else {}
            diverged |= {key: source_diverged[key]} if key in source_diverged else {}
        atomic_write_json(folder / "timing.json", timing)
        if diverged:
            atomic_write_json(folder / DIVERGED_FILE, diverged)
        for run in (run for run in mine if run[1] == "report"):
            for saved in (True, False):
                kept = run_folder(runs[run][0], *run, saved)
                if kept.is_dir():
                    shutil.copytree(kept, run_folder(folder, *run, saved))
    return layout


def _run_of(row: dict) -> tuple[str, str, str, int]:
    return row["arm"], row["phase"], row["setting"], row["seed"]


def _run_key(arm: str, phase: str, setting: str, seed: int) -> str:
    """A run's key in ``timing.json`` and ``diverged.json``: ``ARM/PHASE/SETTING/SEED``."""
    return f"{arm}/{phase}/{setting}/{seed}"


def _history_rows(arm: str, phase: str, setting: str, seed: int, history: list[dict]) -> list[dict]:
    rows = []
    for entry in history:
        for key, split in (("loss", "train"), ("eval_loss", "validation")):
            if key in entry:
                rows.append(
                    {
                        "arm": arm,
                        "phase": phase,
                        "setting": setting,
                        "seed": seed,
                        "step": int(entry["step"]),
                        "split": split,
                        "loss": float(entry[key]),
                    }
                )
    return rows


def _final(rows: list[dict], steps: int) -> dict[tuple[str, str, str, int], float]:
    return {
        (r["arm"], r["phase"], r["setting"], r["seed"]): r["loss"]
        for r in rows
        if r["split"] == "validation" and r["step"] == steps
    }


def tuning_losses_so_far(out: Path, steps: int | None = None) -> dict[str, dict[str, dict[str, float]]]:
    """``{arm: {setting: {seed: final loss}}}`` of every tuning run finished in ``out/sweep_losses.csv``, also while
    the sweep is still running (``summary.json`` is written when it ends). ``steps`` defaults to the last validation
    step of the tuning rows: a run's rows reach the CSV only when it ends (a diverged one's at ``steps`` too)."""
    rows = _read(out / "sweep_losses.csv")
    if steps is None:
        steps = max((r["step"] for r in rows if r["phase"] == "tune" and r["split"] == "validation"), default=-1)
    losses: dict[str, dict[str, dict[str, float]]] = {}
    for (arm, phase, setting, seed), loss in _final(rows, steps).items():
        if phase == "tune":
            losses.setdefault(arm, {}).setdefault(setting, {})[str(seed)] = loss
    return losses


def loss_rank(loss: float) -> float:
    """The key that orders tuning losses: a diverged run (NaN loss) ranks last."""
    return math.inf if math.isnan(loss) else loss


def run_sweep(sweep: SweepOptions) -> dict:
    """Tune every arm, rerun each choice on the report seeds, write the outputs; returns ``summary.json``'s data."""
    options = sweep.compare
    out = Path(options.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    labels = [v.label for v in options.variants]
    if len(set(labels)) != len(labels):
        raise ValueError(f"variant labels must be unique; got {labels}.")
    overlap = set(sweep.tuning_seeds) & set(sweep.report_seeds)
    if overlap:
        raise ValueError(
            f"tuning seeds {sweep.tuning_seeds} and report seeds {sweep.report_seeds} share {sorted(overlap)}; "
            "move --tuning-first-seed or --first-seed so the report uses fresh seeds."
        )
    tokenizer, (train_set, heldout, stats), block_size = prepare_data(options)
    tune_split, report_split = split_heldout(heldout)
    logging_steps = options.logging_steps or max(1, options.steps // 50)
    report_eval_steps = options.eval_steps or max(1, options.steps // 5)
    grids = {v.label: arm_grid(v, sweep.tune, options) for v in options.variants}
    csv_path, timing_path = out / "sweep_losses.csv", out / "timing.json"
    rows = _read(csv_path)
    timing = json.loads(timing_path.read_text()) if timing_path.exists() else {}
    diverged_path = out / DIVERGED_FILE
    diverged = json.loads(diverged_path.read_text()) if diverged_path.exists() else {}

    def run(variant: Variant, phase: str, setting: str, seed: int, split, eval_steps: int, folder: Path, save: bool):
        nonlocal rows
        finished = (variant.label, phase, setting, seed) in _final(rows, options.steps)
        if finished and (not save or any(folder.glob("*.safetensors"))):
            return  # finished; a run whose kept model is gone (a fresh machine, rows restored from a copy) reruns
        rows = [
            r for r in rows if (r["arm"], r["phase"], r["setting"], r["seed"]) != (variant.label, phase, setting, seed)
        ]
        started = time.time()
        result = train_run(
            options,
            variant,
            seed,
            (train_set, split, stats),
            tokenizer,
            folder,
            block_size=block_size,
            eval_steps=eval_steps,
            logging_steps=logging_steps,
            save=save,
        )
        key = _run_key(variant.label, phase, setting, seed)
        timing[key] = time.time() - started
        rows += _history_rows(variant.label, phase, setting, seed, result.log_history)
        if result.diverged is not None:  # recorded with L0 as its final loss (Wortsman et al. 2023)
            initial = initial_loss(result.log_history, result.diverged)
            diverged[key] = {**result.diverged, "recorded_loss": initial}
            rows.append(
                {"arm": variant.label, "phase": phase, "setting": setting, "seed": seed}
                | {"step": options.steps, "split": "validation", "loss": initial}
            )
            atomic_write_json(diverged_path, diverged)
        _write(csv_path, rows)
        atomic_write_json(timing_path, timing)

    choices: dict[str, dict] = {}
    for variant in options.variants:  # 1. tuning: every grid point of every arm on the tuning seeds and split
        points, _ = grids[variant.label]
        for point in points if len(points) > 1 else []:
            for seed in sweep.tuning_seeds:
                folder = run_folder(out, variant.label, "tune", setting_id(point), seed)
                run(
                    apply_point(variant, point),
                    "tune",
                    setting_id(point),
                    seed,
                    tune_split,
                    options.steps,
                    folder,
                    False,
                )
        if sweep.tuning.tune_only:
            continue
        finals = _final(rows, options.steps)
        means = {
            setting_id(p): statistics.fmean(
                finals[(variant.label, "tune", setting_id(p), s)] for s in sweep.tuning_seeds
            )
            for p in points
            if len(points) > 1
        }
        if len(points) == 1:
            choices[variant.label] = points[0]
            continue
        by_setting = {setting_id(p): p for p in points}
        untuned = untuned_values(variant, list(points[0]), options)
        chosen = choose_setting(means, by_setting, untuned, sweep.tuning.tie_tolerance)
        choices[variant.label] = by_setting[chosen]
    if sweep.tuning.tune_only:
        return {"tuning_losses": tuning_losses_so_far(out, options.steps)}
    for seed in sweep.report_seeds:  # 2. report: each arm's choice on fresh seeds and the report split
        for variant in options.variants:
            point = choices[variant.label]
            folder = run_folder(out, variant.label, "report", setting_id(point), seed, sweep.save_models)
            run(
                apply_point(variant, point),
                "report",
                setting_id(point),
                seed,
                report_split,
                report_eval_steps,
                folder,
                sweep.save_models,
            )
    summary = summarize_sweep(rows, sweep, grids, choices, timing)
    summary["diverged"] = diverged
    summary["splits"] = {
        "tuning": {
            "seeds": sweep.tuning_seeds,
            "blocks": len(tune_split),
            "block_sha1": block_fingerprints(tune_split),
        },
        "report": {
            "seeds": sweep.report_seeds,
            "blocks": len(report_split),
            "block_sha1": block_fingerprints(report_split),
        },
    }
    summary["settings"] = {
        "preset": options.preset,
        "steps": options.steps,
        "block_size": block_size,
        "batch_size": options.batch_size,
        "learning_rate": options.learning_rate,
        "qkmap_lr_multiplier": options.qkmap_lr_multiplier,
        "weight_decay": options.weight_decay,
        "warmup": options.warmup,
        "config": options.config,
        "tune": sweep.tune,
        "tie_tolerance": sweep.tuning.tie_tolerance,
        "data_stats": stats.to_dict(),
        "train_blocks": len(train_set),
    }
    atomic_write_json(out / "summary.json", summary)
    atomic_write_text(out / "summary.md", summary_markdown(summary))
    plot_validation(rows, labels, out / "validation_loss.png")
    return summary


# --------------------------------------------------------------------------------------------------
# Reporting
# --------------------------------------------------------------------------------------------------


def _train_tail(rows: list[dict], arm: str, seed: int, steps: int) -> float | None:
    """Mean logged train loss over the last 20 % of a report run (one logged batch is too noisy)."""
    tail = [
        r["loss"]
        for r in rows
        if r["arm"] == arm
        and r["phase"] == "report"
        and r["seed"] == seed
        and r["split"] == "train"
        and r["step"] > 0.8 * steps
    ]
    return statistics.fmean(tail) if tail else None


def summarize_sweep(rows: list[dict], sweep: SweepOptions, grids: dict, choices: dict, timing: dict) -> dict:
    """Per arm: grid, tuning losses, choice, report losses per seed; paired differences between every two arms."""
    steps = sweep.compare.steps
    finals = _final(rows, steps)
    arms: dict[str, dict] = {}
    for variant in sweep.compare.variants:
        points, inert = grids[variant.label]
        chosen = setting_id(choices[variant.label])
        tuning = {
            setting_id(p): {str(s): finals.get((variant.label, "tune", setting_id(p), s)) for s in sweep.tuning_seeds}
            for p in points
            if len(points) > 1
        }
        report = {
            s: finals[(variant.label, "report", chosen, s)]
            for s in sweep.report_seeds
            if (variant.label, "report", chosen, s) in finals
        }
        train_tail = {s: _train_tail(rows, variant.label, s, steps) for s in report}
        seconds = [v for k, v in timing.items() if k.startswith(f"{variant.label}/")]
        arms[variant.label] = {
            "qk_mode": variant.qk_mode,
            "config": variant.config,
            "train": variant.train,
            "grid": [setting_id(p) for p in points],
            "inert_knobs": inert,
            "tuning_losses": tuning,
            "choice": chosen,
            "choice_values": choices[variant.label],
            "report_losses": {str(s): v for s, v in report.items()},
            "report_mean": statistics.fmean(report.values()) if report else None,
            "report_std": statistics.stdev(report.values()) if len(report) > 1 else None,
            "report_train_losses": {str(s): v for s, v in train_tail.items()},
            "runs": len(seconds),
            "seconds": sum(seconds),
        }
    paired: dict[str, dict] = {}
    for a in arms:
        paired[a] = {}
        for b in arms:
            if a == b:
                continue
            seeds = [s for s in arms[a]["report_losses"] if s in arms[b]["report_losses"]]
            if seeds:
                diffs = [arms[a]["report_losses"][s] - arms[b]["report_losses"][s] for s in seeds]
                paired[a][b] = {**paired_interval(diffs), "per_seed": dict(zip(seeds, diffs, strict=True))}
    return {
        "format": SWEEP_FORMAT,
        "metric": f"validation loss at step {steps} (nats/token)",
        "arms": arms,
        "paired": paired,
    }


def on_grid_edge(choice: float, grid: list[float]) -> bool:
    """Whether a tuning choice is the smallest or largest value of its grid: the grid was too small to say that
    value is best (qkmap_lab/notes/stability.md, qkmap_lab/notes/synthetic-tasks.md)."""
    return choice in (min(grid), max(grid))


def format_interval(entry: dict | None, spec: str = ".4f", single: str = " (n=1)") -> str:
    """A ``paired_interval`` as a table cell, ``mean [low, high]``; ``single`` follows the mean of one pair."""
    if not entry:
        return ""
    if entry["low"] is None:
        return f"{entry['mean']:+{spec}}{single}"
    return f"{entry['mean']:+{spec}} [{entry['low']:+{spec}}, {entry['high']:+{spec}}]"


def summary_markdown(summary: dict) -> str:
    arms = summary["arms"]
    lines = [
        f"Report-split {summary['metric']}; paired differences on the same report seeds, mean [95 % t interval].",
        "",
        "| arm | grid | choice (tuning split) | report seeds | mean | std | vs standard | vs qk_norm |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, arm in arms.items():
        std = f"{arm['report_std']:.4f}" if arm["report_std"] is not None else ""
        mean = f"{arm['report_mean']:.4f}" if arm["report_mean"] is not None else ""
        lines.append(
            f"| {name} | {len(arm['grid'])} | {arm['choice']} | {len(arm['report_losses'])} | {mean} | {std} "
            f"| {format_interval(summary['paired'].get(name, {}).get('standard'))} "
            f"| {format_interval(summary['paired'].get(name, {}).get('qk_norm'))} |"
        )
    lines += ["", "Tuning-split losses (mean over tuning seeds) per grid point:", ""]
    for name, arm in arms.items():
        cells = []
        for setting, by_seed in arm["tuning_losses"].items():
            values = [v for v in by_seed.values() if v is not None]
            cells.append(f"{setting}: {statistics.fmean(values):.4f}" if values else f"{setting}: -")
        inert = f" (inert: {', '.join(arm['inert_knobs'])})" if arm["inert_knobs"] else ""
        lines.append(f"- {name}{inert}: " + ("; ".join(cells) or "grid of one point, no tuning runs"))
    return "\n".join(lines) + "\n"


def plot_validation(rows: list[dict], labels: list[str], path: Path) -> None:
    """Report runs' validation loss per arm: mean over seeds with a min/max band."""
    from ..plotting import new_figure, plot_mean_with_band, save_figure

    curves: dict[str, dict[int, list[float]]] = {label: defaultdict(list) for label in labels}
    for r in rows:
        if r["arm"] in curves and r["phase"] == "report" and r["split"] == "validation":
            curves[r["arm"]][r["step"]].append(r["loss"])
    figure = new_figure()
    axis = figure.add_subplot()
    plot_mean_with_band(axis, curves, tail_fraction=0.3, alpha=0.15)
    axis.set_xlabel("optimizer step")
    axis.set_ylabel("report-split validation loss (nats/token)")
    axis.set_title("validation loss per arm at its tuned setting: mean, min/max over report seeds")
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)
    save_figure(figure, path, dpi=120)


__all__ = [
    "SweepOptions",
    "TuningOptions",
    "arm_grid",
    "block_fingerprints",
    "grid_points",
    "on_grid_edge",
    "paired_interval",
    "parse_tune",
    "run_sweep",
    "setting_id",
    "split_heldout",
    "summarize_sweep",
]
