"""``qkmap train``: pretrain a size preset or up-train a checkpoint (see qkmap_hf/training/trainer.py)."""

from __future__ import annotations

import argparse
import os

HELP = "Train a size preset from scratch or up-train a checkpoint (Trainer; DDP/FSDP under torchrun; --lora)."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ..training.options import add_train_arguments

    add_train_arguments(parser)


def run(args: argparse.Namespace) -> int:
    import qkmap_hf  # noqa: F401  (registers model_type "qkmap" with the Auto classes)

    from ..training.presets import PRESETS
    from ..training.trainer import TrainOptions, train
    from .paths import require_path, require_paths

    if args.model not in PRESETS:
        require_path("--model", args.model, f"size preset ({', '.join(PRESETS)}) or checkpoint folder")
    require_paths("--data", args.data)
    require_path("--tokenizer", args.tokenizer, "tokenizer folder", hub_id_ok=True)
    require_path("--fsdp-config", args.fsdp_config, "JSON file")
    if args.resume not in (None, "latest"):
        require_path("--resume", args.resume, "checkpoint folder")
    result = train(TrainOptions.from_args(args))
    eval_loss = result.eval_metrics.get("eval_loss")
    summary = f"saved to {result.output_dir}"
    if eval_loss is not None:
        summary += f"; held-out loss {eval_loss:.4f}, perplexity {result.eval_metrics.get('eval_perplexity', 0):.3f}"
    if int(os.environ.get("RANK", "0")) == 0:
        print(summary)
    return 0
