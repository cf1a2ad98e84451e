"""Cost of QK-MAP against standard attention over a grid of model shapes, not one (issue 23).

Runs ``attention_overhead.measure`` (variants interleaved inside each repeat) once per shape and length: head_dim,
heads, GQA ratio, layers and T are flags, hidden size = heads * head_dim. Per shape it reports the training-step,
forward, prefill (a T-token prompt) and decode (one token after it) time ratios against ``standard`` (median and
min..max over repeats), the saved activation bytes (``saved_tensors_hooks`` accounting), the KV-cache bytes per
token after ``generate`` with a DynamicCache and a StaticCache, and for every time ratio the arithmetic floor:
the ratio of matmul FLOPs (projections, QK^T over keys 2Fm wide, PV over values padded to the key width where the
kernel pads them, MLP, LM head) that the layout forces, so "measured vs floor" says what is overhead above the
kernel's cost; decode also gets a memory floor, the ratio of elements one token moves (weights once, the cache as
often as the decode cache passes over it: 3 for a DynamicCache, 1 for ``--decode-cache static``). Writes a
summary and a raw CSV, a Markdown table and a plot of ratio against shape; names the worst shape per metric and,
with ``--profile-worst``, prints torch.profiler's top ops there (variant and standard).

    python benchmarks/shape_grid.py --threads 2 --repeats 7 --output-dir runs/shape_grid          # full grid
    python benchmarks/shape_grid.py --head-dims 64 --heads 2 --kv-ratios 1 --layers 2 --seq-lens 64 \\
        --repeats 1 --decode-tokens 2 --output-dir runs/grid_smoke                                    # smoke
    python benchmarks/shape_grid.py --summarize sdpa=runs/gpu_check/bench_sdpa grid=runs/gpu_check/grid
"""

from __future__ import annotations

import argparse
import concurrent.futures
import csv
import itertools
import json
import math
import multiprocessing
import os
import statistics
import sys
import threading
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

import qkmap_hf
from qkmap_hf.fileio import atomic_write_json, atomic_write_text
from qkmap_hf.modeling.attention_qkmap import QKMapAttention

sys.path.insert(0, str(Path(__file__).parent))
from attention_overhead import (  # noqa: E402
    DECODE_CACHES,
    DEFAULT_VARIANTS,
    MAP_SUFFIXES,
    MODEL_SIZE,
    PREFILL_CALLS,
    VARIANTS,
    WARMUP_REPEATS,
    build,
    kv_cache_bytes,
    measure,
    ratios,
    saved_bytes_rows,
    synchronize,
    variant_config,
)

VOCAB_SIZE = 4096
# Time metrics of attention_overhead.measure and the column each gets in the table.
TIME_METRICS = {
    "train_tokens_per_s": "train step",
    "forward_tokens_per_s": "forward",
    "prefill_ms": "prefill",
    "decode_ms_per_token": "decode",
    "attention_kernel_ms": "attention kernel (train)",
}
# Time metrics torch.profiler can be pointed at (``profile_case``): the kernel's replay is not a model pass.
PROFILED_METRICS = ("train_tokens_per_s", "forward_tokens_per_s", "prefill_ms", "decode_ms_per_token")
BYTE_METRICS = {
    "activation_bytes": "saved act. bytes",
    "distinct_activation_bytes": "saved, distinct storages",
    "kv_bytes_per_token_dynamic": "KV B/token (dynamic)",
    "kv_bytes_per_token_static": "KV B/token (static)",
}
# Saved bytes for the backward pass: every save counted (the target's count) and the distinct storages they hold.
SAVED_BYTES_METRICS = ("activation_bytes", "distinct_activation_bytes")
COLUMNS = {**TIME_METRICS, **BYTE_METRICS}
SUMMARY_FIELDS = (
    "shape",
    "head_dim",
    "heads",
    "kv_heads",
    "layers",
    "hidden_size",
    "seq_len",
    "decode_cache",
    "batch",
    "variant",
    "metric",
    "median",
    "cost_ratio",
    "ratio_min",
    "ratio_max",
    "floor_ratio",
    "memory_floor_ratio",
    "kernel_floor_ratio",
    "reference",
)
# The variant the floors and targets are defined against; ``--reference`` may name another (no floors then).
STANDARD = "standard"


def reference_of(row: dict) -> str:
    """The variant a summary row's ratio is against: its ``reference`` column, standard for rows written before
    there was one."""
    return row.get("reference") or STANDARD


def measured_variants(variants: list[str], reference: str) -> list[str]:
    """The variants a run measures: the reference first (every ratio is against it), then the others once."""
    return [reference, *[v for v in variants if v != reference]]


def shape_size(head_dim: int, heads: int, kv_ratio: int, layers: int) -> dict:
    """A Llama-proportioned model size: hidden = heads * head_dim, MLP ~8/3 hidden (a multiple of 64)."""
    hidden = heads * head_dim
    return dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=hidden,
        intermediate_size=64 * math.ceil(8 * hidden / 3 / 64),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads // kv_ratio,
        head_dim=head_dim,
        max_position_embeddings=8192,
    )


def shape_label(size: dict) -> str:
    """Short name of a shape, e.g. ``d64 h8/kv2 L2`` (head_dim, query/key-value heads, layers)."""
    return (
        f"d{size['head_dim']} h{size['num_attention_heads']}/kv{size['num_key_value_heads']} "
        f"L{size['num_hidden_layers']}"
    )


def grid_shapes(
    head_dims: list[int], heads: list[int], kv_ratios: list[int], layers: list[int]
) -> tuple[list[dict], list[str]]:
    """Every consistent shape of the product; those whose heads do not divide by the GQA ratio are returned as
    skipped (named), not silently dropped."""
    sizes, skipped = [], []
    for head_dim, num_heads, ratio, num_layers in itertools.product(head_dims, heads, kv_ratios, layers):
        if num_heads % ratio or num_heads < ratio:
            skipped.append(f"d{head_dim} h{num_heads} GQA {ratio}:1 L{num_layers} (heads not divisible by {ratio})")
            continue
        sizes.append(shape_size(head_dim, num_heads, ratio, num_layers))
    return sizes, skipped


