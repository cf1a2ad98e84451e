"""``qkmap demo``: the main job end to end on the embedded default checkpoint (see qkmap_hf/demo.py)."""

from __future__ import annotations

import argparse

HELP = "convert, verify, evaluate, stage and reload the real SmolLM2-135M checkpoint, end to end"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--output-dir", default="runs/demo", help="where the converted model and reports go")
    parser.add_argument("--eval-limit", type=int, default=16, help="documents per lm-eval task (default: 16)")
    parser.add_argument("--verify-tokens", type=int, default=512, help="tokens of held-out text to verify on")


def run(args: argparse.Namespace) -> int:
    from ..demo import run_demo

    run_demo(args.output_dir, eval_limit=args.eval_limit, verify_tokens=args.verify_tokens)
    return 0
