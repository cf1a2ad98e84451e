"""``qkmap convert``: argument parsing over ``qkmap_hf.packaging.convert_checkpoint`` (nothing else).

``conversion/convert_llama_to_qkmap.py`` calls ``main`` here, so the script and the command are one parser.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HELP = "Convert a Llama/Mistral/Qwen2/Qwen3-style checkpoint (safetensors or GGUF) to QK-MAP attention."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", metavar="SRC", help="checkpoint folder, repo id in the local HF cache, or .gguf file")
    parser.add_argument("dst", metavar="DST", help="output folder (written atomically)")
    parser.add_argument(
        "--init",
        choices=("exact", "native", "canonical"),
        default="exact",
        help="exact: function-preserving (omega_0, gains 1/omega_0); native: QKMapConfig's own init (geometric "
        "frequencies, unit gains), drifts; canonical: deprecated name of native",
    )
    parser.add_argument("--num-frequencies", type=int, default=1, metavar="F", help="frequency blocks F (default 1)")
    parser.add_argument("--omega0", type=float, default=1e-3, help="omega_0 of the exact init (default 1e-3)")
    parser.add_argument(
        "--dtype",
        choices=("bfloat16", "float16", "float32"),
        default=None,
        help="output weight dtype (default: source's)",
    )
    parser.add_argument("--gguf-file", default=None, metavar="NAME", help="GGUF file inside SRC to convert")
    parser.add_argument(
        "--verify", default=None, metavar="TEXTFILE", help="compare with SRC on this text; writes verification.json"
    )
    parser.add_argument("--max-tokens", type=int, default=512, help="tokens of TEXTFILE to evaluate (default 512)")
    parser.add_argument("--base-model", default=None, metavar="REPO_ID", help="Hub id of the source for the model card")
    parser.add_argument(
        "--overwrite", action="store_true", help="replace a non-empty DST (only once the new one is complete)"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def output_folder(args: argparse.Namespace) -> str:
    """The folder whose writer lock the run holds (``qkmap_hf.cli``)."""
    return args.dst


def run(args: argparse.Namespace) -> int:
    from ..packaging import convert_checkpoint

    if args.verify is not None and not Path(args.verify).is_file():
        raise FileNotFoundError(f"--verify {args.verify}: no such text file.")
    dst = convert_checkpoint(
        args.src,
        args.dst,
        init=args.init,
        num_frequencies=args.num_frequencies,
        omega0=args.omega0,
        dtype=args.dtype,
        gguf_file=args.gguf_file,
        verify_text=Path(args.verify) if args.verify else None,
        max_tokens=args.max_tokens,
        overwrite=args.overwrite,
        base_model=args.base_model,
        progress=not args.no_progress,
    )  # a refusal or Ctrl-C leaves DST untouched (written atomically); qkmap_hf.cli reports it
    print(f"Converted {args.src} -> {dst} (init={args.init})")
    return 0


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """``qkmap convert`` as a program of its own (the conversion script), with qkmap_hf.cli's error handling."""
    from ..cli import run_command

    return run_command("convert", argv, prog)


if __name__ == "__main__":
    sys.exit(main())
