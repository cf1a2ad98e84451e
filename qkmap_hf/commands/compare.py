"""``qkmap compare``: standard vs qk_norm vs qk_map on equal terms (see qkmap_hf/training/compare.py).

Its flags are ``CompareOptions``' fields (which inherit the data, optimization and run groups of ``qkmap train``)
plus ``TuningOptions`` (the tuning grid, which turns the comparison into a sweep: qkmap_hf/training/sweep.py).
"""

from __future__ import annotations

import argparse
from pathlib import Path

HELP = "Train standard, qk_norm and qk_map models on equal terms over seeds; write a loss CSV, plots and a summary."


def option_classes() -> tuple[type, ...]:
    from ..flags import OverwriteFlag
    from ..training.compare import CompareOptions
    from ..training.sweep import TuningOptions

    return (CompareOptions, TuningOptions, OverwriteFlag)


def output_folder(args: argparse.Namespace) -> str:
    """The folder whose writer lock the run holds (``qkmap_hf.cli``)."""
    return args.output_dir


def run(args: argparse.Namespace) -> int:
    import qkmap_hf  # noqa: F401  (registers model_type "qkmap" with the Auto classes)

    from ..flags import options_from_namespace
    from ..safety import check_writer
    from ..training.compare import CompareOptions, run_comparison
    from ..training.sweep import TuningOptions
    from .paths import require_path, require_paths

    if args.task:
        from ..task_sources import parse_task

        parse_task(args.task)  # a wrong name or field is refused before anything runs
    elif not args.data:
        raise ValueError(
            "qkmap compare needs --data PATH... or --task NAME (synthetic tasks: qkmap_lab/notes/synthetic-tasks.md)."
        )
    else:
        require_paths("--data", args.data)
    check_writer(args.output_dir, "qkmap compare", overwrite=args.overwrite)
    counts = ("steps", "seeds", "block_size", "batch_size", "eval_steps", "logging_steps", "max_tokens")
    for name in counts:  # the library reads a missing count as "the default"; 0 must not become that silently
        value = getattr(args, name)
        if value is not None and value <= 0:
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"{flag} {value}: must be a positive integer (leave it out for the default).")
    require_path("--tokenizer", args.tokenizer, "tokenizer folder", hub_id_ok=True)
    options = options_from_namespace(CompareOptions, args)
    tuning = options_from_namespace(TuningOptions, args)
    if tuning.requested:
        from ..training.sweep import SweepOptions, run_sweep

        options.qk_norm_in_qk_group = True
        result = run_sweep(SweepOptions(options, tuning))
        if tuning.tune_only:
            runs = sum(len(settings) for settings in result["tuning_losses"].values())
            print(f"{runs} tuning runs finished in {args.output_dir}/sweep_losses.csv; run again without --tune-only "
                  "to choose each arm's setting and report it")  # fmt: skip
            return 0
        print((Path(args.output_dir) / "summary.md").read_text())
        print(f"wrote {args.output_dir}/summary.json, summary.md, sweep_losses.csv, validation_loss.png")
        return 0
    result = run_comparison(options)
    print(result.summary_path.read_text())
    print(f"wrote {result.csv_path}, {', '.join(str(p) for p in result.plot_paths)}")
    return 0