def value_width(config, attn: str, query_length: int) -> int:
    """Width of the values the kernel multiplies: the library's own rules applied to stand-in tensors, so the floor
    follows the code: the fused CPU attention (``QKMapAttention.runs_fused_attention``: float32 CPU tensors, no
    mask, as in the grid's steps) keeps them at ``head_dim``, elsewhere ``pad_values_for_kernel`` pads them."""
    with torch.device("meta"):
        module = QKMapAttention(config, 0)
        values = torch.empty(1, config.num_key_value_heads, query_length, config.head_dim)
    stand_in = torch.empty(1, 1, 1, 1).expand(1, config.num_attention_heads, query_length, config.query_key_dim)
    if module.runs_fused_attention(attn, stand_in, stand_in):
        return config.head_dim
    return module.pad_values_for_kernel(values, attn, query_length).shape[-1]


def matmul_flops(config, seq_len: int, phase: str, attn: str = "sdpa") -> float:
    """FLOPs (2 per multiply-add) of every matmul of one pass: ``phase="forward"`` a causal T-token forward (QK^T
    and PV over the T(T+1)/2 causal pairs), ``"decode"`` one token against a cache of T, ``"train"`` a training step:
    3x the forward's, plus the query and key projections once more where the layout recomputes them in the
    backward pass (``qkmap_recompute_projections``).

    Elementwise work (the feature map's sin/cos, RoPE, norms, softmax) is left out on purpose: what it costs is
    the overhead above the floor.
    """
    return sum(matmul_flop_parts(config, seq_len, phase, attn))


def matmul_flop_parts(config, seq_len: int, phase: str, attn: str = "sdpa") -> tuple[float, float]:
    """``matmul_flops`` in two parts: the attention kernel's (QK^T and PV) and every other matmul's."""
    heads, kv_heads, hidden = config.num_attention_heads, config.num_key_value_heads, config.hidden_size
    head_dim, projection, query_key = config.head_dim, config.projection_dim, config.query_key_dim
    if phase == "train":
        kernel, other = matmul_flop_parts(config, seq_len, "forward", attn)
        recomputed = 2 * hidden * (heads + kv_heads) * projection * seq_len * config.num_hidden_layers
        return 3 * kernel, 3 * other + (recomputed if config.resolved_qkmap_recompute_projections else 0)
    tokens, pairs = (1, seq_len) if phase == "decode" else (seq_len, seq_len * (seq_len + 1) / 2)
    values = value_width(config, attn, tokens)
    projections = 2 * hidden * (heads * projection + kv_heads * projection + kv_heads * head_dim + heads * head_dim)
    mlp = 2 * 3 * hidden * config.intermediate_size
    attention = 2 * heads * pairs * (query_key + values)
    lm_head = 2 * hidden * config.vocab_size * tokens
    return config.num_hidden_layers * attention, config.num_hidden_layers * tokens * (projections + mlp) + lm_head


def over_standard(size: dict, variant: str, count) -> float:
    """``count(config)`` of the variant's config at ``size`` over standard's: every counted floor's ratio."""
    return count(variant_config(variant, size)) / count(variant_config(STANDARD, size))


def floor_ratio(size: dict, variant: str, metric: str, seq_len: int, attn: str = "sdpa") -> float | None:
    """The arithmetic floor of a time ratio (variant's matmul FLOPs over standard's), None for byte metrics."""
    if metric not in TIME_METRICS:
        return None
    if metric == "attention_kernel_ms":  # the kernel's own FLOPs in a training step
        return over_standard(size, variant, lambda config: matmul_flop_parts(config, seq_len, "train", attn)[0])
    phase = {"decode_ms_per_token": "decode", "train_tokens_per_s": "train"}.get(metric, "forward")
    return over_standard(size, variant, lambda config: matmul_flops(config, seq_len, phase, attn))


def kernel_floor_ratio(
    size: dict, variant: str, seq_len: int, raw: list[dict], attn: str = "sdpa", batch: int = 1
) -> float | None:
    """The training-step floor with the attention kernel's measured time in place of its FLOPs: per repeat,
    ``((t_s - k_s) * r + k_v) / t_s``, standard's step ``t_s`` with standard's kernel time ``k_s`` swapped for the
    variant's ``k_v`` (both replayed alone, ``kernel_time.py``) and the rest scaled by the ratio ``r`` of the other
    matmuls' FLOPs; median over repeats. What a variant's step measures above it is the work outside the kernel
    (the feature map, padding, copies). None unless the raw rows hold the kernel's time."""
    series: dict[tuple[str, str], dict[int, float]] = defaultdict(dict)
    for row in raw:
        if int(row["seq_len"]) == seq_len and row["metric"] in ("train_tokens_per_s", "attention_kernel_ms"):
            series[(row["variant"], row["metric"])][row["repeat"]] = row["value"]
    step, kernel = series[(STANDARD, "train_tokens_per_s")], series[(STANDARD, "attention_kernel_ms")]
    variant_kernel = series[(variant, "attention_kernel_ms")]
    repeats = sorted(set(step) & set(kernel) & set(variant_kernel))
    if not repeats:
        return None
    scale = over_standard(size, variant, lambda config: matmul_flop_parts(config, seq_len, "train", attn)[1])
    floors = []
    for repeat in repeats:
        standard_ms = 1e3 * batch * seq_len / step[repeat]  # tokens per second -> ms per step
        floors.append(((standard_ms - kernel[repeat]) * scale + variant_kernel[repeat]) / standard_ms)
    return statistics.median(floors)


# Passes over the whole key/value cache in one decoded token. DynamicCache: ``torch.cat`` reads the old cache and
# writes the grown one (``DynamicLayer.update``), then attention reads it. StaticCache: the token is written in
# place, attention reads the preallocated buffer once.
CACHE_PASSES = {"dynamic": 3, "static": 1}


