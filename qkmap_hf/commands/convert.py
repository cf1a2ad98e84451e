"""``qkmap convert``: argument parsing over ``qkmap_hf.packaging.convert_checkpoint`` (nothing else).

``conversion/convert_llama_to_qkmap.py`` calls ``main`` here, so the script and the command are one parser.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ..verify import DEFAULT_VERIFY_TOKENS

HELP = "Convert a Llama/Mistral/Qwen2/Qwen3-style checkpoint (safetensors or GGUF) to QK-MAP attention."


@dataclass
class ConvertArguments:
    """What ``qkmap convert`` adds to the conversion group (``ConversionOptions``: --init, --num-frequencies,
    --omega0, --dtype): the source and destination, verification, the card's base model."""

    src: str = field(
        metadata={
            "positional": True,
            "metavar": "SRC",
            "help": "checkpoint folder, repo id in the local HF cache, or .gguf file",
        }
    )
    dst: str = field(metadata={"positional": True, "metavar": "DST", "help": "output folder (written atomically)"})
    gguf_file: str | None = field(default=None, metadata={"help": "GGUF file inside SRC to convert", "metavar": "NAME"})
    verify: str | None = field(
        default=None,
        metadata={"help": "compare with SRC on this text; writes verification.json", "metavar": "TEXTFILE"},
    )
    max_tokens: int = field(default=DEFAULT_VERIFY_TOKENS, metadata={"help": "tokens of TEXTFILE to evaluate"})
    base_model: str | None = field(
        default=None, metadata={"help": "Hub id of the source for the model card", "metavar": "REPO_ID"}
    )
    overwrite: bool = field(
        default=False, metadata={"help": "replace a non-empty DST (only once the new one is complete)", "switch": True}
    )
    progress: bool = field(default=True, metadata={"help": "no progress bar", "switch": True})


def option_classes() -> tuple[type, ...]:
    from ..conversion.options import ConversionOptions

    return (ConvertArguments, ConversionOptions)


def output_folder(args: argparse.Namespace) -> str:
    """The folder whose writer lock the run holds (``qkmap_hf.cli``)."""
    return args.dst


def run(args: argparse.Namespace) -> int:
    from ..conversion.options import ConversionOptions
    from ..flags import options_from_namespace
    from ..packaging import convert_checkpoint

    if args.verify is not None and not Path(args.verify).is_file():
        raise FileNotFoundError(f"--verify {args.verify}: no such text file.")
    options = options_from_namespace(ConversionOptions, args)  # refuses bad values before anything is read
    dst = convert_checkpoint(
        args.src,
        args.dst,
        options,
        gguf_file=args.gguf_file,
        verify_text=Path(args.verify) if args.verify else None,
        max_tokens=args.max_tokens,
        overwrite=args.overwrite,
        base_model=args.base_model,
        progress=args.progress,
    )  # a refusal or Ctrl-C leaves DST untouched (written atomically); qkmap_hf.cli reports it
    print(f"Converted {args.src} -> {dst} (init={args.init})")
    return 0


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """``qkmap convert`` as a program of its own (the conversion script), with qkmap_hf.cli's error handling."""
    from ..cli import run_command

    return run_command("convert", argv, prog)


if __name__ == "__main__":
    sys.exit(main())
