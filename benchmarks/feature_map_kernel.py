"""The feature map alone, eager against the fused CPU kernel (``qkmap_fused_feature_map``): forward and backward of
one layer's queries and keys, per shape and length, interleaved in every repeat.

The map's share of a whole training step is ``map_share.py``'s; this times the map's own calls, where the kernel's
effect is not diluted by the rest of the step: ``QKMapQueryKeyFunction`` forward, then its backward (omega, gains
and ``z`` needing gradients, as in training), on the layer's real parameter shapes (``shape_grid.shape_size``) with
queries and keys as token-major views as the model makes them. Medians over repeats of ``--calls`` calls each, and
the fused/eager ratio per repeat (median [min-max]).

    python benchmarks/feature_map_kernel.py --threads 2 --head-dims 64 128 --heads 2 8 16 --kv-ratios 1 4 \\
        --seq-lens 512 2048 --output-dir runs/feature_map_kernel
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from qkmap_hf.modeling.feature_map_qkmap import qkmap_query_key_features

sys.path.insert(0, str(Path(__file__).parent))
from attention_overhead import add_threads_option, require_fused_kernel, use_threads, variant_config  # noqa: E402
from shape_grid import add_kernel_shape_options, grid_shapes, shape_label, write_kernel_run  # noqa: E402

LAYOUTS = ("qk_map_wide", "qk_map_compact")
PATHS = ("eager", "fused")
FIELDS = ("shape", "layout", "seq_len", "direction", "eager_us", "fused_us", "ratio", "ratio_min", "ratio_max")


def layer_inputs(config, seq_len: int) -> tuple[torch.Tensor, ...]:
    """Queries, keys, omega, gains and RoPE tables of one layer, as ``QKMapFeatureMap`` hands them to the map."""
    generator = torch.Generator().manual_seed(0)
    m, kv_heads, heads = config.resolved_qkmap_input_dim, config.num_key_value_heads, config.num_attention_heads

    def rand(*shape, grad=True):
        return torch.randn(*shape, generator=generator).requires_grad_(grad)

    query = rand(1, seq_len, heads, m).transpose(1, 2)
    key = rand(1, seq_len, kv_heads, m).transpose(1, 2)
    frequency = (torch.rand(kv_heads, config.qkmap_num_frequencies, m, generator=generator) + 0.1).requires_grad_()
    query_gain, key_gain = (rand(kv_heads, 2 * config.qkmap_num_frequencies, m) for _ in range(2))
    angles = torch.arange(seq_len)[:, None] * torch.logspace(0, -3, m // 2)[None]
    angles = torch.cat((angles, angles), dim=-1)[None]
    return query, key, frequency, query_gain, key_gain, angles.cos(), angles.sin()


def timed_calls(inputs: tuple, fused: bool, calls: int) -> tuple[float, float]:
    """Mean seconds of one forward and one backward call over ``calls`` calls of each."""
    forward = backward = 0.0
    for _ in range(calls):
        start = time.perf_counter()
        query, key = qkmap_query_key_features(*inputs, fused=fused)
        middle = time.perf_counter()
        torch.autograd.backward((query, key), (torch.ones_like(query), torch.ones_like(key)))
        backward += time.perf_counter() - middle
        forward += middle - start
    for tensor in inputs:
        tensor.grad = None
    return forward / calls, backward / calls


def measure(config, seq_len: int, args: argparse.Namespace) -> dict[str, dict[str, list[float]]]:
    """Per path and direction, the mean call time of each repeat; the paths alternate, their order rotating."""
    inputs = layer_inputs(config, seq_len)
    times = {path: {"forward": [], "backward": []} for path in PATHS}
    for path in PATHS:
        timed_calls(inputs, path == "fused", 3)  # warm-up: allocator, threads
    for repeat in range(args.repeats):
        for path in PATHS[repeat % 2 :] + PATHS[: repeat % 2]:
            forward, backward = timed_calls(inputs, path == "fused", args.calls)
            times[path]["forward"].append(forward)
            times[path]["backward"].append(backward)
    return times


def rows_of(label: str, layout: str, seq_len: int, times: dict) -> list[dict]:
    rows = []
    for direction in ("forward", "backward"):
        eager, fused = times["eager"][direction], times["fused"][direction]
        ratios = [f / e for f, e in zip(fused, eager, strict=True)]
        rows.append(
            dict(
                shape=label,
                layout=layout,
                seq_len=seq_len,
                direction=direction,
                eager_us=1e6 * statistics.median(eager),
                fused_us=1e6 * statistics.median(fused),
                ratio=statistics.median(ratios),
                ratio_min=min(ratios),
                ratio_max=max(ratios),
            )  # fmt: skip
        )
    return rows


def markdown(rows: list[dict]) -> str:
    lines = [
        "| shape | layout | T | direction | eager | fused | fused / eager [range] |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['shape']} | {r['layout'].removeprefix('qk_map_')} | {r['seq_len']} | {r['direction']} | "
            f"{r['eager_us']:.0f} us | {r['fused_us']:.0f} us | {r['ratio']:.3f}x [{r['ratio_min']:.2f}-{r['ratio_max']:.2f}] |"
        )
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_kernel_shape_options(p, "runs/feature_map_kernel")
    p.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS))
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--calls", type=int, default=10, help="calls per repeat (their mean is the repeat's value)")
    add_threads_option(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    use_threads(args)
    require_fused_kernel()
    sizes, skipped = grid_shapes(args.head_dims, args.heads, args.kv_ratios, [1])
    rows = []
    for size in sizes:
        label = shape_label(size).removesuffix(" L1")
        for layout in args.layouts:
            config = variant_config(layout, size)
            for seq_len in args.seq_lens:
                print(f"[feature map] {label} {layout} T={seq_len}", file=sys.stderr, flush=True)
                rows += rows_of(label, layout, seq_len, measure(config, seq_len, args))
    write_kernel_run(args, "feature_map_kernel", rows, FIELDS, markdown(rows), skipped)
    return 0


if __name__ == "__main__":
    sys.exit(main())
