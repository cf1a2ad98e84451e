"""``python -m qkmap_hf.train``: the ``qkmap train`` entry point for launchers.

    torchrun --nproc-per-node 2 -m qkmap_hf.train --model tiny --data corpus.txt --output-dir out
    accelerate launch -m qkmap_hf.train --model tiny --data corpus.txt --output-dir out

Same flags as ``qkmap train``; the Trainer reads the launcher's environment (RANK, WORLD_SIZE...) and runs DDP.
"""

from __future__ import annotations

import argparse
import sys

from .commands import train as train_command


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m qkmap_hf.train", description=train_command.HELP)
    train_command.add_arguments(parser)
    return train_command.run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
