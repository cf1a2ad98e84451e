"""``qkmap verify``: compare a converted checkpoint with its source (``qkmap_hf.verify.verify_conversion``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HELP = "Compare a converted QK-MAP checkpoint with its source: perplexity, KL, logits, greedy generation, phases."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "src", metavar="SRC", help="source checkpoint folder (or a folder with a GGUF, see --gguf-file)"
    )
    parser.add_argument("dst", metavar="DST", help="converted checkpoint folder")
    parser.add_argument("--text", required=True, metavar="FILE", help="plain-text file to evaluate on")
    parser.add_argument("--max-tokens", type=int, default=512, help="tokens of FILE to evaluate (default 512)")
    parser.add_argument("--generate-tokens", type=int, default=64, help="greedy tokens to compare (default 64)")
    parser.add_argument("--gguf-file", default=None, metavar="NAME", help="GGUF file inside SRC")
    parser.add_argument(
        "--json", default=None, metavar="PATH", help="write the report here (default DST/verification.json)"
    )
    parser.add_argument("--no-save", action="store_true", help="print only; write no JSON")


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
    if not args.no_save:
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