def decode_elements_moved(
    config, seq_len: int, attn: str = "sdpa", cache_passes: int = CACHE_PASSES["dynamic"], batch: int = 1
) -> float:
    """Tensor elements one decoding step of ``batch`` sequences must move through memory against caches of
    ``seq_len``: every matmul weight once (shared by the batch; at small batches each is read for a few tokens'
    worth of FLOPs) and each sequence's cache ``cache_passes`` times, keys as cached (after the feature map, ``2Fm``
    wide) and values as stored; values the kernel pads are written and read once more at the padded width.
    Activations of the new tokens are left out (a few rows)."""
    heads, kv_heads, hidden = config.num_attention_heads, config.num_key_value_heads, config.hidden_size
    head_dim, projection, query_key = config.head_dim, config.projection_dim, config.query_key_dim
    weights_per_layer = hidden * (heads * projection + kv_heads * projection + kv_heads * head_dim + heads * head_dim)
    weights_per_layer += 3 * hidden * config.intermediate_size
    cache_per_layer = cache_passes * kv_heads * seq_len * (query_key + head_dim)
    values = value_width(config, attn, 1)
    if values != head_dim:
        cache_per_layer += 2 * kv_heads * seq_len * values
    cache_per_layer *= batch
    return config.num_hidden_layers * (weights_per_layer + cache_per_layer) + hidden * config.vocab_size


def memory_floor_ratio(
    size: dict,
    variant: str,
    metric: str,
    seq_len: int,
    attn: str = "sdpa",
    cache: str = "dynamic",
    batch: int = 1,
) -> float | None:
    """The memory floor of the decode ratio (variant's elements moved per step over standard's, counted): one token
    at batch 1 does one multiply-add per weight it reads, so its time follows the bytes it moves, which the FLOP
    floor does not count (the wide cache holds 1.5x the bytes, and the dynamic cache copies it every step). A batch
    shares the weights and multiplies the caches, so its floor is higher. None for every other metric."""
    if metric != "decode_ms_per_token":
        return None
    passes = CACHE_PASSES[cache]
    return over_standard(size, variant, lambda config: decode_elements_moved(config, seq_len, attn, passes, batch))


def with_floors(row: dict, size: dict, attn: str = "sdpa") -> dict:
    """``row`` with its floors computed from the shape, its decode cache and batch (the code's floors, also for
    parts measured before a floor was added; rows without a cache or batch column were measured with a dynamic
    cache at batch 1)."""
    metric, variant, seq_len = row["metric"], row["variant"], int(row["seq_len"])
    cache, batch = row.get("decode_cache") or "dynamic", int(row.get("batch") or 1)
    # Byte rows keep theirs (the saved-bytes floor needs standard's measured bytes); rows against another reference
    # have none (every floor is a count against standard).
    if metric not in TIME_METRICS or reference_of(row) != STANDARD:
        return {**row, "decode_cache": cache, "batch": batch}
    return {
        **row,
        "decode_cache": cache,
        "batch": batch,
        "floor_ratio": floor_ratio(size, variant, metric, seq_len, attn),
        "memory_floor_ratio": memory_floor_ratio(size, variant, metric, seq_len, attn, cache, batch),
    }


def binding_floor(row: dict) -> float | None:
    """The higher of a row's floors, the one its target is judged against (both are counts, so a measurement can
    lie below them: costs the variants share pull the ratio toward 1); None when it has none."""
    floors = [f for f in (row.get("floor_ratio"), row.get("memory_floor_ratio")) if isinstance(f, float)]
    return max(floors) if floors else None


def kernel_saved_extra_elements(config, seq_len: int, attn: str = "sdpa") -> int:
    """Elements the attention kernel saves for its backward pass beyond what standard attention saves, per
    sequence: queries and keys as wide as the features (``2Fm``) instead of ``head_dim``, values and the output
    as wide as the kernel multiplies them (padded to the key width for sdpa and flash), each layer. Keys and
    values count per key/value head (sdpa and flash take GQA as it is). Zero for layouts as wide as standard."""
    heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    values = value_width(config, attn, seq_len)
    per_token = (heads + kv_heads) * (config.query_key_dim - head_dim) + (heads + kv_heads) * (values - head_dim)
    return config.num_hidden_layers * seq_len * per_token


def activation_floor_ratio(
    size: dict,
    variant: str,
    seq_len: int,
    standard_bytes: float,
    attn: str = "sdpa",
    batch: int = 1,
    dtype: str = "float32",
) -> float:
    """The floor of the saved-bytes ratio: standard's measured bytes plus what the kernel must keep on top
    (``kernel_saved_extra_elements``), over standard's. What a layout saves above it is its own: the wide and
    compact layouts keep ``z``, the feature map's input, for omega's gradient."""
    extra = kernel_saved_extra_elements(variant_config(variant, size), seq_len, attn)
    element_size = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    return (standard_bytes + batch * extra * element_size) / standard_bytes


def with_activation_floors(summary: list[dict], size: dict, attn: str, batch: int, dtype: str) -> list[dict]:
    """The rows of one case with the saved-bytes floor on its saved-bytes rows, every save counted and distinct
    storages, each from standard's row of the same count: the kernel's extra storages are distinct ones too."""
    base = {
        r["metric"]: r["median"]
        for r in summary
        if r["metric"] in SAVED_BYTES_METRICS and r["variant"] == STANDARD == reference_of(r)
    }
    return [
        {
            **row,
            "floor_ratio": activation_floor_ratio(
                size, row["variant"], int(row["seq_len"]), base[row["metric"]], attn, batch, dtype
            ),
        }
        if row["metric"] in base
        else row
        for row in summary
    ]


def expected_kv_ratio(size: dict, variant: str) -> float:
    """KV bytes per token against standard from the config: keys cached after the feature map (query_key_dim
    wide), values head_dim wide."""
    config, base = variant_config(variant, size), variant_config(STANDARD, size)
    return (config.query_key_dim + config.head_dim) / (base.query_key_dim + base.head_dim)


