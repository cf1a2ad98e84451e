"""What caching ``z`` (the keys before the feature map) instead of the features would cost and save, measured.

QK-MAP caches each key after the feature map: ``phi(z)`` is ``2Fm`` wide per key head, values ``head_dim``. A key's
features depend only on its own ``z`` and position, so they never change once written; caching ``z`` (``m`` wide)
instead would save ``(2F - 1) m`` numbers per key head and token, and cost mapping every cached key again at every
decode step (``phi`` is not linear in ``z``: there is no cheap update). This script measures both sides on models
built like ``attention_overhead.py``'s, per shape, layout and context length T:

- bytes per token of one layer's cached keys: the features, read from a real ``DynamicCache`` after a T-token
  prefill, against ``z`` (the ``k_proj`` output of one token, as its tensor holds it); and of keys plus values;
- the decode step as it is (one token over the T-token feature cache, ``forward`` with the cache; median of
  ``--repeats``) and what a ``z`` cache would add to it: the feature map of the T cached keys of every layer,
  timed on each layer's own parameters and RoPE tables (``qkmap_features``, the function the model runs; the
  tables of positions 0..T-1 are precomputed, as a z cache would keep them). The mapping of the one new key, which
  both designs run, is left in the step.

    python benchmarks/z_cache.py --threads 2 --seq-lens 512 2048 --output-dir runs/z_cache
"""

from __future__ import annotations

import argparse
import csv
import io
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention_overhead import MODEL_SIZE, build, timed  # noqa: E402
from shape_grid import shape_label, shape_size  # noqa: E402

from qkmap_hf.fileio import atomic_write_text  # noqa: E402
from qkmap_hf.modeling.feature_map_qkmap import qkmap_features  # noqa: E402

SHAPES = {  # the shape issue 23 measured decoding on (GQA, head_dim 128) and attention_overhead.py's
    "gqa128": shape_size(head_dim=128, heads=8, kv_ratio=4, layers=2),
    "mha64": MODEL_SIZE,
}
LAYOUTS = ("qk_map_wide", "qk_map_compact")


@torch.no_grad()
def measure(size: dict, variant: str, seq_len: int, repeats: int) -> dict:
    """One row: bytes per token (features and z; keys and keys + values) and decode milliseconds (the step and the
    re-mapping of every cached key that a z cache would add)."""
    model = build(variant, "cpu", torch.float32, "sdpa", size).eval()
    config = model.config
    prompt = torch.randint(0, config.vocab_size, (1, seq_len))
    prefill = model(prompt, use_cache=True)
    cache = prefill.past_key_values
    layer0 = cache.layers[0]
    feature_bytes = layer0.keys[0, :, :1].nelement() * layer0.keys.element_size()  # one token, every key head
    value_bytes = layer0.values[0, :, :1].nelement() * layer0.values.element_size()
    hidden = torch.randn(1, 1, config.hidden_size)
    attention = model.model.layers[0].self_attn
    z_one = attention.k_proj(hidden).view(1, 1, config.num_key_value_heads, -1)
    z_bytes = z_one.nelement() * z_one.element_size()

    token = prompt[:, -1:]
    position = torch.tensor([[seq_len]])

    def step() -> None:  # then the cache is cut back to T tokens, so every step decodes over T keys
        model(token, cache=cache, position_ids=position, use_cache=True)
        cache.crop(-1)

    positions = torch.arange(seq_len)[None]
    tables = model.model.rotary_emb(hidden, position_ids=positions)
    keys = [torch.randn(1, config.num_key_value_heads, seq_len, config.projection_dim) for _ in model.model.layers]

    def remap() -> None:  # what a z cache adds per step: phi of every cached key, every layer
        for layer, z in zip(model.model.layers, keys, strict=True):
            feature_map = layer.self_attn.qk_map
            frequency = feature_map.frequency()
            gain = feature_map.effective_gain(feature_map.key_gain, frequency)
            qkmap_features(z, frequency, gain, *tables, config.qkmap_rotate_cos_blocks)

    step()  # warm-up
    steps, remaps = [], []
    for _ in range(repeats):  # interleaved, so that machine noise hits both alike
        steps.append(timed(step, "cpu"))
        remaps.append(timed(remap, "cpu"))
    decode_ms = 1e3 * statistics.median(steps)
    remap_ms = 1e3 * statistics.median(remaps)
    return {
        "shape": shape_label(size),
        "variant": variant,
        "seq_len": seq_len,
        "key_bytes_features": feature_bytes,
        "key_bytes_z": z_bytes,
        "kv_bytes_features": feature_bytes + value_bytes,
        "kv_bytes_z": z_bytes + value_bytes,
        "kv_bytes_saved": 1 - (z_bytes + value_bytes) / (feature_bytes + value_bytes),
        "decode_ms": decode_ms,
        "remap_ms": remap_ms,
        "z_cache_decode_ratio": (decode_ms + remap_ms) / decode_ms,
    }


def markdown(rows: list[dict]) -> str:
    lines = [
        "| shape | layout | T | key B/token/layer: features -> z | K+V B/token/layer: features -> z (saved) "
        "| decode step ms | + re-map ms | z-cache step / now |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['shape']} | {r['variant']} | {r['seq_len']} | {r['key_bytes_features']} -> {r['key_bytes_z']} "
            f"| {r['kv_bytes_features']} -> {r['kv_bytes_z']} ({100 * r['kv_bytes_saved']:.0f} %) "
            f"| {r['decode_ms']:.2f} | {r['remap_ms']:.2f} | {r['z_cache_decode_ratio']:.2f}x |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", type=Path, required=True)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--seq-lens", nargs="+", type=int, default=[512, 2048])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = [
        measure(SHAPES[shape], variant, seq_len, args.repeats)
        for shape in args.shapes
        for seq_len in args.seq_lens
        for variant in args.layouts
    ]
    args.output_dir.mkdir(parents=True, exist_ok=True)
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
    atomic_write_text(args.output_dir / "z_cache.csv", buffer.getvalue())
    table = markdown(rows)
    atomic_write_text(args.output_dir / "z_cache.md", table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
