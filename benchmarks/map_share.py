"""What the feature map itself costs in a training step, against what the layout's kernel costs (issue 23).

``shape_grid.py`` puts every layout's training step next to its arithmetic floor (matmul FLOPs). What a layout
measures above that floor is elementwise work, and ``--kernel-time`` showed the kernel is not it. This splits the
rest, per shape and T, with four arms timed in every repeat (their order rotating from repeat to repeat):

- ``standard``: Llama attention, the reference;
- the layout as it trains (``qk_map_wide``, ``qk_map_compact``, ...);
- ``no map``: the same model with each layer's feature map replaced by ``z`` repeated ``2F`` times along its last
  dimension: queries and keys as wide as the map's, so the kernel, the values' padding and the output projection
  are the layout's, and one ``repeat`` (its backward a sum) instead of the map;
- ``sin/cos``: the map's own ``cos`` and ``sin`` calls of one step alone (per layer, for queries and keys, in the
  forward pass and again in the backward pass's recomputation), on preallocated buffers of the map's phase shapes:
  the transcendental work the method asks for per element, without its multiplies, views or autograd nodes.

Per repeat, each arm's time over standard's. The map's cost is ``(layout - no map) / standard``, paired per repeat:
mean with a 95 % Student t interval over repeats (one process: an interval over repeats, not over runs). ``no map``
against the FLOP floor says whether the layout outside the map costs what its matmuls say; the map's cost against
``sin/cos`` says how much of it a fused kernel could save at most (the rest is the trig itself). Every (shape, T)
runs in a fresh process and is checkpointed under ``OUTPUT_DIR/parts/``: a rerun of the same command resumes.

    python benchmarks/map_share.py --threads 2 --repeats 15 --head-dims 64 128 --heads 2 8 --kv-ratios 1 \\
        --layers 8 --seq-lens 512 --output-dir runs/map_share
    python benchmarks/map_share.py --head-dims 16 --heads 2 --kv-ratios 1 --layers 1 --seq-lens 32 \\
        --repeats 2 --threads 1 --output-dir runs/map_share_smoke                                      # smoke
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

import qkmap_hf
from qkmap_hf.fileio import atomic_write_json, atomic_write_text
from qkmap_hf.modeling.construction_qkmap import QKMapFeatureMap
from qkmap_hf.training.sweep import paired_interval

sys.path.insert(0, str(Path(__file__).parent))
from attention_overhead import VARIANTS, WARMUP_REPEATS, add_threads_option, build, layout_of, timed, use_threads  # noqa: E402
from shape_grid import (  # noqa: E402
    STANDARD,
    TARGETS,
    floor_ratio,
    grid_shapes,
    part_path,
    print_run,
    run_part,
    shape_label,
    write_csv,
)

DEFAULT_LAYOUTS = ("qk_map_wide", "qk_map_compact")
NO_MAP, TRIG = "no map", "sin/cos"
UNTIMED_STEPS = 2  # per model before the first repeat: allocator and thread-pool warm-up
SUMMARY_FIELDS = (
    "shape", "hidden_size", "layers", "seq_len", "variant", "standard_ms", "step_ratio", "step_min", "step_max",
    "no_map_ratio", "no_map_min", "no_map_max", "floor_ratio", "map_cost", "map_cost_low", "map_cost_high",
    "trig_share", "target", "repeats", "eager_variant", "eager_saving", "eager_saving_low", "eager_saving_high",
)  # fmt: skip


def eager_of(variant: str, variants: list[str]) -> str | None:
    """The eager layout a compiled or fused one (``..._compiled``, ``..._fused``) is paired with, where both are
    measured; None otherwise."""
    base = layout_of(variant)
    return base if base != variant and base in variants else None


def map_arms_variant(variant: str, variants: list[str]) -> str:
    """Whose no-map and sin/cos arms a layout's row reads: a compiled or fused layout's are its eager layout's where
    that is measured too (the same model without its map, the same trig), so they are timed once."""
    return eager_of(variant, variants) or variant


def repeat_features(tensor: torch.Tensor, copies: int) -> torch.Tensor:
    """``z`` repeated along its last dimension: the map's output width without the map."""
    return tensor.repeat(*([1] * (tensor.dim() - 1)), copies)


