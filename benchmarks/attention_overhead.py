"""Side-by-side cost of QK-MAP against standard attention and QK-Norm, in one run on one machine.

Times models of identical size (same layers, widths, heads, vocabulary) that differ only in ``qk_mode``:
forward and forward+backward tokens/s over sequence lengths, prefill and per-token decode latency with
the KV cache, saved-activation bytes of a training step and KV-cache bytes. Variants are interleaved
inside each repeat so that machine noise hits all of them alike; ratios are medians over repeats
against ``standard`` with the min..max spread. Writes a CSV, a PNG per metric and prints a Markdown table.

    python benchmarks/attention_overhead.py --output-dir docs/benchmarks            # CPU, float32, sdpa
    python benchmarks/attention_overhead.py --device cuda --dtype bfloat16 --output-dir out  # a GPU
"""

from __future__ import annotations

import argparse
import csv
import math
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from transformers import Cache, StaticCache

import qkmap_hf
from qkmap_hf import QKMapConfig, QKMapForCausalLM
from qkmap_hf.kernels import load_fused_kernel

sys.path.insert(0, str(Path(__file__).parent))
from kernel_time import KernelReplay, record_training_calls  # noqa: E402

PREFILL_CALLS = 5  # timed prefills per repeat; the repeat's value is their median
WARMUP_REPEATS = 1  # forward and training repeats timed before the recorded ones and dropped (see measure)
DECODE_CACHES = ("dynamic", "static")
MODEL_SIZE = dict(
    vocab_size=4096,
    hidden_size=512,
    intermediate_size=1376,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=8,
    head_dim=64,
    max_position_embeddings=8192,
)
VARIANTS = {
    "standard": dict(qk_mode="standard"),
    "qk_norm": dict(qk_mode="qk_norm"),
    # The QK-MAP layouts run the eager feature map and sdpa with padded values, as every record before 2026-12-05
    # measured them (since then the defaults, qkmap_fused_feature_map=True and, from 2026-12-06,
    # qkmap_fused_attention=True, run the fused CPU kernels where they are loaded: the "_fused" and "_kernels"
    # variants).
    # qkmap_input_dim of the compact layout: head_dim // (2F) of the size measured (variant_fields).
    "qk_map_compact": dict(
        qk_mode="qk_map",
        qkmap_input_dim=32,
        qkmap_num_frequencies=1,
        qkmap_fused_feature_map=False,
        qkmap_fused_attention=False,
    ),
    # The wide layout keeping z for the backward pass, as every record before 2026-12-03 measured it (since then the
    # default, qkmap_recompute_projections=None, recomputes in the wide layout: qk_map_wide_recompute).
    "qk_map_wide": dict(
        qk_mode="qk_map",
        qkmap_input_dim=None,
        qkmap_num_frequencies=1,
        qkmap_recompute_projections=False,
        qkmap_fused_feature_map=False,
        qkmap_fused_attention=False,
    ),
    # The wide layout whose training recomputes q_proj/k_proj's outputs instead of keeping them.
    "qk_map_wide_recompute": dict(
        qk_mode="qk_map",
        qkmap_input_dim=None,
        qkmap_num_frequencies=1,
        qkmap_recompute_projections=True,
        qkmap_fused_feature_map=False,
        qkmap_fused_attention=False,
    ),
}
# Each layout with its feature map compiled (qkmap_compile_feature_map), run by the fused CPU kernel
# (qkmap_fused_feature_map, qkmap_hf/kernels), or with every fused CPU kernel, the map and the attention for keys
# wider than values (qkmap_fused_attention; the product's defaults): the same model, config fields apart.
COMPILED_SUFFIX = "_compiled"
FUSED_SUFFIX = "_fused"
KERNELS_SUFFIX = "_kernels"
MAP_SUFFIXES = (COMPILED_SUFFIX, FUSED_SUFFIX, KERNELS_SUFFIX)
SUFFIX_FIELDS = {
    COMPILED_SUFFIX: ("qkmap_compile_feature_map",),
    FUSED_SUFFIX: ("qkmap_fused_feature_map",),
    KERNELS_SUFFIX: ("qkmap_fused_feature_map", "qkmap_fused_attention"),
}
VARIANTS.update(
    {
        f"{name}{suffix}": {**VARIANTS[name], **dict.fromkeys(fields, True)}
        for suffix, fields in SUFFIX_FIELDS.items()
        for name in list(VARIANTS)
        if name.startswith("qk_map")
    }
)


def layout_of(variant: str) -> str:
    """The layout a variant runs (``qk_map_wide_fused`` -> ``qk_map_wide``): how its map runs is its suffix."""
    for suffix in MAP_SUFFIXES:
        if variant.endswith(suffix):
            return variant.removesuffix(suffix)
    return variant


