"""The ``qkmap`` command: a thin layer of argument parsing over the library API.

Each subcommand lives in ``qkmap_hf/commands/<name>.py`` and defines ``HELP`` (one line),
``add_arguments(parser)`` and ``run(args) -> int``. A module that forwards its arguments untouched to
another program (``qkmap eval`` hands over to lm-eval's CLI) defines ``run_raw(argv) -> int`` instead.
Modules load only when their command runs, so ``qkmap --help`` stays fast.
"""

from __future__ import annotations

import argparse
import sys
from importlib import import_module

from .version import __version__

COMMANDS: dict[str, str] = {
    "demo": "qkmap_hf.commands.demo",
    "convert": "qkmap_hf.commands.convert",
    "verify": "qkmap_hf.commands.verify",
    "train": "qkmap_hf.commands.train",
    "heal": "qkmap_hf.commands.heal",
    "compare": "qkmap_hf.commands.compare",
    "eval": "qkmap_hf.commands.eval",
    "analyze": "qkmap_hf.commands.analyze",
    "card": "qkmap_hf.commands.card",
    "push": "qkmap_hf.commands.push",
}


def _command_module(name: str):
    return import_module(COMMANDS[name])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="qkmap",
        description="QK-MAP attention for Hugging Face transformers: convert, train, evaluate and publish models.",
    )
    parser.add_argument("--version", action="version", version=f"qkmap-hf {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        module = _command_module(name)
        sub = subparsers.add_parser(name, help=module.HELP, description=module.HELP, add_help=not hasattr(module, "run_raw"))
        if hasattr(module, "add_arguments"):
            module.add_arguments(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in COMMANDS and hasattr(module := _command_module(argv[0]), "run_raw"):
        return int(module.run_raw(argv[1:]) or 0)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    return int(_command_module(args.command).run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
