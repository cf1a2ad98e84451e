"""``python -m qkmap_hf.train ARGS`` = ``python -m qkmap_hf train ARGS``, kept for launch scripts that use it.

The one entry point is ``qkmap_hf.cli.main`` (``torchrun -m qkmap_hf train ...``); this alias only prepends ``train``.
"""

from __future__ import annotations

import sys

from .cli import main as cli_main


def main(argv: list[str] | None = None) -> int:
    return cli_main(["train", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