def generate_kv_bytes_per_token(model, prompt_len: int, new_tokens: int, cache_implementation: str) -> float:
    """Bytes of the cache's key and value tensors after ``generate``, per token position they hold (a
    StaticCache holds its allocated length)."""
    device = next(model.parameters()).device
    prompt = torch.randint(0, model.config.vocab_size, (1, prompt_len), device=device)
    with torch.no_grad():
        out = model.generate(
            prompt,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            cache_implementation=cache_implementation,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    cache = out.get("cache", None) or out.get("past_key_values")
    return kv_cache_bytes(cache) / cache.layers[0].keys.shape[-2]


def shape_fields(size: dict) -> dict:
    return dict(
        shape=shape_label(size),
        head_dim=size["head_dim"],
        heads=size["num_attention_heads"],
        kv_heads=size["num_key_value_heads"],
        layers=size["num_hidden_layers"],
        hidden_size=size["hidden_size"],
    )


def measure_shape(args: argparse.Namespace, size: dict, seq_len: int) -> tuple[list[dict], list[dict]]:
    """Raw rows and summary rows (with floors) of one shape at one length, every variant interleaved."""
    shape_args = argparse.Namespace(
        device=args.device,
        dtype=args.dtype,
        attn=args.attn,
        variants=args.variants,
        seq_lens=[seq_len],
        max_train_len=seq_len if args.train else 0,
        batch=args.batch,
        repeats=args.repeats,
        prefill_len=seq_len,
        prefill_calls=args.prefill_calls,
        decode_tokens=args.decode_tokens,
        decode_cache=args.decode_cache,
        kernel_time=args.kernel_time and args.train,
    )
    raw = measure(shape_args, size)
    summary = with_activation_floors(case_summary(args, size, seq_len, raw), size, args.attn, args.batch, args.dtype)
    return [{**shape_fields(size), **row} for row in raw], summary


def case_summary(args: argparse.Namespace, size: dict, seq_len: int, raw: list[dict]) -> list[dict]:
    """Summary rows of one (shape, T) from its raw rows: ratios of the table's metrics, with the case's fields and
    time floors (saved-bytes floors need the whole case: ``with_activation_floors``)."""
    fields = shape_fields(size) | {"decode_cache": args.decode_cache, "batch": args.batch, "reference": args.reference}
    rows = [
        with_floors({**fields, **row, "seq_len": seq_len}, size, args.attn)
        for row in ratios(raw, args.reference)
        if row["metric"] in COLUMNS  # not the prefill cache's bytes: replaced by generate's, per token
    ]
    for row in rows:
        if row["metric"] == "train_tokens_per_s" and row["variant"] != STANDARD == args.reference:
            floor = kernel_floor_ratio(size, row["variant"], seq_len, raw, args.attn, args.batch)
            if floor is not None:
                row["kernel_floor_ratio"] = floor
    return rows


def remeasure_saved_bytes(
    args: argparse.Namespace, size: dict, seq_len: int, raw: list[dict], summary: list[dict]
) -> tuple[list[dict], list[dict]]:
    """A part's rows with its saved-bytes rows measured again (the rest kept): one forward per variant, seconds
    to a minute, where the part's timings took up to an hour. For parts counted before saves of the weights
    were left out of the count (``saved_activation_bytes``)."""
    dtype = getattr(torch, args.dtype)
    ids = torch.randint(0, size["vocab_size"], (args.batch, seq_len), device=args.device)
    fresh = []
    for variant in args.variants:
        model = build(variant, args.device, dtype, args.attn, size)
        fresh += saved_bytes_rows(variant, model, ids)
        del model
    byte_metrics = {row["metric"] for row in fresh}
    raw = [row for row in raw if row["metric"] not in byte_metrics] + [{**shape_fields(size), **row} for row in fresh]
    summary = [row for row in summary if row["metric"] not in byte_metrics] + case_summary(args, size, seq_len, fresh)
    return raw, with_activation_floors(summary, size, args.attn, args.batch, args.dtype)


def measure_kv(args: argparse.Namespace, size: dict) -> list[dict]:
    """KV bytes per token of every variant after ``generate``, dynamic and static cache (independent of T)."""
    dtype = getattr(torch, args.dtype)
    per_variant: dict[str, dict[str, float]] = defaultdict(dict)
    for variant in args.variants:
        model = build(variant, args.device, dtype, args.attn, size)
        for implementation in ("dynamic", "static"):
            per_variant[variant][implementation] = generate_kv_bytes_per_token(
                model, args.kv_prompt_len, args.kv_new_tokens, implementation
            )
        del model
    rows = []
    for variant, by_cache in per_variant.items():
        for implementation, value in by_cache.items():
            ratio = value / per_variant[args.reference][implementation]
            rows.append(
                {
                    **shape_fields(size),
                    "seq_len": args.kv_prompt_len + args.kv_new_tokens,
                    "variant": variant,
                    "metric": f"kv_bytes_per_token_{implementation}",
                    "median": value,
                    "cost_ratio": ratio,
                    "ratio_min": ratio,
                    "ratio_max": ratio,
                    "floor_ratio": expected_kv_ratio(size, variant) if args.reference == STANDARD else None,
                    "reference": args.reference,
                }
            )
    return rows


def measurement_settings(args: argparse.Namespace) -> dict:
    """What a finished (shape, T) part was measured with: a rerun reuses the part only if these match."""
    return (
        {
            name: getattr(args, name)
            for name in (
                "device",
                "dtype",
                "attn",
                "variants",
                "train",
                "batch",
                "repeats",
                "prefill_calls",
                "decode_tokens",
                "threads",
            )
        }
        | {"torch": torch.__version__, "qkmap_hf": qkmap_hf.__version__}
        | settings_added_later(args)
    )


# The saved-bytes count of parts that time training: since 2026-12-03 without the saves of the weights. Parts
# without it have their bytes measured again and their timings kept (``measured_part``).
SAVED_BYTES_COUNT = {"saved_bytes": "without weights"}


def settings_added_later(args: argparse.Namespace) -> dict:
    """Settings that came after the first parts, recorded so those parts still match where nothing changed: the
    decode cache only when it is not the default (earlier parts all used a dynamic cache), and for parts that time
    training the dropped warm-up repeat (earlier ones lack it and are remeasured) and the saved-bytes count."""
    cache = {} if args.decode_cache == "dynamic" else {"decode_cache": args.decode_cache}
    kernel = {"kernel_time": True} if args.kernel_time and args.train else {}
    reference = {} if args.reference == STANDARD else {"reference": args.reference}
    return cache | kernel | reference | ({"warmup_repeats": WARMUP_REPEATS} | SAVED_BYTES_COUNT if args.train else {})


def part_path(args: argparse.Namespace, size: dict, seq_len: int) -> Path:
    """The checkpoint of one (shape, T) under ``OUTPUT_DIR/parts/`` (its name built from the grid's own numbers)."""
    name = f"d{size['head_dim']}_h{size['num_attention_heads']}_kv{size['num_key_value_heads']}"
    return args.output_dir / "parts" / f"{name}_L{size['num_hidden_layers']}_T{seq_len}.json"


def measured_part(args: argparse.Namespace, size: dict, seq_len: int) -> tuple[list[dict], list[dict]]:
    """``measure_shape``, resumable: a part finished with the same settings is read back instead of remeasured,
    and every newly finished part is written (atomically) before the next starts, so an interrupted grid loses at
    most the part it was in."""
    path, settings = part_path(args, size, seq_len), measurement_settings(args)
    if path.exists():
        part = json.loads(path.read_text())
        summary = [with_floors(row, size, args.attn) for row in part["summary"]]
        if part.get("settings") == settings:
            print(f"[grid] {shape_label(size)} T={seq_len}: done earlier ({path.name})", file=sys.stderr, flush=True)
            return part["raw"], summary
        if args.train and part.get("settings") == {k: v for k, v in settings.items() if k not in SAVED_BYTES_COUNT}:
            print(
                f"[grid] {shape_label(size)} T={seq_len}: saved bytes again ({path.name})", file=sys.stderr, flush=True
            )
            raw, summary = run_part(remeasure_saved_bytes, args, size, seq_len, part["raw"], summary)
            atomic_write_json(path, {"settings": settings, "raw": raw, "summary": summary})
            return raw, summary
    print(f"[grid] {shape_label(size)} T={seq_len}", file=sys.stderr, flush=True)
    raw, summary = run_part(measure_shape, args, size, seq_len)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, {"settings": settings, "raw": raw, "summary": summary})
    return raw, summary


