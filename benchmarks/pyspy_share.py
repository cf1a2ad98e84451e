"""Seconds of a py-spy sample file spent under each named function (docs/performance.md, continuous batching).

Reads ``py-spy record --format raw`` output (one collapsed stack and its sample count per line) and prints, for each
function name given, the seconds of samples whose stack passes through a frame containing that name (a stack counts
once per name, however deep the recursion), at the recording's ``--rate``:

    python benchmarks/pyspy_share.py wide.raw --rate 50 sdpa_attention_forward repeat_kv Linear.forward
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def seconds_under(lines: list[str], names: list[str], rate: float) -> dict[str, float]:
    """``{"all samples": s, name: s, ...}`` over collapsed-stack lines ``frame;frame;... COUNT``."""
    totals = {"all samples": 0.0, **dict.fromkeys(names, 0.0)}
    for line in lines:
        stack, _, count = line.rstrip().rpartition(" ")
        if not stack:
            continue
        seconds = int(count) / rate
        totals["all samples"] += seconds
        frames = stack.split(";")
        for name in names:
            if any(name in frame for frame in frames):
                totals[name] += seconds
    return totals


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("raw", type=Path, help="py-spy record --format raw output")
    parser.add_argument("names", nargs="+", help="function names (substrings of py-spy's frame names)")
    parser.add_argument("--rate", type=float, default=50.0, help="py-spy's --rate, samples per second")
    args = parser.parse_args()
    for name, seconds in seconds_under(args.raw.read_text().splitlines(), args.names, args.rate).items():
        print(f"{name:45s} {seconds:8.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
