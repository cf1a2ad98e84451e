"""Issue 10 under the project's research standard: ``qkmap heal`` against the Llama arm with equal tuning effort.

Both arms get the same learning-rate grid (``--learning-rates``), run with the tuning seed and scored on the
**tuning split**; each arm's best point is rerun with fresh **report seeds** and scored on the disjoint **report
split** (the held-out blocks cut in two halves, as ``qkmap compare --tune`` cuts them). The heal runs with every
``qkmap heal`` default (recipe 2); its gains keep ``--qkmap-learning-rate``, which is not tuned (the Llama arm has
no counterpart). Reported: per-block paired differences of the mean token loss (heal minus Llama, averaged over
the report seeds) with a 95 % Student t interval over the report blocks, the perplexity ratio with its interval,
per-seed ratios, phases, cos energy share, KL to the teacher and attention behaviour.

    python benchmarks/heal_tuned.py --output-dir runs/heal-tuned --workers 2     # resumable: rerun to continue
    python benchmarks/heal_tuned.py --output-dir runs/heal-tuned --markdown      # the docs tables

Each run lives in ``OUT/runs/<arm>-lr<lr>-seed<seed>-<split>/`` with its ``result.json`` (written last: a run
without it is resumed from its newest checkpoint). Tuning runs delete their weights once scored.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import math
import multiprocessing
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

BENCHMARKS = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCHMARKS))

from heal_smollm2 import attention_behaviour  # noqa: E402

import qkmap_hf  # noqa: E402
from qkmap_hf.assets import shakespeare_files, smollm2_hf_dir  # noqa: E402
from qkmap_hf.fileio import atomic_write_json  # noqa: E402
from qkmap_hf.training.data import build_datasets  # noqa: E402
from qkmap_hf.training.sweep import block_fingerprints, format_interval, paired_interval, split_heldout  # noqa: E402

ARMS = ("heal", "llama")


def run_id(arm: str, learning_rate: float, seed: int, split: str) -> str:
    return f"{arm}-lr{learning_rate:g}-seed{seed}-{split}"


def run_folder(out: Path, job: dict) -> Path:
    return out / "runs" / run_id(**job)


def training_files() -> list[str]:
    """The Shakespeare files of the cached package without the Milton files (docs/healing.md's training text)."""
    return shakespeare_files()


def load_data(args: argparse.Namespace, tokenizer) -> dict:
    train_set, held_out, stats = build_datasets(
        training_files(), tokenizer, args.block_size, max_eval_blocks=args.held_out_blocks, max_tokens=args.max_tokens
    )
    tuning, report = split_heldout(held_out)
    return {"train": train_set, "tune": tuning, "report": report, "stats": stats}


@torch.no_grad()
def block_losses(folder: Path, blocks: torch.Tensor, batch_size: int = 8) -> list[float]:
    """Mean next-token loss of every block (the unit the paired intervals are taken over)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    losses: list[float] = []
    for start in range(0, len(blocks), batch_size):
        batch = blocks[start : start + batch_size]
        logits = model(input_ids=batch).logits[:, :-1].float()
        token_losses = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1), reduction="none"
        )
        losses += token_losses.view(len(batch), -1).mean(dim=1).tolist()
    return losses


def run_one(job: dict, args: dict) -> dict:
    """One training run in a worker process (one thread); returns and writes its ``result.json``."""
    torch.set_num_threads(1)
    from qkmap_hf.training.heal import HealOptions, heal
    from qkmap_hf.training.trainer import TrainOptions, load_tokenizer, train

    out = Path(args["output_dir"])
    run_dir = run_folder(out, job)
    run_dir.mkdir(parents=True, exist_ok=True)
    source, files = smollm2_hf_dir(), training_files()
    with open(run_dir / "log.txt", "a") as log, contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        started = time.time()
        namespace = argparse.Namespace(**args)
        tokenizer = load_tokenizer(TrainOptions(model=str(source), data=files, output_dir=str(run_dir)))
        data = load_data(namespace, tokenizer)
        scored = data[job["split"]]
        options = TrainOptions(
            model=str(source if job["arm"] == "llama" else out / "smollm2-qkmap-exact"), data=files,
            output_dir=str(run_dir), block_size=args["block_size"], batch_size=args["batch_size"], eval_batch_size=8,
            learning_rate=job["learning_rate"], qkmap_learning_rate=args["qkmap_learning_rate"], seed=job["seed"],
            max_steps=args["steps"], eval_steps=args["eval_steps"], logging_steps=10, save_steps=args["save_steps"],
            save_total_limit=1, warmup=0.05, weight_decay=0.0, max_eval_blocks=args["held_out_blocks"],
            resume="latest" if any(run_dir.glob("checkpoint-*")) else None,
        )  # fmt: skip
        datasets = (data["train"], scored, data["stats"])
        result = {"job": job, "scored_blocks": block_fingerprints(scored)}
        if job["arm"] == "llama":
            trained = train(options, datasets=datasets, tokenizer=tokenizer, save=True)
        else:
            trained = heal(options, HealOptions(teacher=str(source)), datasets=datasets, tokenizer=tokenizer)
            rows = json.loads((run_dir / "heal.json").read_text())["evaluations"]
            result["heal_final_row"] = rows[-1]
            result["heal_first_row"] = rows[0]
        result["train_seconds"] = trained.wall_seconds
        result["block_losses"] = block_losses(run_dir, scored.blocks)
        result["mean_loss"] = statistics.fmean(result["block_losses"])
        result["perplexity"] = math.exp(result["mean_loss"])
        if job["split"] == "report":
            result["behaviour"] = attention_behaviour(str(run_dir), tokenizer)
        result["seconds"] = time.time() - started
        for checkpoint in run_dir.glob("checkpoint-*"):
            shutil.rmtree(checkpoint)
        if job["split"] == "tune":  # scored: the weights are not needed again
            for weights in run_dir.glob("*.safetensors"):
                weights.unlink()
        atomic_write_json(run_dir / "result.json", result)
    return result


def read_result(out: Path, job: dict) -> dict | None:
    path = run_folder(out, job) / "result.json"
    return json.loads(path.read_text()) if path.exists() else None


def choice(out: Path, arm: str, args: argparse.Namespace) -> float | None:
    """The arm's learning rate with the lowest mean tuning loss (over the tuning seeds), once all are in."""
    losses = {}
    for learning_rate in args.learning_rates:
        results = [read_result(out, tuning_job(arm, learning_rate, seed)) for seed in args.tuning_seeds]
        if any(r is None for r in results):
            return None
        losses[learning_rate] = statistics.fmean(r["mean_loss"] for r in results)
    return min(losses, key=losses.get)


def tuning_job(arm: str, learning_rate: float, seed: int) -> dict:
    return {"arm": arm, "learning_rate": learning_rate, "seed": seed, "split": "tune"}


def report_job(arm: str, learning_rate: float, seed: int) -> dict:
    return {"arm": arm, "learning_rate": learning_rate, "seed": seed, "split": "report"}


def summarize(out: Path, args: argparse.Namespace) -> dict:
    """Tuning table, choices, report losses per seed, the paired per-block interval and the verdict."""
    summary: dict = {"settings": {k: v for k, v in vars(args).items() if k != "markdown"}, "arms": {}}
    for arm in ARMS:
        tuning = {
            f"{lr:g}": [(read_result(out, tuning_job(arm, lr, s)) or {}).get("mean_loss") for s in args.tuning_seeds]
            for lr in args.learning_rates
        }
        chosen = choice(out, arm, args)
        report = {}
        if chosen is not None:
            for seed in args.report_seeds:
                result = read_result(out, report_job(arm, chosen, seed))
                if result is not None:
                    report[str(seed)] = result
        summary["arms"][arm] = {"tuning_losses": tuning, "choice": chosen, "report": report}
    heal_report, llama_report = summary["arms"]["heal"]["report"], summary["arms"]["llama"]["report"]
    seeds = [s for s in map(str, args.report_seeds) if s in heal_report and s in llama_report]
    if seeds:
        per_block = [
            statistics.fmean(heal_report[s]["block_losses"][b] - llama_report[s]["block_losses"][b] for s in seeds)
            for b in range(len(heal_report[seeds[0]]["block_losses"]))
        ]
        blocks = paired_interval(per_block)
        by_seed = paired_interval([heal_report[s]["mean_loss"] - llama_report[s]["mean_loss"] for s in seeds])
        ratio = {key: None if blocks[key] is None else math.exp(blocks[key]) for key in ("mean", "low", "high")}
        target = 1.05
        verdict = (
            "supported" if ratio["high"] is not None and ratio["high"] <= target
            else "not supported" if ratio["low"] is not None and ratio["low"] > target
            else "inconclusive"
        )  # fmt: skip
        summary["paired"] = {
            "seeds": seeds,
            "per_block_loss_difference": blocks,
            "per_seed_loss_difference": by_seed,
            "perplexity_ratio": ratio,
            "per_seed_ratio": {s: heal_report[s]["perplexity"] / llama_report[s]["perplexity"] for s in seeds},
            "target": target,
            "verdict": f"perplexity ratio <= {target}: {verdict}",
        }
    return summary


def markdown(summary: dict) -> str:
    lines = [
        "| arm | learning rate: tuning loss (tuning seed) | choice | report perplexity per seed |",
        "|---|---|---|---|",
    ]
    for arm, entry in summary["arms"].items():
        tuning = "; ".join(
            f"{lr}: {'/'.join('-' if v is None else f'{v:.4f}' for v in values)}"
            for lr, values in entry["tuning_losses"].items()
        )
        report = ", ".join(f"seed {s}: {r['perplexity']:.2f}" for s, r in entry["report"].items())
        lines.append(f"| {arm} | {tuning} | {entry['choice']} | {report} |")
    paired = summary.get("paired")
    if paired:
        ratio = paired["perplexity_ratio"]
        lines += [
            "",
            f"- Per-block paired loss difference (heal - Llama, {len(paired['seeds'])} seed(s) averaged): "
            + format_interval(paired["per_block_loss_difference"]),
            f"- Perplexity ratio heal / Llama: {ratio['mean']:.3f} [{ratio['low']:.3f}, {ratio['high']:.3f}] (95 %)",
            "- Per seed: " + ", ".join(f"seed {s}: {v:.3f}" for s, v in paired["per_seed_ratio"].items()),
            "- Per-seed paired loss difference: " + format_interval(paired["per_seed_loss_difference"]),
            f"- {paired['verdict']}",
        ]
        for seed in paired["seeds"]:
            row = summary["arms"]["heal"]["report"][seed]["heal_final_row"]
            lines.append(
                f"- heal seed {seed}: regime {row['regime']}, p90 phase {min(row['phase_p90']):.2f}-"
                f"{max(row['phase_p90']):.2f}, cos share {min(row['cos_energy_share']):.3f}-"
                f"{max(row['cos_energy_share']):.3f}, KL to teacher {row['kl_to_teacher']:.3f}"
            )
        for arm in ARMS:
            for seed, result in summary["arms"][arm]["report"].items():
                behaviour = result.get("behaviour") or {}
                lines.append(
                    f"- {arm} seed {seed}: first-token mass {behaviour.get('first_token_mass', float('nan')):.4f}, "
                    f"mean attention distance {behaviour.get('mean_attention_distance', float('nan')):.2f}"
                )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", default="runs/heal-tuned")
    parser.add_argument("--learning-rates", nargs="+", type=float, default=[5e-5, 1e-4, 2e-4])
    parser.add_argument("--tuning-seeds", nargs="+", type=int, default=[1000])
    parser.add_argument("--report-seeds", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--qkmap-learning-rate", type=float, default=5e-3)
    parser.add_argument("--eval-steps", type=int, default=100)
    parser.add_argument("--save-steps", type=int, default=50)
    parser.add_argument("--held-out-blocks", type=int, default=48, help="cut in half: tuning split, report split")
    parser.add_argument("--max-tokens", type=int, default=400_000)
    parser.add_argument("--workers", type=int, default=2, help="runs at a time, one thread each")
    parser.add_argument("--markdown", action="store_true", help="print the tables from the finished runs")
    args = parser.parse_args(argv)
    overlap = set(args.tuning_seeds) & set(args.report_seeds)
    if overlap:
        parser.error(f"tuning and report seeds share {sorted(overlap)}; the report needs fresh seeds")
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    if args.markdown:
        print(markdown(summarize(out, args)))
        return 0
    converted = out / "smollm2-qkmap-exact"
    if not (converted / "config.json").exists():
        qkmap_hf.convert_checkpoint(smollm2_hf_dir(), converted, init="exact", progress=False)
    shared = {k: v for k, v in vars(args).items() if k != "markdown"}
    pending = [tuning_job(arm, lr, s) for arm in ARMS for lr in args.learning_rates for s in args.tuning_seeds]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    submitted: set[str] = set()
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=args.workers, mp_context=context) as pool:
        running: dict = {}
        while True:
            for arm in ARMS:  # an arm's report runs start as soon as its tuning is complete
                chosen = choice(out, arm, args)
                if chosen is not None:
                    pending += [report_job(arm, chosen, s) for s in args.report_seeds]
            for job in pending:
                key = run_id(**job)
                if key in submitted:
                    continue
                submitted.add(key)
                if read_result(out, job) is None:
                    running[pool.submit(run_one, job, shared)] = key
                    print(f"[heal-tuned] queued {key}", flush=True)
            pending = []
            if not running:
                break
            done, _ = concurrent.futures.wait(running, return_when=concurrent.futures.FIRST_COMPLETED)
            for future in done:
                key = running.pop(future)
                result = future.result()
                print(
                    f"[heal-tuned] {key}: perplexity {result['perplexity']:.3f} ({result['seconds']:.0f} s)", flush=True
                )
            summary = summarize(out, args)
            atomic_write_json(out / "summary.json", summary)
    summary = summarize(out, args)
    atomic_write_json(out / "summary.json", summary)
    print(markdown(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