def _exit_when_parent_dies() -> None:
    """End this part's process when the run that spawned it is gone (killed, interrupted): an orphaned part would go
    on timing models next to whatever runs next, at the cost of those measurements (it happened: see
    docs/results/map-share-compiled-L8/README.md). A daemon thread waits on the parent's sentinel."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def wait_then_exit() -> None:
        parent.join()
        os._exit(1)

    threading.Thread(target=wait_then_exit, name="exit-with-parent", daemon=True).start()


def _in_child(function, args: argparse.Namespace, *rest):
    _exit_when_parent_dies()
    if args.threads:
        torch.set_num_threads(args.threads)
    return function(args, *rest)


def run_part(function, args: argparse.Namespace, *rest):
    """``function(args, *rest)`` (``measure_shape`` or ``remeasure_saved_bytes``), in a fresh (spawned) process
    unless ``--in-process``: one long process grew to the machine's 24 GiB over 25 parts and was killed (the
    allocator keeps what the large shapes freed), while each part alone peaks at ~3 GiB."""
    if not args.isolate:
        return function(args, *rest)
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
        return pool.submit(_in_child, function, args, *rest).result()


def run_grid(args: argparse.Namespace) -> tuple[list[dict], list[dict], list[dict], list[str]]:
    """The whole grid: (summary rows, raw rows, sizes measured, shapes skipped). Resumable per (shape, T)."""
    sizes, skipped = grid_shapes(args.head_dims, args.heads, args.kv_ratios, args.layers)
    summary, raw = [], []
    for size in sizes:
        kv_rows = measure_kv(args, size)
        if args.kv_only:  # bytes do not depend on T: one row set per shape
            summary += kv_rows
            continue
        for seq_len in args.seq_lens:
            shape_raw, shape_summary = measured_part(args, size, seq_len)
            raw += shape_raw
            summary += shape_summary + [{**row, "seq_len": seq_len} for row in kv_rows]
    return summary, raw, sizes, skipped


def worst_shapes(summary: list[dict]) -> dict[tuple[str, str], dict]:
    """Per (metric, variant) other than the reference, the row (shape and T) with the highest cost ratio."""
    worst: dict[tuple[str, str], dict] = {}
    for row in summary:
        key = (row["metric"], row["variant"])
        if row["variant"] != reference_of(row) and (key not in worst or row["cost_ratio"] > worst[key]["cost_ratio"]):
            worst[key] = row
    return worst


def format_cell(row: dict) -> str:
    """``ratio [min-max] vs floor f`` for times (``/ memory m`` for decode), ``value (ratio)`` for bytes."""
    if row["metric"].startswith("kv_bytes"):
        expected = row.get("floor_ratio")
        expected_text = f", expected {expected:.3f}x" if isinstance(expected, float) else ""
        return f"{row['median']:.0f} ({row['cost_ratio']:.3f}x{expected_text})"
    if row["metric"] in BYTE_METRICS:
        floor = row.get("floor_ratio")
        floor_text = f", floor {floor:.3f}" if isinstance(floor, float) else ""
        return f"{row['median'] / 2**20:.1f} MiB ({row['cost_ratio']:.3f}x{floor_text})"
    cell = f"{row['cost_ratio']:.3f}x [{row['ratio_min']:.2f}-{row['ratio_max']:.2f}]"
    floor, memory = row.get("floor_ratio"), row.get("memory_floor_ratio")
    if isinstance(floor, float):
        cell += f" vs floor {floor:.3f}"
    kernel = row.get("kernel_floor_ratio")
    cell += f" / kernel {kernel:.3f}" if isinstance(kernel, float) else ""
    return cell + (f" / memory {memory:.3f}" if isinstance(memory, float) else "")


def markdown(summary: list[dict], run_column: bool = False) -> str:
    """One row per (run, shape, T, variant), one column per metric present; the reference's rows (standard's, unless
    the run named another) are left out (every ratio is 1; its KV bytes per token are each cell's value divided by the
    ratio)."""
    metrics = [m for m in COLUMNS if any(r["metric"] == m for r in summary)]
    keyed: dict[tuple, dict[str, dict]] = defaultdict(dict)
    for row in summary:
        if row["variant"] != reference_of(row):
            key = (row.get("run", ""), row["shape"], row["seq_len"], row["variant"])
            keyed[key][row["metric"]] = row
    head = (["run"] if run_column else []) + ["shape", "T", "variant"] + [COLUMNS[m] for m in metrics]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    order = list(VARIANTS)
    for key in sorted(keyed, key=lambda k: (k[0], k[1], int(k[2]), order.index(k[3]))):
        cells = ([key[0]] if run_column else []) + [key[1], str(key[2]), key[3]]
        cells += [format_cell(keyed[key][m]) if m in keyed[key] else "" for m in metrics]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(summary: list[dict], path: Path) -> Path | None:
    """Ratio against shape, one panel per metric, one line per variant (min..max bars), floors dashed; None when
    the summary has no time or activation metric (``--kv-only``: its table says it all)."""
    metrics = [m for m in (*TIME_METRICS, *SAVED_BYTES_METRICS) if any(r["metric"] == m for r in summary)]
    if not metrics:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = sorted({(r["shape"], r["seq_len"]) for r in summary}, key=lambda c: (c[0], int(c[1])))
    labels = [f"{shape} T{seq_len}" for shape, seq_len in cases]
    fig, axes = plt.subplots(len(metrics), 1, figsize=(max(6, 0.5 * len(cases) + 3), 2.6 * len(metrics)), squeeze=False)
    for ax, metric in zip(axes[:, 0], metrics, strict=True):
        for variant in VARIANTS:
            rows = {
                (r["shape"], r["seq_len"]): r
                for r in summary
                if r["metric"] == metric and r["variant"] == variant != reference_of(r)
            }
            if not rows:
                continue
            xs = [i for i, case in enumerate(cases) if case in rows]
            ys = [rows[cases[i]]["cost_ratio"] for i in xs]
            low = [y - rows[cases[i]]["ratio_min"] for i, y in zip(xs, ys, strict=True)]
            high = [rows[cases[i]]["ratio_max"] - y for i, y in zip(xs, ys, strict=True)]
            line = ax.errorbar(xs, ys, yerr=[low, high], marker="o", capsize=2, label=variant)
            floors = [rows[cases[i]].get("floor_ratio") for i in xs]
            if all(isinstance(f, float) for f in floors) and any(f != 1.0 for f in floors):  # qk_norm's is 1
                ax.plot(xs, floors, ls="--", color=line[0].get_color(), alpha=0.6, label=f"{variant} floor")
            memory = [rows[cases[i]].get("memory_floor_ratio") for i in xs]
            if all(isinstance(f, float) for f in memory) and any(f != 1.0 for f in memory):
                ax.plot(xs, memory, ls=":", color=line[0].get_color(), alpha=0.8, label=f"{variant} memory floor")
            kernel = [rows[cases[i]].get("kernel_floor_ratio") for i in xs]
            if all(isinstance(f, float) for f in kernel):
                ax.plot(xs, kernel, ls="-.", color=line[0].get_color(), alpha=0.8, label=f"{variant} kernel floor")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_ylabel(f"ratio vs {' / '.join(sorted({reference_of(r) for r in summary}))}")
        ax.set_title(COLUMNS[metric])
        ax.set_xticks(range(len(cases)), labels, rotation=60, ha="right", fontsize=7)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def profile_case(args: argparse.Namespace, size: dict, variant: str, metric: str, seq_len: int) -> str:
    """torch.profiler's top ops (self time) of one metric's work at one shape, after a warm-up run."""
    dtype = getattr(torch, args.dtype)
    model = build(variant, args.device, dtype, args.attn, size)
    ids = torch.randint(0, size["vocab_size"], (args.batch, seq_len), device=args.device)

    def work() -> None:
        if metric == "train_tokens_per_s":
            model(ids, labels=ids).loss.backward()
            model.zero_grad(set_to_none=True)
            return
        with torch.no_grad():
            if metric == "decode_ms_per_token":
                out = model(ids[:1], use_cache=True)
                cache = out.cache if hasattr(out, "cache") else out.past_key_values
                token = out.logits[:, -1:].argmax(-1)
                for _ in range(args.decode_tokens):
                    token = model(token, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
            else:
                model(ids, use_cache=metric == "prefill_ms")

    work()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device.startswith("cuda") else [])
    with profile(activities=activities) as prof:
        work()
        synchronize(args.device)
    sort_by = "self_cuda_time_total" if args.device.startswith("cuda") else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=sort_by, row_limit=args.profile_rows)


# Issue 23's targets (ratio to standard, on every shape of the grid): wide training step, decode and saved activation
# bytes; compact <= 1.05x on all three. Where the kernel's arithmetic floor is above a target, the measurement must
# come within FLOOR_SLACK of the floor instead.
TARGETS = {
    ("qk_map_wide", "train_tokens_per_s"): 1.22,
    ("qk_map_wide", "decode_ms_per_token"): 1.15,
    ("qk_map_wide", "activation_bytes"): 1.15,
    ("qk_map_compact", "train_tokens_per_s"): 1.05,
    ("qk_map_compact", "decode_ms_per_token"): 1.05,
    ("qk_map_compact", "activation_bytes"): 1.05,
}
# The recomputing wide layout is the wide layout, and a compiled or fused map is its layout (one config field apart
# each): they answer to the same targets.
TARGETS.update({("qk_map_wide_recompute", m): target for (v, m), target in list(TARGETS.items()) if v == "qk_map_wide"})
TARGETS.update({(f"{v}{suffix}", m): target for (v, m), target in list(TARGETS.items()) for suffix in MAP_SUFFIXES})
FLOOR_SLACK = 1.03


def target_status(row: dict, target: float) -> str:
    """``met`` (ratio <= target), ``at floor`` (the binding floor, FLOPs or for decode memory traffic, is above the
    target and the ratio within 3 % of it) or ``missed``."""
    if row["cost_ratio"] <= target:
        return "met"
    floor = binding_floor(row)
    if isinstance(floor, float) and floor > target and row["cost_ratio"] <= floor * FLOOR_SLACK:
        return "at floor"
    return "missed"


def target_table(summary: list[dict]) -> str:
    """One row per target: how many (run, shape, T) cases meet it, sit at the floor or miss it, and the worst case."""
    lines = [
        "| variant | metric | target | cases | met | at floor (+3 %) | missed | worst case (ratio, floor) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for (variant, metric), target in TARGETS.items():
        rows = [r for r in summary if r["variant"] == variant and r["metric"] == metric and reference_of(r) == STANDARD]
        if not rows:
            continue
        statuses = [target_status(r, target) for r in rows]
        worst = max(rows, key=lambda r: r["cost_ratio"])
        run = f"{worst['run']} " if worst.get("run") else ""
        floor = binding_floor(worst)
        floor_text = f", floor {floor:.3f}" if isinstance(floor, float) else ""
        lines.append(
            f"| {variant} | {COLUMNS[metric]} | <= {target:.2f}x | {len(rows)} | {statuses.count('met')} | "
            f"{statuses.count('at floor')} | {statuses.count('missed')} | {run}{worst['shape']} T={worst['seq_len']}: "
            f"{worst['cost_ratio']:.3f}x{floor_text} |"
        )
    return "\n".join(lines)


def size_of_row(row: dict) -> dict:
    """The model size a grid summary row was measured on, from its own columns."""
    heads, kv_heads = int(row["heads"]), int(row["kv_heads"])
    return shape_size(int(row["head_dim"]), heads, heads // kv_heads, int(row["layers"]))


def read_summary(label: str, directory: Path, attn: str = "sdpa") -> list[dict] | None:
    """Summary rows of a grid run or of an attention_overhead.py run (its one shape: MODEL_SIZE), for one table.
    Time floors are recomputed from each row's shape, kernel, cache and batch, so runs from before a floor was
    added get it too; ``attn`` stands in for runs that did not record their kernel. None if the run left none."""
    stored = stored_summary_rows(directory)
    if stored is None:
        return None
    rows = []
    for row in stored:
        if row["metric"] not in COLUMNS:
            continue
        for key in ("median", "cost_ratio", "ratio_min", "ratio_max"):
            row[key] = float(row[key])
        for key in ("floor_ratio", "memory_floor_ratio", "kernel_floor_ratio"):
            row[key] = float(row[key]) if row.get(key) else None
        size = size_of_row(row) if row.get("head_dim") else MODEL_SIZE  # attention_overhead.py: MODEL_SIZE
        row = {**shape_fields(size), **row}
        if row["metric"] in TIME_METRICS:
            row = with_floors(row, size, row.get("attn") or attn)
        rows.append({**row, "run": label})
    return rows


def versus_rows(label: str, directory: Path, reference: str) -> list[dict]:
    """Every variant's ratios against ``reference`` instead of standard, per case, from the repeats its parts keep
    (paired per repeat, as the summary's are): two layouts compared where they ran interleaved in one process.
    Parts without ``reference`` are left out."""
    rows = []
    for part in sorted((directory / "parts").glob("*.json")):
        raw = json.loads(part.read_text())["raw"]
        if not any(row["variant"] == reference for row in raw):
            continue
        shape = shape_fields(size_of_row(raw[0]))
        paired = ratios([row for row in raw if row["metric"] in COLUMNS], reference)
        rows += [
            {**shape, **row, "run": label, "reference": reference} for row in paired if row["variant"] != reference
        ]
    return rows


def stored_summary_rows(directory: Path) -> list[dict] | None:
    """The summary rows a run left: its summary CSV (a grid's or attention_overhead.py's) or, for a grid that
    stopped before writing one (killed, out of memory), the summaries of its finished parts; None if neither."""
    for name in ("shape_grid_summary.csv", "attention_overhead_summary.csv"):
        if (directory / name).exists():
            with open(directory / name, newline="") as handle:
                return list(csv.DictReader(handle))
    parts = sorted((directory / "parts").glob("*.json"))
    return [row for part in parts for row in json.loads(part.read_text())["summary"]] if parts else None


def add_kernel_shape_options(p: argparse.ArgumentParser, output_dir: str) -> None:
    """The grid's shape options as the one-layer kernel benchmarks take them (``feature_map_kernel.py``,
    ``attention_kernel.py``): head_dims, heads, GQA ratios, lengths, and where to write."""
    p.add_argument("--output-dir", type=Path, default=Path(output_dir))
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    p.add_argument("--heads", type=int, nargs="+", default=[2, 8, 16], help="query heads")
    p.add_argument("--kv-ratios", type=int, nargs="+", default=[1, 4], help="query heads per key head (1: no GQA)")
    p.add_argument("--seq-lens", type=int, nargs="+", default=[512, 2048])


def write_kernel_run(args: argparse.Namespace, name: str, rows: list[dict], fields, table: str, skipped: list[str]):
    """A one-layer kernel benchmark's records (``<name>.csv``, ``<name>.md`` in ``--output-dir``) and its printout."""
    args.output_dir.mkdir(parents=True, exist_ok=True)
    write_csv(args.output_dir / f"{name}.csv", rows, fields)
    atomic_write_text(args.output_dir / f"{name}.md", table + "\n")
    settings = f"threads={torch.get_num_threads()} torch={torch.__version__} repeats={args.repeats} calls={args.calls}"
    print_run(settings, skipped, table)