# What a run measures unless --variants says otherwise: the arms the records were measured with. The recomputing
# wide layout is a memory option of the wide one, asked for by name (a fifth model would not fit the largest shapes).
DEFAULT_VARIANTS = ("standard", "qk_norm", "qk_map_compact", "qk_map_wide")


def variant_fields(variant: str, size: dict | None = None) -> dict:
    """Config fields of a variant for a model size: the compact layout's ``m`` follows the size's head_dim
    (``head_dim // (2F)``, no attention width added), so one table of variants serves every shape."""
    size = MODEL_SIZE if size is None else size
    fields = dict(VARIANTS[variant])
    if layout_of(variant) == "qk_map_compact":
        fields["qkmap_input_dim"] = size["head_dim"] // (2 * fields["qkmap_num_frequencies"])
    return fields


def variant_config(variant: str, size: dict | None = None) -> QKMapConfig:
    """The config of one variant at one model size (``MODEL_SIZE`` by default)."""
    size = MODEL_SIZE if size is None else size
    return QKMapConfig(**size, **variant_fields(variant, size))


def build(variant: str, device: str, dtype: torch.dtype, attn: str, size: dict | None = None) -> QKMapForCausalLM:
    torch.manual_seed(0)
    config = variant_config(variant, size)
    if (
        config.qk_mode == "qk_map"
        and device == "cpu"
        and (config.qkmap_fused_feature_map or config.qkmap_fused_attention)
    ):
        require_fused_kernel()
    model = QKMapForCausalLM(config).to(device=device, dtype=dtype)
    model.set_attn_implementation(attn)
    model.generation_config.eos_token_id = None
    return model


def require_fused_kernel() -> None:
    """Build and load the fused CPU kernels, or stop: a _fused or _kernels variant measured without them would time
    the eager map and sdpa with padded values."""
    status = load_fused_kernel(build=True)
    if not status.loaded:
        raise SystemExit(f"a _fused or _kernels variant needs the fused CPU kernels: {status.reason}")


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def add_threads_option(parser: argparse.ArgumentParser) -> None:
    """``--threads``, shared by the benchmarks: torch's CPU threads for the run (``use_threads``)."""
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")


def use_threads(args: argparse.Namespace) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)


