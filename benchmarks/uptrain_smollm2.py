"""Up-training recipe for converted models, measured: SmolLM2-135M-Instruct converted with ``init="exact"`` vs the
unconverted model, the same up-training (full fine-tuning) on real English text, held-out perplexity curves.

    OMP_NUM_THREADS=1 python benchmarks/uptrain_smollm2.py --output-dir runs/uptrain-smollm2 --steps 200

Arms (``--arms``): ``llama`` (the unconverted model), ``qkmap`` (converted, QK-MAP group at the default
learning rate) and ``qkmap_fast`` (converted, QK-MAP group at ``--fast-qkmap-lr``). Writes ``uptrain.csv``
(arm, step, split, loss, perplexity), ``uptrain.png`` and ``uptrain.json`` (settings, final numbers, and where the
frequencies went: omega quantiles per arm).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
from pathlib import Path

import torch
from transformers import TrainerCallback

import qkmap_hf
from qkmap_hf.assets import shakespeare_files, smollm2_hf_dir
from qkmap_hf.training.data import build_datasets
from qkmap_hf.training.trainer import TrainOptions, load_tokenizer, train


class KeepModel(TrainerCallback):
    """Holds on to the trained model so its frequencies can be read without saving 0.5 GB per arm."""

    model = None

    def on_train_end(self, args, state, control, model=None, **kwargs):
        self.model = model


def omega_summary(model) -> dict | None:
    frequencies = [m.frequency().flatten() for m in model.modules() if type(m).__name__ == "QKMapFeatureMap"]
    if not frequencies:
        return None
    omega = torch.cat(frequencies).double()
    quantiles = torch.quantile(omega, torch.tensor([0.0, 0.5, 0.9, 1.0], dtype=torch.float64)).tolist()
    return dict(zip(("min", "median", "p90", "max"), quantiles, strict=True))


def plot(rows: list[dict], arms: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4.5))
    for arm in arms:
        points = [
            (int(r["step"]), float(r["perplexity"])) for r in rows if r["arm"] == arm and r["split"] == "validation"
        ]
        axis.plot(*zip(*points, strict=True), marker="o", label=arm)
    axis.set_xlabel("optimizer step")
    axis.set_ylabel("held-out perplexity")
    axis.set_title("SmolLM2-135M up-training: converted (exact) vs unconverted")
    axis.grid(alpha=0.3)
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", default="runs/uptrain-smollm2")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--learning-rate", type=float, default=5e-5)
    parser.add_argument("--fast-qkmap-lr", type=float, default=2e-2)
    parser.add_argument("--eval-steps", type=int, default=50)
    parser.add_argument("--max-eval-blocks", type=int, default=24)
    parser.add_argument("--max-tokens", type=int, default=400_000)
    parser.add_argument("--arms", nargs="+", default=["llama", "qkmap_fast"])
    parser.add_argument("--plot-only", action="store_true", help="redraw uptrain.png from uptrain.csv")
    args = parser.parse_args(argv)

    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    if args.plot_only:
        with (out / "uptrain.csv").open() as handle:
            rows = list(csv.DictReader(handle))
        plot(rows, list(dict.fromkeys(r["arm"] for r in rows)), out / "uptrain.png")
        return 0
    source = smollm2_hf_dir()
    converted = out / "smollm2-qkmap-exact"
    if not (converted / "config.json").exists():
        qkmap_hf.convert_checkpoint(source, converted, init="exact", progress=False)
    files = shakespeare_files()

    base = TrainOptions(model=str(source), data=files, output_dir=str(out))
    tokenizer = load_tokenizer(base)
    datasets = build_datasets(
        files, tokenizer, args.block_size, max_eval_blocks=args.max_eval_blocks, max_tokens=args.max_tokens
    )
    arms = {
        "llama": (str(source), None),
        "qkmap": (str(converted), None),
        "qkmap_fast": (str(converted), args.fast_qkmap_lr),
    }
    rows, finals = [], {}
    for arm in args.arms:
        model_dir, qkmap_lr = arms[arm]
        keep = KeepModel()
        result = train(
            TrainOptions(
                model=model_dir, data=files, output_dir=str(out / arm), block_size=args.block_size,
                batch_size=args.batch_size, eval_batch_size=8, learning_rate=args.learning_rate, qkmap_learning_rate=qkmap_lr,
                max_steps=args.steps, eval_steps=args.eval_steps, logging_steps=10, save_steps=0, warmup=10,
                weight_decay=0.0, max_eval_blocks=args.max_eval_blocks, disable_tqdm=True,
            ),
            datasets=datasets, tokenizer=tokenizer, callbacks=[keep], save=False,
        )  # fmt: skip
        for h in result.log_history:
            for key, split in (("loss", "train"), ("eval_loss", "validation")):
                if key in h:
                    rows.append(
                        {"arm": arm, "step": h["step"], "split": split, "loss": h[key], "perplexity": math.exp(h[key])}
                    )
        evals = [h for h in result.log_history if "eval_loss" in h]
        finals[arm] = {
            "start_eval_loss": evals[0]["eval_loss"],
            "final_eval_loss": evals[-1]["eval_loss"],
            "start_perplexity": math.exp(evals[0]["eval_loss"]),
            "final_perplexity": math.exp(evals[-1]["eval_loss"]),
            "qkmap_learning_rate": qkmap_lr,
            "omega": omega_summary(keep.model),
            "seconds": result.wall_seconds,
        }
        with (out / "uptrain.csv").open("w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=["arm", "step", "split", "loss", "perplexity"])
            writer.writeheader()
            writer.writerows(rows)
        (out / "uptrain.json").write_text(
            json.dumps(
                {"settings": vars(args), "data": datasets[2].to_dict() | {"sources": len(files)}, "arms": finals},
                indent=2,
            )
            + "\n"
        )
        print(arm, finals[arm], flush=True)

    plot(rows, args.arms, out / "uptrain.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