def print_run(settings: str, skipped: list[str], table: str) -> None:
    """What a grid-shaped benchmark prints: its settings line, the shapes it skipped (named), then its table."""
    print(settings)
    for name in skipped:
        print(f"skipped: {name}")
    print(table)


def write_csv(path: Path, rows: list[dict], fields: list[str] | tuple[str, ...]) -> None:
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(fields), extrasaction="ignore")
        writer.writeheader()
        writer.writerows({k: ("" if v is None else v) for k, v in row.items()} for row in rows)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output-dir", type=Path, default=Path("runs/shape_grid"))
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--attn", default="sdpa", help="attn_implementation (eager, sdpa, flex_attention, ...)")
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    p.add_argument("--heads", type=int, nargs="+", default=[2, 8, 16], help="query heads")
    p.add_argument("--kv-ratios", type=int, nargs="+", default=[1, 4], help="query heads per key head (1: no GQA)")
    p.add_argument("--layers", type=int, nargs="+", default=[2, 8])
    p.add_argument("--seq-lens", type=int, nargs="+", default=[512, 1024, 2048])
    p.add_argument("--no-train", dest="train", action="store_false", help="skip the training step and its bytes")
    p.add_argument(
        "--kernel-time", action="store_true",
        help="also time the attention kernel's calls of a training step replayed alone, and give each training "
        "ratio a floor with the kernel's measured time in place of its FLOPs (kernel_time.py)",
    )  # fmt: skip
    p.add_argument(
        "--in-process", dest="isolate", action="store_false",
        help="measure every (shape, T) in this process (default: each in a fresh one, so memory the allocator "
        "keeps after a large shape cannot add up over the grid)",
    )  # fmt: skip
    p.add_argument(
        "--kv-only", action="store_true", help="only the KV-cache bytes per token after generate (no timing; seconds)"
    )
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--prefill-calls", type=int, default=PREFILL_CALLS, help="timed prefills per repeat (their median)")
    p.add_argument("--decode-tokens", type=int, default=16, help="tokens decoded after the T-token prefill")
    p.add_argument(
        "--decode-cache", choices=DECODE_CACHES, default="dynamic", help="the cache prefill fills and decoding grows"
    )
    p.add_argument("--kv-prompt-len", type=int, default=32, help="prompt of the generate() cache measurement")
    p.add_argument("--kv-new-tokens", type=int, default=16, help="tokens generate() adds before the cache is read")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(DEFAULT_VARIANTS))
    p.add_argument(
        "--reference", choices=list(VARIANTS), default=STANDARD,
        help="the variant every ratio is against, always measured (default standard: floors and targets are defined "
        "against it, so another reference gives none). Two layouts timed against each other where three models "
        "do not fit in memory: --variants qk_map_wide qk_map_wide_recompute --reference qk_map_wide",
    )  # fmt: skip
    p.add_argument("--profile-worst", action="store_true", help="profile the worst shape of each time metric")
    p.add_argument("--profile-rows", type=int, default=15)
    p.add_argument(
        "--summarize",
        nargs="+",
        metavar="LABEL=DIR",
        help="print one Markdown table of earlier runs' summary CSVs (grid or attention_overhead.py; a grid that stopped "
        "early: its finished parts) and exit",
    )
    p.add_argument("--plot", type=Path, help="with --summarize: also draw its rows' ratio against shape to this PNG")
    p.add_argument(
        "--versus",
        choices=list(VARIANTS),
        help="with --summarize: every variant's ratios against this one instead of standard, from the parts' repeats",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.summarize:
        rows, missing = [], []
        for item in args.summarize:
            label, _, directory = item.partition("=")
            if args.versus:
                versus = versus_rows(label, Path(directory), args.versus)
                if not versus:
                    missing.append(f"missing: {label} (no part that measured {args.versus} under {directory})")
                rows += versus
                continue
            run_rows = read_summary(label, Path(directory), args.attn)
            if run_rows is None:
                missing.append(f"missing: {label} (no summary CSV or finished part under {directory})")
                continue
            rows += run_rows
        if args.versus:  # no floors or targets: those are against standard
            print(f"ratios against {args.versus}, paired per repeat:\n" + markdown(rows, run_column=True))
            print("\n".join(missing))
            return 0
        print(markdown(rows, run_column=True))
        print("\nissue 23 targets, every case above:\n" + target_table(rows))
        print("\n".join(missing))
        if args.plot and plot(rows, args.plot):
            print(f"plot: {args.plot}")
        return 0
    args.variants = measured_variants(args.variants, args.reference)
    if args.threads:
        torch.set_num_threads(args.threads)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    summary, raw, sizes, skipped = run_grid(args)
    write_csv(args.output_dir / "shape_grid_summary.csv", summary, SUMMARY_FIELDS)
    write_csv(args.output_dir / "shape_grid_raw.csv", raw, list(raw[0]) if raw else [])
    plot(summary, args.output_dir / "shape_grid_ratios.png")
    settings = (
        f"device={args.device} dtype={args.dtype} attn={args.attn} batch={args.batch} repeats={args.repeats} "
        f"threads={torch.get_num_threads()} torch={torch.__version__} qkmap_hf={qkmap_hf.__version__}"
    )
    print_run(settings, skipped, markdown(summary))
    if args.reference == STANDARD:  # the targets are ratios to standard
        targets = target_table(summary)
        atomic_write_text(args.output_dir / "shape_grid_targets.md", targets + "\n")
        print("\nissue 23 targets, every case above:\n" + targets)
    else:
        print(f"\nratios against {args.reference}: no floors or targets (those are against standard)")
    print("\nworst shape per metric and variant (measured vs floor):")
    worst = worst_shapes(summary)
    for (metric, variant), row in sorted(worst.items(), key=lambda item: list(COLUMNS).index(item[0][0])):
        print(f"- {COLUMNS[metric]}, {variant}: {row['shape']} T={row['seq_len']}: {format_cell(row)}")
    if args.profile_worst:  # per time metric, the worst QK-MAP layout's worst shape, and the reference there
        by_label = {shape_label(size): size for size in sizes}
        for metric in PROFILED_METRICS:
            rows = [r for (m, v), r in worst.items() if m == metric and v.startswith("qk_map")]
            if not rows:
                continue
            row = max(rows, key=lambda r: r["cost_ratio"])
            for variant in (row["variant"], args.reference):
                print(f"\n### profile, {COLUMNS[metric]}: {variant} at {row['shape']} T={row['seq_len']}")
                print(profile_case(args, by_label[row["shape"]], variant, metric, int(row["seq_len"])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