def timed(fn, device: str) -> float:
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def saved_activation_bytes(model: QKMapForCausalLM, ids: torch.Tensor) -> tuple[int, int]:
    """Bytes autograd keeps for the backward pass: the memory a training step needs beyond the weights.

    Returns every save counted (a tensor saved by three ops counts three times) and the distinct storages
    those saves hold (what the allocator keeps). A save that shares a parameter's or buffer's storage is the
    weights, not an activation, and is not counted: every matmul keeps ``weight.t()``, a view. Counted (before
    2026-12-03), those views added the same constant to every variant, which pulled every ratio toward 1, most at
    short T and large hidden sizes (docs/performance.md, "Saved bytes without the weights").
    """
    weights = {tensor.untyped_storage().data_ptr() for tensor in (*model.parameters(), *model.buffers())}
    total, storages = 0, {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal total
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in weights:
            total += tensor.numel() * tensor.element_size()
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(ids, labels=ids)
    return total, sum(storages.values())


def saved_bytes_rows(name: str, model: QKMapForCausalLM, ids: torch.Tensor) -> list[dict]:
    """The raw rows of ``saved_activation_bytes`` for one variant at ``ids``'s length (repeat 0: a count)."""
    saved, distinct = saved_activation_bytes(model, ids)
    seq_len = ids.shape[-1]
    return [
        dict(variant=name, seq_len=seq_len, metric="activation_bytes", value=saved, repeat=0),
        dict(variant=name, seq_len=seq_len, metric="distinct_activation_bytes", value=distinct, repeat=0),
    ]


def kv_cache_bytes(cache) -> int:
    total = 0
    for layer in cache.layers:
        for tensor in (layer.keys, layer.values):
            total += tensor.numel() * tensor.element_size()
    return total


def decode_cache(args: argparse.Namespace, model: QKMapForCausalLM) -> Cache | None:
    """The cache a timed prefill fills and decoding grows: None lets the model make a DynamicCache (its ``cat``
    copies the whole cache every token); ``--decode-cache static`` preallocates every position the run decodes, as
    ``generate(cache_implementation="static")`` does, and writes each token in place."""
    if getattr(args, "decode_cache", "dynamic") == "dynamic":
        return None
    return StaticCache(config=model.config, max_cache_len=args.prefill_len + args.decode_tokens)


def measure(args: argparse.Namespace, size: dict | None = None) -> list[dict]:
    """Raw rows (variant, seq_len, metric, value, repeat) of every variant at one model size, interleaved."""
    size = MODEL_SIZE if size is None else size
    dtype = getattr(torch, args.dtype)
    models = {name: build(name, args.device, dtype, args.attn, size) for name in args.variants}
    rows: list[dict] = []
    for seq_len in args.seq_lens:
        ids = torch.randint(0, size["vocab_size"], (args.batch, seq_len), device=args.device)
        replays = {}  # the attention kernel's calls of one training step per variant, replayed alone
        for name, model in models.items():  # warm-up and the size metrics, once per variant
            with torch.no_grad():
                model(ids)
            model.zero_grad(set_to_none=True)
            if seq_len <= args.max_train_len:
                rows += saved_bytes_rows(name, model, ids)
                if getattr(args, "kernel_time", False):  # a Namespace built by hand may leave it out
                    replays[name] = KernelReplay(record_training_calls(model, ids))
        # Repeat -1 is timed like the others and dropped: the first timed repeat ran slowest for every variant and
        # most for standard, timed first (a training step 1.8x its later ones at d64 h8/kv2 L8 T = 1024, even
        # after an untimed training step per variant), which biased every ratio of that repeat low.
        for repeat in range(-WARMUP_REPEATS, args.repeats):
            for name, model in models.items():
                with torch.no_grad():
                    seconds = timed(lambda model=model, ids=ids: model(ids), args.device)
                rows.append(
                    dict(
                        variant=name,
                        seq_len=seq_len,
                        metric="forward_tokens_per_s",
                        value=ids.numel() / seconds,
                        repeat=repeat,
                    )
                )
                if seq_len <= args.max_train_len:

                    def step(model=model, ids=ids):
                        model(ids, labels=ids).loss.backward()

                    seconds = timed(step, args.device)
                    model.zero_grad(set_to_none=True)
                    rows.append(
                        dict(
                            variant=name,
                            seq_len=seq_len,
                            metric="train_tokens_per_s",
                            value=ids.numel() / seconds,
                            repeat=repeat,
                        )
                    )
                if name in replays and replays[name].calls:
                    seconds = timed(replays[name], args.device)
                    rows.append(
                        dict(
                            variant=name,
                            seq_len=seq_len,
                            metric="attention_kernel_ms",
                            value=seconds * 1e3,
                            repeat=repeat,
                        )
                    )
            done = f"repeat {repeat + 1}/{args.repeats}" if repeat >= 0 else "warm-up repeat"
            print(f"[bench] T={seq_len} {done}", file=sys.stderr, flush=True)
        rows = [row for row in rows if row["repeat"] >= 0]  # the warm-up repeat's timings are not results

    prompt = torch.randint(0, size["vocab_size"], (1, args.prefill_len), device=args.device)
    with torch.no_grad():  # warm-up of the cached path: the first call allocates what later ones reuse
        for model in models.values():
            model(prompt, use_cache=True)
    for repeat in range(args.repeats):
        # Prefill every variant, then decode round-robin, one token per variant in turn, so that a burst of
        # machine load hits all variants alike instead of the one decoding its 32 tokens at that moment.
        caches, tokens, steps = {}, {}, defaultdict(list)
        with torch.no_grad():
            for name, model in models.items():
                out = {}

                def prefill(model=model, out=out):
                    out["result"] = model(prompt, cache=decode_cache(args, model), use_cache=True)

                # a short prefill takes about a millisecond: one call per repeat measured the machine, not the
                # code (1.06x-5.09x for one case), so each repeat is the median of several fresh-cache calls
                prefill_seconds = statistics.median(timed(prefill, args.device) for _ in range(args.prefill_calls))
                result = out["result"]
                caches[name] = result.cache if hasattr(result, "cache") else result.past_key_values
                tokens[name] = result.logits[:, -1:].argmax(-1)
                rows.append(
                    dict(
                        variant=name,
                        seq_len=args.prefill_len,
                        metric="prefill_ms",
                        value=prefill_seconds * 1e3,
                        repeat=repeat,
                    )
                )
            for _ in range(args.decode_tokens):
                for name, model in models.items():
                    out = {}

                    def decode(model=model, cache=caches[name], token=tokens[name], out=out):
                        out["step"] = model(token, cache=cache, use_cache=True)

                    steps[name].append(timed(decode, args.device))
                    tokens[name] = out["step"].logits[:, -1:].argmax(-1)
        for name in models:
            rows.append(
                dict(
                    variant=name,
                    seq_len=args.prefill_len,
                    metric="decode_ms_per_token",
                    value=statistics.median(steps[name]) * 1e3,
                    repeat=repeat,
                )
            )
            if repeat == 0:
                rows.append(
                    dict(
                        variant=name,
                        seq_len=args.prefill_len + args.decode_tokens,
                        metric="kv_cache_bytes",
                        value=kv_cache_bytes(caches[name]),
                        repeat=0,
                    )
                )
    return rows


HIGHER_IS_BETTER = {"forward_tokens_per_s", "train_tokens_per_s"}


def ratios(rows: list[dict], reference: str = "standard") -> list[dict]:
    """Per metric and length: cost ratio against ``reference`` (>1 means slower or bigger), paired per repeat,
    median and spread. Metrics ``reference`` was not measured on are left out."""
    grouped: dict[tuple, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for row in rows:
        grouped[(row["metric"], row["seq_len"])][row["variant"]].append(row["value"])
    summary = []
    for (metric, seq_len), by_variant in sorted(grouped.items()):
        base = by_variant.get(reference)
        if base is None:
            continue
        for variant, values in by_variant.items():
            per_repeat = [(b / v if metric in HIGHER_IS_BETTER else v / b) for v, b in zip(values, base, strict=False)]
            summary.append(
                dict(
                    metric=metric,
                    seq_len=seq_len,
                    variant=variant,
                    median=statistics.median(values),
                    cost_ratio=statistics.median(per_repeat),
                    ratio_min=min(per_repeat),
                    ratio_max=max(per_repeat),
                )
            )
    return summary


def plot(summary: list[dict], output_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for metric in ("forward_tokens_per_s", "train_tokens_per_s"):
        if not any(s["metric"] == metric for s in summary):  # e.g. --max-train-len 0: no training rows
            continue
        fig, ax = plt.subplots(figsize=(6, 4))
        for variant in VARIANTS:
            points = [s for s in summary if s["metric"] == metric and s["variant"] == variant]
            if not points:
                continue
            xs = [p["seq_len"] for p in points]
            ax.plot(xs, [p["cost_ratio"] for p in points], marker="o", label=variant)
            ax.fill_between(xs, [p["ratio_min"] for p in points], [p["ratio_max"] for p in points], alpha=0.2)
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length")
        ax.set_ylabel("time ratio vs standard (lower is better)")
        ax.set_title(metric.replace("_", " "))
        ax.legend()
        path = output_dir / f"{metric}_ratio.png"
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)
    return paths


def markdown(summary: list[dict]) -> str:
    variants = [v for v in VARIANTS if any(s["variant"] == v for s in summary)]
    lines = ["| metric | T | " + " | ".join(variants) + " |", "|---|---|" + "---|" * len(variants)]
    keyed = {(s["metric"], s["seq_len"], s["variant"]): s for s in summary}
    for metric, seq_len in sorted({(s["metric"], s["seq_len"]) for s in summary}):
        cells = []
        for variant in variants:
            s = keyed.get((metric, seq_len, variant))
            if s is None or math.isnan(s["median"]):
                cells.append("n/a")
            elif metric.endswith("bytes"):
                cells.append(f"{s['median'] / 2**20:.1f} MiB ({s['cost_ratio']:.2f}x)")
            else:
                cells.append(f"{s['cost_ratio']:.3f}x [{s['ratio_min']:.2f}-{s['ratio_max']:.2f}]")
        lines.append(f"| {metric} | {seq_len} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-dir", type=Path, default=Path("runs/benchmarks"))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--attn", default="sdpa", help="attn_implementation (eager, sdpa, flash_attention_2, ...)")
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096])
    parser.add_argument("--max-train-len", type=int, default=2048, help="longest T timed with backward")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--prefill-len", type=int, default=512)
    parser.add_argument(
        "--prefill-calls", type=int, default=PREFILL_CALLS, help="timed prefills per repeat (their median)"
    )
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument(
        "--decode-cache", choices=DECODE_CACHES, default="dynamic", help="the cache prefill fills and decoding grows"
    )
    add_threads_option(parser)
    parser.add_argument(
        "--kernel-time",
        action="store_true",
        help="also time the attention kernel's calls of each training step replayed alone (attention_kernel_ms)",
    )
    parser.add_argument(
        "--variants",
        nargs="+",
        choices=list(VARIANTS),
        default=list(DEFAULT_VARIANTS),
        help="variants to time (standard, the reference of every ratio, is always included)",
    )
    args = parser.parse_args(argv)
    args.variants = ["standard", *[v for v in args.variants if v != "standard"]]
    use_threads(args)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    rows = measure(args)
    # the run's kernel, cache and batch on every row: shape_grid.py --summarize computes this run's floors from them
    run_fields = dict(attn=args.attn, decode_cache=args.decode_cache, batch=args.batch)
    summary = [{**row, **run_fields} for row in ratios(rows)]
    with open(args.output_dir / "attention_overhead_raw.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    with open(args.output_dir / "attention_overhead_summary.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(summary[0]))
        writer.writeheader()
        writer.writerows(summary)
    plot(summary, args.output_dir)
    header = (
        f"device={args.device} dtype={args.dtype} attn={args.attn} batch={args.batch} repeats={args.repeats} "
        f"threads={torch.get_num_threads()} torch={torch.__version__} qkmap_hf={qkmap_hf.__version__}"
    )
    print(header)
    print(markdown(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