@contextlib.contextmanager
def map_replaced(model: torch.nn.Module) -> Iterator[int]:
    """Every ``QKMapFeatureMap`` of ``model`` maps ``z`` to ``repeat_features(z, 2F)`` inside the block (the layer
    projects queries and keys as usual: the recomputing node is off too); yields how many maps were replaced."""
    maps = [module for module in model.modules() if isinstance(module, QKMapFeatureMap)]
    for feature_map in maps:
        copies = 2 * feature_map.config.qkmap_num_frequencies
        feature_map.forward = lambda query, key, cos, sin, n=copies: (
            repeat_features(query, n),
            repeat_features(key, n),
        )
        feature_map.project = lambda *args: None
    try:
        yield len(maps)
    finally:
        for feature_map in maps:
            del feature_map.forward, feature_map.project


def phase_shapes(config, batch: int, seq_len: int) -> list[tuple[int, ...]]:
    """The shapes of the phases one training step turns into cos and sin: per layer, queries' and keys', once in
    the forward pass and once more in the backward pass's recomputation (``feature_map_qkmap._Layout.trig``)."""
    per_head = (batch, seq_len, config.qkmap_num_frequencies * config.resolved_qkmap_input_dim)
    roles = (config.num_attention_heads, config.num_key_value_heads)
    one_pass = [(per_head[0], per_head[1], heads, per_head[2]) for heads in roles]
    return one_pass * 2 * config.num_hidden_layers


class TrigWork:
    """The map's ``cos`` and ``sin`` calls of one training step, on preallocated buffers (phases of magnitude
    ~1, as ``omega z`` at the native init)."""

    def __init__(self, config, batch: int, seq_len: int, device: str = "cpu"):
        shapes = phase_shapes(config, batch, seq_len)
        # the map's phase math runs in float32 whatever the model's dtype (float64 stays float64, for gradcheck)
        self.phases = {shape: torch.randn(shape, device=device) for shape in set(shapes)}
        self.outputs = {shape: (torch.empty_like(self.phases[shape]), torch.empty_like(self.phases[shape]))
                        for shape in set(shapes)}  # fmt: skip
        self.calls = shapes

    def __call__(self) -> None:
        for shape in self.calls:
            cosines, sines = self.outputs[shape]
            torch.cos(self.phases[shape], out=cosines)
            torch.sin(self.phases[shape], out=sines)


def training_step(model: torch.nn.Module, ids: torch.Tensor) -> None:
    model(ids, labels=ids).loss.backward()
    model.zero_grad(set_to_none=True)


def measure_case(args: argparse.Namespace, size: dict, seq_len: int) -> list[dict]:
    """Raw rows (arm, repeat, seconds) of one (shape, T): every arm once per repeat, the order rotating, after
    ``WARMUP_REPEATS`` repeats that are timed and dropped."""
    dtype = getattr(torch, args.dtype)
    models = {name: build(name, args.device, dtype, "sdpa", size) for name in (STANDARD, *args.variants)}
    ids = torch.randint(0, size["vocab_size"], (args.batch, seq_len), generator=torch.Generator().manual_seed(0))
    ids = ids.to(args.device)
    arms: dict[str, object] = {STANDARD: lambda: training_step(models[STANDARD], ids)}
    for variant in args.variants:
        model = models[variant]
        arms[variant] = lambda model=model: training_step(model, ids)
        if map_arms_variant(variant, args.variants) == variant:
            arms[f"{variant}, {NO_MAP}"] = lambda model=model: _without_map(model, ids)
            arms[f"{variant}, {TRIG}"] = TrigWork(model.config, args.batch, seq_len, args.device)
    for work in arms.values():
        for _ in range(UNTIMED_STEPS):
            work()
    names, raw = list(arms), []
    for repeat in range(WARMUP_REPEATS + args.repeats):
        shift = repeat % len(names)
        for name in names[shift:] + names[:shift]:
            seconds = timed(arms[name], args.device)
            if repeat >= WARMUP_REPEATS:
                raw.append({"arm": name, "repeat": repeat - WARMUP_REPEATS, "seconds": seconds})
    return raw


def _without_map(model: torch.nn.Module, ids: torch.Tensor) -> None:
    with map_replaced(model):
        training_step(model, ids)


