"""One grid shape's training step, variant by variant in one process: time, minor page faults and (``--profile``)
torch.profiler's self time per op, averaged over steps, with the ops whose time differs most between the last
variant and the first (docs/performance.md, "The misses that remain").

The variants are built as the grid builds them (``attention_overhead.build``, ``shape_grid.shape_size``) and live in
one process, as in the grid. Each repeat runs every variant in turn: a forward without gradients (``--forward-first``,
as the grid does), then one timed training step. ``--saved-bytes-first`` runs the grid's saved-bytes pass (a forward
under ``saved_tensors_hooks``) for every variant before timing, as the grid does. Minor page faults are
``getrusage``'s: pages the step touched for the first time, e.g. fresh ``mmap``s of glibc's large blocks.

    python benchmarks/step_profile.py --head-dim 64 --heads 8 --kv-ratio 1 --layers 8 --seq-len 2048 --threads 2 \\
        --repeats 4 --forward-first --saved-bytes-first
    python benchmarks/step_profile.py --head-dim 64 --heads 16 --kv-ratio 1 --layers 8 --seq-len 2048 --threads 2 \\
        --repeats 3 --profile
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).parent))
from attention_overhead import VARIANTS, add_threads_option, build, saved_bytes_rows, use_threads  # noqa: E402
from shape_grid import shape_label, shape_size  # noqa: E402

DEFAULT_VARIANTS = ("standard", "qk_map_compact_kernels", "qk_map_wide_recompute_kernels")  # the product defaults


def minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def training_step(model, ids: torch.Tensor) -> None:
    model(ids, labels=ids).loss.backward()
    model.zero_grad(set_to_none=True)


def op_times(model, ids: torch.Tensor) -> dict[str, float]:
    """Self CPU milliseconds per op name of one profiled training step."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        training_step(model, ids)
    return {event.key: event.self_cpu_time_total / 1e3 for event in prof.key_averages()}


def measure(args: argparse.Namespace) -> dict[str, dict]:
    """Per variant: step seconds and minor faults of every repeat and, with ``--profile``, mean ms per op."""
    size = shape_size(args.head_dim, args.heads, args.kv_ratio, args.layers)
    ids = torch.randint(0, size["vocab_size"], (1, args.seq_len), generator=torch.Generator().manual_seed(0))
    models = {name: build(name, "cpu", torch.float32, "sdpa", size) for name in args.variants}
    if args.saved_bytes_first:
        for name, model in models.items():
            saved_bytes_rows(name, model, ids)
    results = {name: {"seconds": [], "faults": [], "ops": defaultdict(float)} for name in models}
    for repeat in range(-1, args.repeats):  # repeat -1: warm-up, dropped
        for name, model in models.items():
            if args.forward_first:
                with torch.no_grad():
                    model(ids)
            faults, start = minor_faults(), time.perf_counter()
            training_step(model, ids)
            seconds, faults = time.perf_counter() - start, minor_faults() - faults
            if repeat < 0:
                continue
            results[name]["seconds"].append(seconds)
            results[name]["faults"].append(faults)
            if args.profile:
                for op, ms in op_times(model, ids).items():
                    results[name]["ops"][op] += ms / args.repeats
    return results


def report(args: argparse.Namespace, results: dict[str, dict]) -> str:
    first, last = args.variants[0], args.variants[-1]
    base = results[first]["seconds"]
    lines = [
        f"{shape_label(shape_size(args.head_dim, args.heads, args.kv_ratio, args.layers))} T={args.seq_len} "
        f"threads={torch.get_num_threads()} repeats={args.repeats} forward_first={args.forward_first} "
        f"saved_bytes_first={args.saved_bytes_first}",
        f"| variant | step | ratio to {first} [range] | minor faults per step |",
        "|---|---|---|---|",
    ]
    for name, result in results.items():
        ratios = [s / b for s, b in zip(result["seconds"], base, strict=True)]
        lines.append(
            f"| {name} | {1e3 * statistics.median(result['seconds']):.1f} ms | {statistics.median(ratios):.3f}x "
            f"[{min(ratios):.3f}-{max(ratios):.3f}] | {statistics.median(result['faults']):.0f} |"
        )
    if args.profile:
        ops_first, ops_last = results[first]["ops"], results[last]["ops"]
        lines += ["", f"| op | {first} | {last} | difference |", "|---|---|---|---|"]
        names = sorted(set(ops_first) | set(ops_last), key=lambda op: -abs(ops_last[op] - ops_first[op]))
        for op in names[: args.profile_rows]:
            a, b = ops_first[op], ops_last[op]
            lines.append(f"| `{op}` | {a:.1f} ms | {b:.1f} ms | {b - a:+.1f} ms |")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--heads", type=int, default=8, help="query heads")
    p.add_argument("--kv-ratio", type=int, default=1, help="query heads per key/value head")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--variants", nargs="+", choices=sorted(VARIANTS), default=list(DEFAULT_VARIANTS))
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--forward-first", action="store_true", help="a forward without gradients before each step")
    p.add_argument("--saved-bytes-first", action="store_true", help="the grid's saved-bytes pass before timing")
    p.add_argument("--profile", action="store_true", help="also profile every timed step (ops averaged)")
    p.add_argument("--profile-rows", type=int, default=18)
    add_threads_option(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    use_threads(args)
    print(report(args, measure(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
