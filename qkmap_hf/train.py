"""``python -m qkmap_hf.train ARGS`` = ``python -m qkmap_hf train ARGS``, kept for launch scripts that use it.

The one entry point is ``qkmap_hf.cli.main`` (``torchrun -m qkmap_hf train ...``); this alias only prepends ``train``.
"""

from __future__ import annotations

import sys

from .cli import run_command


def main(argv: list[str] | None = None) -> int:
    return run_command("train", argv)


if __name__ == "__main__":
    sys.exit(main())
