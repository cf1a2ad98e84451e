"""``qkmap compare``: standard vs qk_norm vs qk_map on equal terms (see qkmap_hf/training/compare.py).

Its flags are ``CompareOptions``' fields plus ``TuningFlags`` (the tuning grid, which turns the comparison into a
sweep: qkmap_hf/training/sweep.py).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

from ..flags import check_numbers, collected_by

HELP = "Train standard, qk_norm and qk_map models on equal terms over seeds; write a loss CSV, plots and a summary."


@dataclass
class TuningFlags:
    """``--tune`` and its seeds: given, each arm's setting is chosen on a tuning split and reported on fresh seeds."""

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

    def __post_init__(self) -> None:
        check_numbers(self, positive=("tuning_seeds",), non_negative=("tuning_first_seed",))


def option_classes() -> tuple[type, ...]:
    from ..flags import OverwriteFlag
    from ..training.compare import CompareOptions

    return (CompareOptions, TuningFlags, OverwriteFlag)


def output_folder(args: argparse.Namespace) -> str:
    """The folder whose writer lock the run holds (``qkmap_hf.cli``)."""
    return args.output_dir


def run(args: argparse.Namespace) -> int:
    import qkmap_hf  # noqa: F401  (registers model_type "qkmap" with the Auto classes)

    from ..flags import options_from_namespace
    from ..safety import check_writer
    from ..training.compare import CompareOptions, run_comparison
    from .paths import require_path, require_paths

    if args.task:
        from ..training.synthetic import parse_task

        parse_task(args.task)  # a wrong name or field is refused before anything runs
    elif not args.data:
        raise ValueError(
            "qkmap compare needs --data PATH... or --task NAME (synthetic tasks: docs/synthetic-tasks.md)."
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
    tuning = options_from_namespace(TuningFlags, args)
    if tuning.tune or tuning.save_models:
        from ..training.sweep import SweepOptions, parse_tune, run_sweep

        options.qk_norm_in_qk_group = True
        seeds = list(range(tuning.tuning_first_seed, tuning.tuning_first_seed + tuning.tuning_seeds))
        run_sweep(SweepOptions(options, parse_tune(tuning.tune or []), seeds, save_models=tuning.save_models))
        print((Path(args.output_dir) / "summary.md").read_text())
        print(f"wrote {args.output_dir}/summary.json, summary.md, sweep_losses.csv, validation_loss.png")
        return 0
    result = run_comparison(options)
    print(result.summary_path.read_text())
    print(f"wrote {result.csv_path}, {', '.join(str(p) for p in result.plot_paths)}")
    return 0
