"""The attention kernel alone: sdpa against the fused CPU attention (``qkmap_fused_attention``), forward and
forward+backward, per shape and length, every path interleaved in each repeat.

The grid (``shape_grid.py``) times whole models against standard attention, which runs torch's sdpa. The fused
attention is a different kernel, so part of what the wide layout gains there is the kernel's, not the layout's. This
separates the two, on one layer's causal attention at the grid's shapes (queries and keys token-major views, as the
model makes them; one sequence):

- ``standard_sdpa``: standard attention's call, queries/keys/values ``head_dim`` wide (the grid's reference);
- ``wide_sdpa_padded``: the wide layout before the fused attention, keys ``2 head_dim`` wide and values zero-padded
  to that width (the output sliced back by the model);
- ``wide_fused``: the wide layout now, keys ``2 head_dim`` wide, values ``head_dim``;
- ``standard_fused``: the fused kernel at standard's widths, which the model never runs: the kernel's own speed
  against sdpa, so ``wide_fused / standard_fused`` is the wide layout's attention cost on one kernel.

Every ratio is per repeat against ``standard_sdpa`` (median [min-max] over repeats), plus ``wide_fused`` against
``standard_fused``.

    python benchmarks/attention_kernel.py --threads 2 --head-dims 64 128 --heads 2 8 16 --kv-ratios 1 4 \\
        --seq-lens 512 2048 --output-dir runs/attention_kernel
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.nn import functional as F

from qkmap_hf.modeling.attention_qkmap import FusedCausalAttention

sys.path.insert(0, str(Path(__file__).parent))
from attention_overhead import add_threads_option, require_fused_kernel, use_threads  # noqa: E402
from shape_grid import add_kernel_shape_options, grid_shapes, shape_label, write_kernel_run  # noqa: E402

REFERENCE = "standard_sdpa"
# path -> (key width, value width as multiples of head_dim, kernel)
PATHS = {
    "standard_sdpa": (1, 1, "sdpa"),
    "wide_sdpa_padded": (2, 2, "sdpa"),
    "wide_fused": (2, 1, "fused"),
    "standard_fused": (1, 1, "fused"),
}
DIRECTIONS = ("forward", "train")  # train: forward and backward
FIELDS = ("shape", "seq_len", "direction", "path", "ms", "ratio", "ratio_min", "ratio_max")


def path_inputs(size: dict, seq_len: int, path: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One layer's queries, keys and values for ``path``: token-major views, needing gradients."""
    key_factor, value_factor, _ = PATHS[path]
    head_dim, heads, kv_heads = size["head_dim"], size["num_attention_heads"], size["num_key_value_heads"]
    generator = torch.Generator().manual_seed(0)

    def token_major(count: int, width: int) -> torch.Tensor:
        return torch.randn(1, seq_len, count, width, generator=generator).transpose(1, 2).requires_grad_()

    key_width = key_factor * head_dim
    return (
        token_major(heads, key_width),
        token_major(kv_heads, key_width),
        token_major(kv_heads, value_factor * head_dim),
    )


def attend(path: str, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """The path's call, as the model makes it (sdpa with ``enable_gqa``; the fused kernel through its autograd
    node)."""
    scale = query.shape[-1] ** -0.5
    if PATHS[path][2] == "fused":
        return FusedCausalAttention.apply(query, key, value, scale)
    return F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scale, enable_gqa=True)


def timed_call(path: str, inputs: tuple, direction: str) -> float:
    start = time.perf_counter()
    if direction == "forward":
        with torch.no_grad():
            attend(path, *inputs)
    else:
        output = attend(path, *inputs)
        torch.autograd.grad(output, inputs, torch.ones_like(output))
    return time.perf_counter() - start


def measure(size: dict, seq_len: int, args: argparse.Namespace) -> dict[tuple[str, str], list[float]]:
    """Per (direction, path), the mean seconds of ``--calls`` calls in each repeat; paths alternate, their order
    rotating per repeat."""
    inputs = {path: path_inputs(size, seq_len, path) for path in args.paths}
    times = {(direction, path): [] for direction in DIRECTIONS for path in args.paths}
    for direction in DIRECTIONS:
        for path in args.paths:
            timed_call(path, inputs[path], direction)  # warm-up
        for repeat in range(args.repeats):
            shift = repeat % len(args.paths)
            for path in args.paths[shift:] + args.paths[:shift]:
                seconds = [timed_call(path, inputs[path], direction) for _ in range(args.calls)]
                times[(direction, path)].append(sum(seconds) / args.calls)
    return times


def rows_of(label: str, seq_len: int, times: dict, paths: list[str]) -> list[dict]:
    rows = []
    pairs = [(path, REFERENCE) for path in paths]
    if {"wide_fused", "standard_fused"} <= set(paths):
        pairs.append(("wide_fused", "standard_fused"))
    for direction in DIRECTIONS:
        for path, reference in pairs:
            ratios = [a / b for a, b in zip(times[(direction, path)], times[(direction, reference)], strict=True)]
            rows.append(
                dict(
                    shape=label,
                    seq_len=seq_len,
                    direction=direction,
                    path=path if reference == REFERENCE else f"{path} / {reference}",
                    ms=1e3 * statistics.median(times[(direction, path)]),
                    ratio=statistics.median(ratios),
                    ratio_min=min(ratios),
                    ratio_max=max(ratios),
                )
            )
    return rows


def markdown(rows: list[dict]) -> str:
    lines = [
        f"| shape | T | direction | path | ms | against {REFERENCE} (or as named) [range] |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['shape']} | {r['seq_len']} | {r['direction']} | {r['path']} | {r['ms']:.2f} | "
            f"{r['ratio']:.3f}x [{r['ratio_min']:.2f}-{r['ratio_max']:.2f}] |"
        )
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_kernel_shape_options(p, "runs/attention_kernel")
    p.add_argument("--paths", nargs="+", choices=list(PATHS), default=list(PATHS))
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--calls", type=int, default=3, help="calls per repeat (their mean is the repeat's value)")
    add_threads_option(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if REFERENCE not in args.paths:
        args.paths = [REFERENCE, *args.paths]
    use_threads(args)
    require_fused_kernel()
    sizes, skipped = grid_shapes(args.head_dims, args.heads, args.kv_ratios, [1])
    rows = []
    for size in sizes:
        label = shape_label(size).removesuffix(" L1")
        for seq_len in args.seq_lens:
            print(f"[attention kernel] {label} T={seq_len}", file=sys.stderr, flush=True)
            rows += rows_of(label, seq_len, measure(size, seq_len, args), args.paths)
    write_kernel_run(args, "attention_kernel", rows, FIELDS, markdown(rows), skipped)
    return 0


if __name__ == "__main__":
    sys.exit(main())
