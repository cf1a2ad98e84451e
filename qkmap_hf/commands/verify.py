"""``qkmap verify``: compare a converted checkpoint with its source (``qkmap_hf.verify.verify_conversion``)."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ..verify import DEFAULT_GENERATE_TOKENS, DEFAULT_VERIFY_TOKENS

HELP = "Compare a converted QK-MAP checkpoint with its source: perplexity, KL, logits, greedy generation, phases."


@dataclass
class VerifyArguments:
    """What ``qkmap verify`` takes: ``verify_conversion``'s inputs (its defaults) and where the report goes."""

    src: str = field(
        metadata={
            "positional": True,
            "metavar": "SRC",
            "help": "source checkpoint folder (or a folder with a GGUF, see --gguf-file)",
        }
    )
    dst: str = field(metadata={"positional": True, "metavar": "DST", "help": "converted checkpoint folder"})
    text: str = field(metadata={"help": "plain-text file to evaluate on", "metavar": "FILE"})
    max_tokens: int = field(default=DEFAULT_VERIFY_TOKENS, metadata={"help": "tokens of FILE to evaluate"})
    generate_tokens: int = field(default=DEFAULT_GENERATE_TOKENS, metadata={"help": "greedy tokens to compare"})
    gguf_file: str | None = field(default=None, metadata={"help": "GGUF file inside SRC", "metavar": "NAME"})
    json: str | None = field(
        default=None, metadata={"help": "write the report here (default DST/verification.json)", "metavar": "PATH"}
    )
    save: bool = field(default=True, metadata={"help": "print only; write no JSON", "switch": True})


def option_classes() -> tuple[type, ...]:
    return (VerifyArguments,)


def run(args: argparse.Namespace) -> int:
    from ..filenames import VERIFICATION_NAME
    from ..verify import verify_conversion
    from .paths import require_path

    require_path("SRC", args.src, "checkpoint folder", hub_id_ok=True)
    require_path("DST", args.dst, "checkpoint folder")
    if not Path(args.text).is_file():
        raise FileNotFoundError(f"--text {args.text}: no such file.")
    report = verify_conversion(
        args.src,
        args.dst,
        Path(args.text),
        max_tokens=args.max_tokens,
        generate_tokens=args.generate_tokens,
        source_gguf_file=args.gguf_file,
    )
    print(report.table())
    if args.save:
        path = report.save(args.json or Path(args.dst) / VERIFICATION_NAME)
        print(f"wrote {path}")
    if report.non_finite():
        raise ValueError(
            f"{args.dst}: verification gave non-finite {', '.join(report.non_finite())}; a model is broken."
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    """``qkmap verify`` as a program of its own, with qkmap_hf.cli's error handling."""
    from ..cli import run_command

    return run_command("verify", argv)


if __name__ == "__main__":
    sys.exit(main())
