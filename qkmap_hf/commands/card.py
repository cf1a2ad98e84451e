"""``qkmap card MODEL [--eval-results OUT] [--analysis OUT]``: write README.md (the model card) in MODEL."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field

HELP = "Write the model card (README.md) of a checkpoint: QK-MAP settings, provenance, lm-eval scores, analysis plots."


@dataclass
class CardArguments:
    """What ``qkmap card`` takes: ``write_model_card``'s inputs, one flag each."""

    model: str = field(
        metadata={"positional": True, "help": "checkpoint folder (config.json); README.md is written there"}
    )
    eval_results: str | None = field(
        default=None, metadata={"help": "lm-eval results_*.json, or the --output-path folder of `qkmap eval`"}
    )
    analysis: str | None = field(
        default=None, metadata={"help": "--output-dir of `qkmap analyze` (its plots are copied into MODEL/analysis)"}
    )
    provenance: str | None = field(
        default=None, metadata={"help": "extra provenance record (JSON file; its 'kind' names the section)"}
    )
    license: str | None = field(
        default=None, metadata={"help": "license id for the card (default: from provenance records, else apache-2.0)"}
    )
    name: str | None = field(
        default=None, metadata={"help": "model name / Hub repo id shown in the card and model-index"}
    )
    overwrite: bool = field(
        default=False, metadata={"help": "replace a README.md not written by qkmap card", "switch": True}
    )


def option_classes() -> tuple[type, ...]:
    return (CardArguments,)


def output_folder(args: argparse.Namespace) -> str:
    """The folder whose writer lock the run holds (``qkmap_hf.cli``)."""
    return args.model


def run(args: argparse.Namespace) -> int:
    from ..cards import write_model_card
    from .paths import require_path

    require_path("MODEL", args.model, "checkpoint folder")
    require_path("--eval-results", args.eval_results)
    require_path("--analysis", args.analysis, "folder")
    require_path("--provenance", args.provenance, "JSON file")
    provenance = None
    if args.provenance:
        with open(args.provenance, encoding="utf-8") as handle:
            provenance = json.load(handle)
        if not isinstance(provenance, dict):
            raise ValueError(f"--provenance {args.provenance}: must hold a JSON object (with a 'kind' field).")
    path = write_model_card(
        args.model,
        provenance=provenance,
        eval_results=args.eval_results,
        analysis_dir=args.analysis,
        license=args.license,
        model_name=args.name,
        overwrite=args.overwrite,
    )
    print(f"wrote {path}")
    return 0