def per_repeat(raw: list[dict], arm: str) -> list[float]:
    return [row["seconds"] for row in sorted((r for r in raw if r["arm"] == arm), key=lambda r: r["repeat"])]


def summarize(size: dict, seq_len: int, variants: list[str], raw: list[dict]) -> list[dict]:
    """One row per layout: step, no-map and sin/cos ratios to standard (per repeat), the map's paired cost; for a
    compiled or fused layout measured next to its eager one, what it saves, ``(eager - it) / standard`` paired."""
    standard = per_repeat(raw, STANDARD)

    def ratios(arm: str) -> list[float]:
        return [t / s for t, s in zip(per_repeat(raw, arm), standard, strict=True)]

    rows = []
    for variant in variants:
        step, arms_of, eager = ratios(variant), map_arms_variant(variant, variants), eager_of(variant, variants)
        no_map, trig = ratios(f"{arms_of}, {NO_MAP}"), ratios(f"{arms_of}, {TRIG}")
        cost = paired_interval([a - b for a, b in zip(step, no_map, strict=True)])
        saving = paired_interval([a - b for a, b in zip(ratios(eager), step, strict=True)]) if eager else None
        rows.append(
            dict(
                shape=shape_label(size),
                hidden_size=size["hidden_size"],
                layers=size["num_hidden_layers"],
                seq_len=seq_len,
                variant=variant,
                standard_ms=1e3 * statistics.median(standard),
                step_ratio=statistics.median(step),
                step_min=min(step),
                step_max=max(step),
                no_map_ratio=statistics.median(no_map),
                no_map_min=min(no_map),
                no_map_max=max(no_map),
                floor_ratio=floor_ratio(size, variant, "train_tokens_per_s", seq_len),
                map_cost=cost["mean"],
                map_cost_low=cost["low"],
                map_cost_high=cost["high"],
                trig_share=statistics.median(trig),
                target=TARGETS.get((variant, "train_tokens_per_s")),
                repeats=len(standard),
                eager_variant=eager,
                eager_saving=saving and saving["mean"],
                eager_saving_low=saving and saving["low"],
                eager_saving_high=saving and saving["high"],
            )  # fmt: skip
        )
    return rows


def measured_case(args: argparse.Namespace, size: dict, seq_len: int) -> tuple[list[dict], list[dict]]:
    """``measure_case`` in a fresh process, resumable: a part with the same settings is read back."""
    path = part_path(args, size, seq_len)
    settings = {"variants": args.variants, "repeats": args.repeats, "batch": args.batch, "threads": args.threads,
                "device": args.device, "dtype": args.dtype}  # fmt: skip
    if path.exists():
        part = json.loads(path.read_text())
        if part.get("settings") == settings:  # summarized again: a part keeps its raw rows, the summary may change
            print(f"[map share] {shape_label(size)} T={seq_len}: done earlier ({path.name})", file=sys.stderr)
            return part["raw"], summarize(size, seq_len, args.variants, part["raw"])
    print(f"[map share] {shape_label(size)} T={seq_len}", file=sys.stderr, flush=True)
    raw = run_part(measure_case, args, size, seq_len)
    summary = summarize(size, seq_len, args.variants, raw)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, {"settings": settings, "raw": raw, "summary": summary})
    return raw, summary


def _cell(value: float | None, digits: int = 3) -> str:
    return "" if value is None else f"{value:.{digits}f}"


