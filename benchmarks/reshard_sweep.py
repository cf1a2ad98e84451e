"""Lay a sharded sweep's runs out again over another number of processes, rerunning nothing.

``benchmarks/sharded_compare.sh`` gives shard K every SHARDS-th arm. A sweep resumed with another SHARDS (one
process per arm keeps both cores busy to the end; fewer for the probes and the report) needs its finished runs in
the new layout: this copies every run's rows, timing, divergence record and saved report models from the SOURCE
folders (shard folders, per-arm folders, or a whole unsharded sweep) into ``OUT/shard-K``
(``qkmap_hf.training.sweep.reshard``). OUT must not hold shard folders yet; the sources are left as they are.

    python benchmarks/reshard_sweep.py runs/new --shards 9 --arms "standard qk_norm qk_map" runs/old/shard-*
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout, where no install points at it

from qkmap_hf.training.sweep import reshard  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output_dir", type=Path, help="folder to write shard-0 ... shard-N-1 into")
    parser.add_argument("sources", type=Path, nargs="+", help="sweep folders whose runs to lay out again")
    parser.add_argument("--shards", type=int, required=True, help="number of shard folders (processes)")
    parser.add_argument(
        "--arms",
        required=True,
        help='the arms in the order sharded_compare.sh is given them ("ARM[:OVERRIDES] ..."; only labels count)',
    )
    args = parser.parse_args(argv)
    arms = [spec.split(":", 1)[0] for spec in args.arms.split()]
    try:
        layout = reshard(args.sources, args.output_dir, arms, args.shards)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    for name, shard_arms in layout.items():
        print(f"{args.output_dir / name}: {' '.join(shard_arms)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
