"""``qkmap heal``: take a converted model into the periodic QK-MAP regime, distilling from its source.

Its flags are ``TrainOptions``' and ``HealOptions``' fields; the positional CONVERTED takes ``--model``'s place.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field

HELP = "Heal a converted QK-MAP checkpoint into the periodic regime (phase schedule + distillation from the source)."


@dataclass
class Converted:
    """The model to heal, given by position; it takes ``--model``'s place (hidden by ``option_overrides``)."""

    converted: str = field(
        metadata={"positional": True, "help": "the converted QK-MAP folder (qkmap convert --init exact)"}
    )


def option_classes() -> tuple[type, ...]:
    from ..flags import OverwriteFlag
    from ..training.heal import HealOptions
    from ..training.options import TrainOptions

    return (Converted, TrainOptions, HealOptions, OverwriteFlag)


def option_overrides() -> dict[str, dict]:
    """``--model`` is CONVERTED here: not required and not shown."""
    return {"model": {"required": False, "help": argparse.SUPPRESS}}


def output_folder(args: argparse.Namespace) -> str:
    """The folder whose writer lock the run holds (``qkmap_hf.cli``)."""
    return args.output_dir


def run(args: argparse.Namespace) -> int:
    import qkmap_hf  # noqa: F401  (registers model_type "qkmap" with the Auto classes)

    from ..flags import options_from_namespace
    from ..safety import check_writer
    from ..training.heal import HealOptions, heal
    from ..training.options import TrainOptions

    args.model = args.converted
    check_writer(args.output_dir, "qkmap heal", overwrite=args.overwrite)
    result = heal(options_from_namespace(TrainOptions, args), options_from_namespace(HealOptions, args))
    if int(os.environ.get("RANK", "0")) == 0:
        loss = result.eval_metrics.get("eval_loss")
        summary = f"saved to {result.output_dir}; rows in heal.json/heal.csv"
        if loss is not None:
            summary += f"; held-out perplexity {result.eval_metrics.get('eval_perplexity', 0):.3f}"
            summary += f", KL to teacher {result.eval_metrics.get('eval_kl_to_teacher', float('nan')):.3e}"
        print(summary)
    return 0
