"""``qkmap compare``: standard vs qk_norm vs qk_map on equal terms (see qkmap_hf/training/compare.py)."""

from __future__ import annotations

import argparse
from pathlib import Path

HELP = "Train standard, qk_norm and qk_map models on equal terms over seeds; write a loss CSV, plots and a summary."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ..training.optim import QKMAP_LR_MULTIPLIER
    from ..training.presets import PRESETS

    parser.add_argument("--data", nargs="+", required=True, metavar="PATH", help="text, JSONL or dataset folders")
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--preset", default="tiny", help=f"size preset: {', '.join(PRESETS)}")
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps per run")
    parser.add_argument("--seeds", type=int, default=3, help="number of seeds (first-seed, first-seed+1, ...)")
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument(
        "--variant",
        action="append",
        metavar="LABEL[:FIELD=VALUE,...]",
        help="an arm of the comparison (default: standard, qk_norm, qk_map); repeatable, e.g. "
        "qk_map_f2:qk_mode=qk_map,qkmap_num_frequencies=2",
    )
    parser.add_argument("--config", action="append", metavar="FIELD=VALUE", help="QKMapConfig field for every run")
    parser.add_argument("--tokenizer", help="tokenizer folder (default: byte-level)")
    parser.add_argument("--text-field", default="text")
    parser.add_argument("--block-size", type=int)
    parser.add_argument("--batch-size", type=int)
    parser.add_argument("--learning-rate", type=float)
    parser.add_argument("--qkmap-lr-multiplier", type=float, default=QKMAP_LR_MULTIPLIER)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--warmup", type=float, default=0.05)
    parser.add_argument("--eval-steps", type=int, help="default: steps / 10")
    parser.add_argument("--logging-steps", type=int, help="default: steps / 50")
    parser.add_argument("--max-eval-blocks", type=int, default=64)
    parser.add_argument("--eval-fraction", type=float, default=0.05)
    parser.add_argument("--split-seed", type=int, default=0)
    parser.add_argument("--max-tokens", type=int)
    parser.add_argument("--tune", action="append", metavar="NAME=V1,V2,...",
                        help="tuning grid (repeatable; the cross product is run for every arm), e.g. learning_rate=1e-3,2e-3 "
                        "logit_scale_multiplier=1,4 qk_lr_multiplier=1,10; each arm's choice on the tuning split and "
                        "tuning seeds is rerun on --seeds fresh seeds and reported on a disjoint split")
    parser.add_argument("--tuning-seeds", type=int, default=1, help="seeds per grid point in tuning (default 1)")
    parser.add_argument("--tuning-first-seed", type=int, default=1000, help="first tuning seed (default 1000)")
    parser.add_argument("--save-models", action="store_true", help="keep each report run as a checkpoint in OUT/models")


def run(args: argparse.Namespace) -> int:
    import qkmap_hf  # noqa: F401  (registers model_type "qkmap" with the Auto classes)

    from ..training.compare import CompareOptions, parse_variant, run_comparison
    from ..training.options import parse_overrides
    from .paths import require_path, require_paths

    require_paths("--data", args.data)
    counts = ("steps", "seeds", "block_size", "batch_size", "eval_steps", "logging_steps", "max_tokens")
    for name in counts:  # the library reads a missing count as "the default"; 0 must not become that silently
        value = getattr(args, name)
        if value is not None and value <= 0:
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"{flag} {value}: must be a positive integer (leave it out for the default).")
    require_path("--tokenizer", args.tokenizer, "tokenizer folder", hub_id_ok=True)
    options = CompareOptions(
        data=args.data,
        output_dir=args.output_dir,
        preset=args.preset,
        steps=args.steps,
        seeds=args.seeds,
        first_seed=args.first_seed,
        config=parse_overrides(args.config or []),
        tokenizer=args.tokenizer,
        text_field=args.text_field,
        block_size=args.block_size,
        batch_size=args.batch_size,
        learning_rate=args.learning_rate,
        qkmap_lr_multiplier=args.qkmap_lr_multiplier,
        weight_decay=args.weight_decay,
        warmup=args.warmup,
        eval_steps=args.eval_steps,
        logging_steps=args.logging_steps,
        max_eval_blocks=args.max_eval_blocks,
        eval_fraction=args.eval_fraction,
        split_seed=args.split_seed,
        max_tokens=args.max_tokens,
    )
    if args.variant:
        options.variants = [parse_variant(text) for text in args.variant]
    if args.tune or args.save_models:
        from ..training.sweep import SweepOptions, parse_tune, run_sweep

        options.qk_norm_in_qk_group = True
        tuning_seeds = list(range(args.tuning_first_seed, args.tuning_first_seed + args.tuning_seeds))
        sweep = SweepOptions(options, parse_tune(args.tune or []), tuning_seeds, save_models=args.save_models)
        run_sweep(sweep)
        print((Path(args.output_dir) / "summary.md").read_text())
        print(f"wrote {args.output_dir}/summary.json, summary.md, sweep_losses.csv, validation_loss.png")
        return 0
    result = run_comparison(options)
    print(result.summary_path.read_text())
    print(f"wrote {result.csv_path}, {', '.join(str(p) for p in result.plot_paths)}")
    return 0
