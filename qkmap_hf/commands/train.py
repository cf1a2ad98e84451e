"""``qkmap train``: pretrain a size preset or up-train a checkpoint (see qkmap_hf/training/trainer.py).

Its flags are ``TrainOptions``' fields (qkmap_hf/training/options.py). Under a launcher:
``torchrun --nproc-per-node 2 -m qkmap_hf train ...`` or ``accelerate launch -m qkmap_hf train ...``.
"""

from __future__ import annotations

import argparse
import os

HELP = "Train a size preset from scratch or up-train a checkpoint (Trainer; DDP/FSDP under torchrun; --lora)."


def option_classes() -> tuple[type, ...]:
    from ..flags import OverwriteFlag
    from ..training.options import TrainOptions

    return (TrainOptions, OverwriteFlag)


def output_folder(args: argparse.Namespace) -> str:
    """The folder whose writer lock the run holds (``qkmap_hf.cli``)."""
    return args.output_dir


def check_paths(args: argparse.Namespace) -> None:
    """Refuse missing inputs before any model is built (shared with ``qkmap heal``)."""
    from ..training.presets import PRESETS
    from .paths import require_path, require_paths

    if args.model not in PRESETS:
        require_path("--model", args.model, f"size preset ({', '.join(PRESETS)}) or checkpoint folder")
    require_paths("--data", args.data)
    require_path("--tokenizer", args.tokenizer, "tokenizer folder", hub_id_ok=True)
    require_path("--fsdp-config", args.fsdp_config, "JSON file")
    if args.resume not in (None, "latest"):
        require_path("--resume", args.resume, "checkpoint folder")


def run(args: argparse.Namespace) -> int:
    import qkmap_hf  # noqa: F401  (registers model_type "qkmap" with the Auto classes)

    from ..flags import options_from_namespace
    from ..safety import check_writer
    from ..training.trainer import TrainOptions, train

    check_paths(args)
    check_writer(args.output_dir, "qkmap train", overwrite=args.overwrite)
    result = train(options_from_namespace(TrainOptions, args))
    eval_loss = result.eval_metrics.get("eval_loss")
    summary = f"saved to {result.output_dir}"
    if eval_loss is not None:
        summary += f"; held-out loss {eval_loss:.4f}, perplexity {result.eval_metrics.get('eval_perplexity', 0):.3f}"
    if int(os.environ.get("RANK", "0")) == 0:
        print(summary)
    return 0