def markdown(summary: list[dict]) -> str:
    lines = [
        "| case | layout | standard step | step [range] | no map [range] | FLOP floor | map's cost (95 % CI) | "
        "sin/cos alone | target | saves against the eager map (95 % CI) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in summary:
        interval = (
            f"[{_cell(row['map_cost_low'])}, {_cell(row['map_cost_high'])}]" if row["map_cost_low"] is not None else ""
        )
        saving = ""
        if row.get("eager_saving") is not None:
            saving = f"{row['eager_saving']:+.3f}"
            if row["eager_saving_low"] is not None:
                saving += f" [{_cell(row['eager_saving_low'])}, {_cell(row['eager_saving_high'])}]"
        lines.append(
            f"| {row['shape']} T = {row['seq_len']} | {row['variant']} | {row['standard_ms']:.1f} ms | "
            f"{row['step_ratio']:.3f}x [{row['step_min']:.2f}-{row['step_max']:.2f}] | "
            f"{row['no_map_ratio']:.3f}x [{row['no_map_min']:.2f}-{row['no_map_max']:.2f}] | "
            f"{_cell(row['floor_ratio'])} | {row['map_cost']:+.3f} {interval} | {row['trig_share']:.3f} | "
            f"{_cell(row['target'], 2)} | {saving} |"
        )
    return "\n".join(lines)


def plot(summary: list[dict], path: Path) -> Path:
    """Per layout, one stacked bar per case: the step without the map, the map's sin/cos, the rest of the map; the
    FLOP floor as a tick and the target as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    variants = list(dict.fromkeys(row["variant"] for row in summary))
    fig, axes = plt.subplots(len(variants), 1, figsize=(7.5, 3.0 * len(variants)), squeeze=False)
    for ax, variant in zip(axes[:, 0], variants, strict=True):
        rows = [row for row in summary if row["variant"] == variant]
        xs = range(len(rows))
        base = [row["no_map_ratio"] for row in rows]
        trig = [min(row["trig_share"], max(row["map_cost"], 0.0)) for row in rows]
        rest = [max(row["map_cost"], 0.0) - t for row, t in zip(rows, trig, strict=True)]
        ax.bar(xs, base, color="#9db4cf", label="no map (kernel, padding, projections)")
        ax.bar(xs, trig, bottom=base, color="#e3a04f", label="map: its sin/cos alone")
        ax.bar(
            xs, rest, bottom=[b + t for b, t in zip(base, trig, strict=True)], color="#c8553d", label="map: the rest"
        )
        ax.scatter(xs, [row["floor_ratio"] for row in rows], marker="_", s=400, color="black", label="FLOP floor")
        if rows[0]["target"]:
            ax.axhline(rows[0]["target"], ls="--", color="gray", label=f"target {rows[0]['target']}x")
        ax.set_ylim(0.8, max(1.3, max(row["step_ratio"] for row in rows) + 0.05))
        ax.set_ylabel("step / standard's")
        ax.set_title(f"{variant}: training step over standard's", fontsize=9)
        ax.set_xticks(
            list(xs), [f"{row['shape']} T{row['seq_len']}" for row in rows], rotation=30, ha="right", fontsize=7
        )
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output-dir", type=Path, default=Path("runs/map_share"))
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    p.add_argument("--heads", type=int, nargs="+", default=[2, 8], help="query heads")
    p.add_argument("--kv-ratios", type=int, nargs="+", default=[1], help="query heads per key head (1: no GQA)")
    p.add_argument("--layers", type=int, nargs="+", default=[8])
    p.add_argument("--seq-lens", type=int, nargs="+", default=[512])
    p.add_argument("--variants", nargs="+", choices=[v for v in VARIANTS if v.startswith("qk_map")],
                   default=list(DEFAULT_LAYOUTS), help="QK-MAP layouts, each measured against standard")  # fmt: skip
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--device", default="cpu", help="cpu or cuda (benchmarks/gpu_check.sh)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--repeats", type=int, default=15)
    add_threads_option(p)
    p.add_argument("--in-process", dest="isolate", action="store_false", help="every case in this process")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    use_threads(args)
    sizes, skipped = grid_shapes(args.head_dims, args.heads, args.kv_ratios, args.layers)
    summary, raw = [], []
    for size in sizes:
        for seq_len in args.seq_lens:
            case_raw, case_summary = measured_case(args, size, seq_len)
            raw += [{"shape": shape_label(size), "seq_len": seq_len, **row} for row in case_raw]
            summary += case_summary
    args.output_dir.mkdir(parents=True, exist_ok=True)
    write_csv(args.output_dir / "map_share_summary.csv", summary, SUMMARY_FIELDS)
    write_csv(args.output_dir / "map_share_raw.csv", raw, ("shape", "seq_len", "arm", "repeat", "seconds"))
    table = markdown(summary)
    atomic_write_text(args.output_dir / "map_share_table.md", table + "\n")
    if summary:
        plot(summary, args.output_dir / "map_share.png")
    settings = (
        f"repeats={args.repeats} threads={torch.get_num_threads()} batch={args.batch} torch={torch.__version__} "
        f"qkmap_hf={qkmap_hf.__version__} ({args.dtype}, sdpa, {args.device})"
    )
    print_run(settings, skipped, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
