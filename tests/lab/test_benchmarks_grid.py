"""The shape grid of benchmarks/shape_grid.py (issue 23) on one tiny shape: columns, ratios, KV bytes, floors."""

from __future__ import annotations

import csv
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import shape_grid  # noqa: E402
from attention_overhead import layout_of, variant_config  # noqa: E402

from qkmap_hf import QKMapForCausalLM  # noqa: E402

# The variants the tiny grids measure: every one but the compiled and fused maps (the compiled ones compile on their
# first call, seconds each, most of this file's time when they were in); test_a_compiled_variant_is_measured_in_the_grid
# and test_a_fused_variant_is_measured_in_the_grid take one each.
EAGER_VARIANTS = tuple(variant for variant in shape_grid.VARIANTS if layout_of(variant) == variant)


@pytest.fixture(scope="module")
def grid(tmp_path_factory) -> tuple[list[dict], Path]:
    """d16, 4 query heads sharing 1 key/value head (GQA 4:1), 1 layer, T = 8, one repeat."""
    summary, _, _, skipped = run_tiny_grid(tmp_path_factory.mktemp("grid"), "--in-process", "--kernel-time")
    assert skipped == []
    path = tmp_path_factory.mktemp("grid") / "shape_grid_summary.csv"
    shape_grid.write_csv(path, summary, shape_grid.SUMMARY_FIELDS)
    return summary, path


def tiny_grid_args(output_dir: Path, *extra: str):
    args = shape_grid.parser().parse_args(
        ["--head-dims", "16", "--heads", "4", "--kv-ratios", "4", "--layers", "1", "--seq-lens", "8"]
        + ["--repeats", "1", "--decode-tokens", "1", "--kv-prompt-len", "3", "--kv-new-tokens", "2"]
        + ["--variants", *EAGER_VARIANTS, "--output-dir", str(output_dir), *extra]
    )
    args.variants = shape_grid.measured_variants(args.variants, args.reference)
    return args


def run_tiny_grid(output_dir: Path, *extra: str):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: a second thread only waits on a loaded machine
    try:
        return shape_grid.run_grid(tiny_grid_args(output_dir, *extra))
    finally:
        torch.set_num_threads(threads)


@pytest.mark.slow  # spawns a process (~7 s of imports)
def test_a_rerun_reads_finished_parts_back_and_remeasures_when_the_settings_change(tmp_path, monkeypatch) -> None:
    summary, raw, _, _ = run_tiny_grid(tmp_path)  # the default: the part measured in a spawned process
    assert {r["variant"] for r in summary if r["metric"] == "decode_ms_per_token"} == set(EAGER_VARIANTS)
    (part,) = (tmp_path / "parts").iterdir()
    assert part.name == "d16_h4_kv1_L1_T8.json"
    measured = []
    original = shape_grid.measure_shape
    monkeypatch.setattr(shape_grid, "measure_shape", lambda *a: measured.append(a) or original(*a))
    again, raw_again, _, _ = run_tiny_grid(tmp_path, "--in-process")
    assert measured == [] and again == summary and raw_again == raw  # read back, not remeasured
    changed, _, _, _ = run_tiny_grid(tmp_path, "--in-process", "--decode-tokens", "2")
    assert len(measured) == 1 and changed != summary  # other settings: measured again, the part replaced
    assert shape_grid.json.loads(part.read_text())["settings"]["decode_tokens"] == 2


def test_grid_csv_has_every_metric_and_variant_with_finite_positive_ratios(grid) -> None:
    summary, path = grid
    with open(path, newline="") as handle:
        reader = csv.DictReader(handle)
        assert tuple(reader.fieldnames) == shape_grid.SUMMARY_FIELDS
        rows = list(reader)
    assert {(r["metric"], r["variant"]) for r in rows} == {
        (metric, variant) for metric in shape_grid.COLUMNS for variant in EAGER_VARIANTS
    }
    assert {r["shape"] for r in rows} == {"d16 h4/kv1 L1"}
    for row in rows:
        for key in ("cost_ratio", "ratio_min", "ratio_max"):
            value = float(row[key])
            assert math.isfinite(value) and value > 0, row
        assert float(row["ratio_min"]) <= float(row["cost_ratio"]) <= float(row["ratio_max"])
        # Every row carries its floor (times: FLOPs; saved bytes: the kernel's; KV bytes: the expected ratio); only
        # decode has a memory floor.
        assert row["floor_ratio"] != "", row
        assert (row["memory_floor_ratio"] != "") == (row["metric"] == "decode_ms_per_token"), row
        # --kernel-time: every layout's training ratio also gets the floor with the kernel's measured time
        trained = row["metric"] == "train_tokens_per_s" and row["variant"] != "standard"
        assert (row["kernel_floor_ratio"] != "") == trained, row
    table = shape_grid.markdown(summary)
    assert table.count("\n") == 1 + len(EAGER_VARIANTS) - 1  # header, rule, one row per non-standard variant
    assert "vs floor" in table and "/ kernel" in table


@pytest.mark.slow  # compiles the map's forward and backward expressions (seconds each on 2 cores)
def test_a_compiled_variant_is_measured_in_the_grid(tmp_path, compiled_calls) -> None:
    summary = run_tiny_grid(tmp_path, "--in-process", "--variants", "standard", "qk_map_wide_compiled")[0]
    rows = {r["metric"]: r for r in summary if r["variant"] == "qk_map_wide_compiled"}
    assert set(rows) == set(shape_grid.COLUMNS) - {"attention_kernel_ms"}  # that one only with --kernel-time
    assert all(math.isfinite(r["cost_ratio"]) and r["cost_ratio"] > 0 for r in rows.values())
    # Its training ran the compiled map both ways, not the eager fall-back.
    assert {"_expression_query_key_features", "_expression_query_key_gradients"} <= set(compiled_calls)


def test_a_fused_variant_is_measured_in_the_grid(tmp_path, fused_calls) -> None:
    summary = run_tiny_grid(tmp_path, "--in-process", "--variants", "standard", "qk_map_compact_fused")[0]
    rows = {r["metric"]: r for r in summary if r["variant"] == "qk_map_compact_fused"}
    assert set(rows) == set(shape_grid.COLUMNS) - {"attention_kernel_ms"}
    assert all(math.isfinite(r["cost_ratio"]) and r["cost_ratio"] > 0 for r in rows.values())
    assert rows["train_tokens_per_s"]["floor_ratio"] == pytest.approx(
        shape_grid.floor_ratio(shape_grid.shape_size(16, 4, 4, 1), "qk_map_compact", "train_tokens_per_s", 8)
    )
    assert (
        shape_grid.TARGETS[("qk_map_compact_fused", "train_tokens_per_s")]
        == shape_grid.TARGETS[("qk_map_compact", "train_tokens_per_s")]
    )
    # Its training, prefill and decoding ran the fused kernel both ways, not the eager map.
    assert {"features", "feature_gradients"} <= set(fused_calls)


def test_wide_kv_bytes_per_token_follow_the_cached_widths(grid) -> None:
    summary, _ = grid
    config = variant_config("qk_map_wide", shape_grid.shape_size(16, 4, 4, 1))
    # Keys are cached after the feature map (2 F m wide), values at head_dim; standard caches both at head_dim.
    two_f_m = 2 * config.qkmap_num_frequencies * config.resolved_qkmap_input_dim
    expected = (two_f_m + config.head_dim) / (2 * config.head_dim)
    assert expected != 1  # the check below must be able to fail
    by_key = {(r["metric"], r["variant"]): r for r in summary}
    for cache in ("dynamic", "static"):
        wide, standard = (
            by_key[(f"kv_bytes_per_token_{cache}", "qk_map_wide")],
            by_key[(f"kv_bytes_per_token_{cache}", "standard")],
        )
        assert wide["median"] / standard["median"] == pytest.approx(expected, rel=0.01)
        # float32, 1 key/value head, 1 layer: standard holds 16 + 16 floats per token.
        assert standard["median"] == (16 + 16) * 4


def test_floor_matches_a_hand_count() -> None:
    size = shape_grid.shape_size(16, 4, 4, 1)
    assert (size["hidden_size"], size["intermediate_size"], size["num_key_value_heads"]) == (64, 192, 1)
    T = 8
    # Per token: q, k, v, o projections (4*16 + 16 + 16 + 4*16 outputs of 64 inputs), MLP 3 x 64 x 192, 2 FLOPs each.
    per_token = 2 * 64 * (64 + 16 + 16 + 64) + 2 * 3 * 64 * 192
    lm_head = 2 * 64 * 4096
    pairs = T * (T + 1) // 2  # causal
    standard_forward = T * per_token + 2 * 4 * pairs * (16 + 16) + T * lm_head
    # Wide: m = 16, keys 2m = 32 wide, z projections as wide as standard's; sdpa pads values to 32 for T > 1.
    wide_forward = T * per_token + 2 * 4 * pairs * (32 + 32) + T * lm_head
    assert shape_grid.floor_ratio(size, "qk_map_wide", "train_tokens_per_s", T) == pytest.approx(
        wide_forward / standard_forward, rel=1e-12
    )
    # Decoding one token against T cached ones: sdpa's single-query path leaves the values unpadded.
    standard_decode = per_token + 2 * 4 * T * (16 + 16) + lm_head
    wide_decode = per_token + 2 * 4 * T * (32 + 16) + lm_head
    assert shape_grid.floor_ratio(size, "qk_map_wide", "decode_ms_per_token", T) == pytest.approx(
        wide_decode / standard_decode, rel=1e-12
    )
    # Compact: m = 8, q/k projections half as wide, keys 16 wide: no padding, fewer FLOPs than standard.
    compact_forward = T * (per_token - 2 * 64 * (32 + 8)) + 2 * 4 * pairs * (16 + 16) + T * lm_head
    assert shape_grid.floor_ratio(size, "qk_map_compact", "forward_tokens_per_s", T) == pytest.approx(
        compact_forward / standard_forward, rel=1e-12
    )
    assert shape_grid.floor_ratio(size, "qk_map_wide", "activation_bytes", T) is None


def test_the_recomputing_layouts_training_floor_adds_the_projection_flops_it_runs_again() -> None:
    """Counted by torch's FlopCounterMode over one real training step of each layout: the recomputing node's
    extra FLOPs are the query and key projections once more, what its training floor adds (and nothing else)."""
    from torch.utils.flop_counter import FlopCounterMode

    size, T = shape_grid.shape_size(16, 4, 2, 2), 8
    counted = {}
    for variant in ("qk_map_wide", "qk_map_wide_recompute"):
        model = QKMapForCausalLM(variant_config(variant, size))
        ids = torch.randint(0, 4096, (1, T))
        with FlopCounterMode(display=False) as counter:
            model(ids, labels=ids).loss.backward()
        counted[variant] = counter.get_total_flops()
    floors = {v: shape_grid.floor_ratio(size, v, "train_tokens_per_s", T) for v in counted}
    standard = shape_grid.matmul_flops(variant_config("standard", size), T, "train")
    extra = counted["qk_map_wide_recompute"] - counted["qk_map_wide"]
    assert extra == 2 * 64 * (4 + 2) * 16 * T * 2  # hidden 64 into 4 + 2 heads of 16, T tokens, 2 layers
    assert (floors["qk_map_wide_recompute"] - floors["qk_map_wide"]) * standard == pytest.approx(extra, rel=1e-12)
    for metric in ("forward_tokens_per_s", "decode_ms_per_token"):
        assert shape_grid.floor_ratio(size, "qk_map_wide_recompute", metric, T) == shape_grid.floor_ratio(
            size, "qk_map_wide", metric, T
        )


# Weights one decoded token reads in the tiny grid's shape (d16, 4 query heads, 1 key/value head, hidden 64, MLP
# 192, 1 layer): q, k, v, o, the MLP and the LM head, each once.
TINY_DECODE_WEIGHTS = 64 * (64 + 16 + 16 + 64) + 3 * 64 * 192 + 64 * 4096


def test_memory_floor_of_decode_matches_a_hand_count() -> None:
    size = shape_grid.shape_size(16, 4, 4, 1)  # hidden 64, MLP 192, 4 query heads, 1 key/value head, 1 layer
    T = 8
    weights = TINY_DECODE_WEIGHTS
    # The dynamic cache: cat reads the old cache and writes the new one, attention reads it: 3 passes.
    standard = weights + 3 * T * (16 + 16)
    wide = weights + 3 * T * (32 + 16)  # keys cached after the map, 2m = 32 wide; sdpa's single query: no padding
    assert shape_grid.memory_floor_ratio(size, "qk_map_wide", "decode_ms_per_token", T) == pytest.approx(
        wide / standard, rel=1e-12
    )
    # flash pads the values of one query too: written and read once more at the key width.
    padded = wide + 2 * T * 32
    assert shape_grid.memory_floor_ratio(
        size, "qk_map_wide", "decode_ms_per_token", T, "flash_attention_2"
    ) == pytest.approx(padded / standard, rel=1e-12)
    # Compact: q/k projections half as wide (4 x 8 + 8 outputs instead of 4 x 16 + 16), keys 16 wide.
    compact = weights - 64 * (32 + 8) + 3 * T * (16 + 16)
    assert shape_grid.memory_floor_ratio(size, "qk_map_compact", "decode_ms_per_token", T) == pytest.approx(
        compact / standard, rel=1e-12
    )
    assert shape_grid.memory_floor_ratio(size, "qk_map_wide", "train_tokens_per_s", T) is None
    # A batch of 4 reads the weights once and each sequence's cache: the cache's share, and the floor, grow.
    batched = [weights + 4 * 3 * T * (width + 16) for width in (32, 16)]  # wide, standard
    assert shape_grid.memory_floor_ratio(size, "qk_map_wide", "decode_ms_per_token", T, batch=4) == pytest.approx(
        batched[0] / batched[1], rel=1e-12
    )
    # The cache's share grows with T: so does the wide layout's memory floor.
    assert shape_grid.memory_floor_ratio(size, "qk_map_wide", "decode_ms_per_token", 4096) > wide / standard


def test_static_cache_decoding_is_measured_with_its_own_memory_floor_and_kept_apart_from_dynamic_parts(
    tmp_path,
) -> None:
    dynamic = shape_grid.run_grid(tiny_grid_args(tmp_path, "--in-process"))[0]
    static_args = tiny_grid_args(tmp_path, "--in-process", "--decode-cache", "static")
    static = shape_grid.run_grid(static_args)[0]
    part = shape_grid.json.loads(shape_grid.part_path(static_args, shape_grid.shape_size(16, 4, 4, 1), 8).read_text())
    assert part["settings"]["decode_cache"] == "static"  # remeasured, not read back from the dynamic run's part

    def wide_decode(summary: list[dict]) -> dict:
        (row,) = [r for r in summary if r["metric"] == "decode_ms_per_token" and r["variant"] == "qk_map_wide"]
        return row

    assert wide_decode(static)["decode_cache"] == "static" and wide_decode(dynamic)["decode_cache"] == "dynamic"
    # Written in place, the static cache is read once per token: one pass, against the dynamic cache's three.
    weights = TINY_DECODE_WEIGHTS
    assert wide_decode(static)["memory_floor_ratio"] == pytest.approx(
        (weights + 8 * (32 + 16)) / (weights + 8 * (16 + 16)), rel=1e-12
    )
    assert wide_decode(static)["memory_floor_ratio"] < wide_decode(dynamic)["memory_floor_ratio"]
    assert math.isfinite(wide_decode(static)["cost_ratio"]) and wide_decode(static)["cost_ratio"] > 0


def test_decode_with_a_static_cache_continues_the_prompt_as_a_full_forward_does() -> None:
    import argparse

    import attention_overhead

    torch.manual_seed(0)
    model = attention_overhead.build("qk_map_wide", "cpu", torch.float32, "sdpa", shape_grid.shape_size(16, 4, 2, 1))
    ids = torch.randint(0, 4096, (1, 12))
    args = argparse.Namespace(decode_cache="static", prefill_len=10, decode_tokens=2)
    with torch.no_grad():
        full = model(ids).logits[0]
        cache = attention_overhead.decode_cache(args, model)
        assert type(cache).__name__ == "StaticCache"
        model(ids[:, :10], cache=cache, use_cache=True)
        for position in (10, 11):
            step = model(ids[:, position : position + 1], cache=cache, use_cache=True).logits[0, -1]
            torch.testing.assert_close(step, full[position], atol=1e-5, rtol=1e-5)
    assert attention_overhead.decode_cache(argparse.Namespace(decode_cache="dynamic"), model) is None


def test_summarize_adds_the_memory_floor_to_runs_written_before_it(grid, tmp_path, capsys) -> None:
    _, path = grid
    with open(path, newline="") as handle:
        reader = csv.DictReader(handle)
        fields = [f for f in reader.fieldnames if f != "memory_floor_ratio"]
        rows = list(reader)
    old = tmp_path / "old"
    old.mkdir()
    with open(old / "shape_grid_summary.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    (wide,) = [
        r
        for r in shape_grid.read_summary("old", old)
        if r["metric"] == "decode_ms_per_token" and r["variant"] == "qk_map_wide"
    ]
    size = shape_grid.shape_size(16, 4, 4, 1)
    assert wide["memory_floor_ratio"] == shape_grid.memory_floor_ratio(size, "qk_map_wide", "decode_ms_per_token", 8)
    assert wide["memory_floor_ratio"] > 1


@pytest.mark.usefixtures("one_thread")
def test_saved_bytes_leave_the_weights_out_and_the_wide_layout_saves_the_counted_kernel_extra_and_z() -> None:
    from attention_overhead import build, saved_activation_bytes

    size = shape_grid.shape_size(16, 4, 4, 1)  # hidden 64: 4 query heads of 16, 1 key/value head, 1 layer
    saved = {}
    for variant in ("standard", "qk_map_wide", "qk_map_wide_recompute"):
        model = build(variant, "cpu", torch.float32, "sdpa", size)
        for T in (8, 16):
            saved[variant, T] = saved_activation_bytes(model, torch.randint(0, 4096, (1, T)))[0]
    # Without the weights' views (every matmul keeps weight.t(): 0.3 M floats here, against ~80 K saved at T = 8)
    # the count is linear in T up to a few per-call scalars: standard's loss keeps one float32, the map its (kv, F, m)
    # frequency and gain rows (2 x 16 floats).
    assert saved["standard", 16] - 2 * saved["standard", 8] == -4
    assert saved["qk_map_wide", 16] - 2 * saved["qk_map_wide", 8] == -4 - 4 * 2 * 16
    # The wide layout's extra at T = 8, in floats, against the counts: the kernel's queries, keys, padded values and
    # output 32 wide instead of 16 (5 heads in all), z (the map's input, kept for omega's gradient: 4 + 1 heads x
    # 16), the map's RoPE tables (2 x T x m) and its two rows, where standard's RoPE keeps cos and sin for queries
    # and keys (4 x T x 16).
    kernel = shape_grid.kernel_saved_extra_elements(variant_config("qk_map_wide", size), 8)
    assert kernel == 8 * (5 * 16 + 5 * 16)
    z, tables = 5 * 8 * 16, 2 * 8 * 16 + 2 * 16 - 4 * 8 * 16
    assert saved["qk_map_wide", 8] - saved["standard", 8] == 4 * (kernel + z + tables)
    floor = shape_grid.activation_floor_ratio(size, "qk_map_wide", 8, saved["standard", 8])
    assert floor == pytest.approx((saved["standard", 8] + 4 * kernel) / saved["standard", 8], rel=1e-12)
    assert shape_grid.activation_floor_ratio(size, "qk_map_compact", 8, saved["standard", 8]) == 1.0
    # Recomputing the projections: no z, and the layer input kept once by the node instead of by q_proj and k_proj.
    assert saved["qk_map_wide", 8] - saved["qk_map_wide_recompute", 8] == 4 * (z + 8 * 64)


@pytest.mark.usefixtures("one_thread", "fused_kernel")
@pytest.mark.parametrize("wide", ["qk_map_wide_recompute", "qk_map_wide_recompute_kernels"])
def test_distinct_storages_of_the_wide_layout_are_standards_plus_what_the_kernel_keeps(wide: str) -> None:
    """The wide layout's default (projections recomputed; sdpa with ``o_proj`` keeping a view of the kernel's padded
    output, or the fused attention, which keeps values and output at their width) grows its distinct storages with
    T by exactly the kernel's extra; the rest is per call, not per position, and less than the map's parameters. So
    its distinct-storage ratio sits on the floor ``with_activation_floors`` gives it, at T = 16 already within
    0.1 %."""
    from attention_overhead import build, saved_activation_bytes

    size = shape_grid.shape_size(16, 4, 4, 1)
    models = {variant: build(variant, "cpu", torch.float32, "sdpa", size) for variant in ("standard", wide)}
    distinct = {
        (variant, T): saved_activation_bytes(model, torch.randint(0, 4096, (1, T)))[1]
        for variant, model in models.items()
        for T in (8, 16)
    }
    config = models[wide].config
    above = {
        T: distinct[wide, T] - distinct["standard", T] - 4 * shape_grid.kernel_saved_extra_elements(config, T)
        for T in (8, 16)
    }
    map_bytes = 4 * sum(p.numel() for name, p in models[wide].named_parameters() if ".qk_map." in name)
    assert above[8] == above[16] and 0 <= above[8] < map_bytes
    summary = [
        dict(metric="distinct_activation_bytes", variant=variant, seq_len=16, median=distinct[variant, 16])
        for variant in models
    ]
    floor = shape_grid.with_activation_floors(summary, size, "sdpa", 1, "float32")[1]["floor_ratio"]
    measured = distinct[wide, 16] / distinct["standard", 16]
    assert measured == pytest.approx(floor + above[16] / distinct["standard", 16], rel=1e-12)
    assert 0 <= measured - floor < 1e-3
    padded = config.query_key_dim - config.head_dim  # what sdpa's padding keeps per value and output row
    assert shape_grid.value_width(config, "sdpa", 16) == config.head_dim + (0 if wide.endswith("_kernels") else padded)


@pytest.mark.slow  # spawns a process (~7 s of imports)
def test_parts_counted_with_the_weights_get_their_saved_bytes_again_and_keep_their_timings(tmp_path) -> None:
    args = tiny_grid_args(tmp_path)
    size = shape_grid.shape_size(16, 4, 4, 1)
    run_tiny_grid(tmp_path, "--in-process")
    path = shape_grid.part_path(args, size, 8)
    part = shape_grid.json.loads(path.read_text())
    fresh = {r["variant"]: r["median"] for r in part["summary"] if r["metric"] == "activation_bytes"}
    # As a part written before the count left the weights out: no marker, every save counted (a stand-in number),
    # and a training time the rerun must keep.
    for key in shape_grid.SAVED_BYTES_COUNT:
        del part["settings"][key]
    for row in part["summary"]:
        if row["metric"] == "activation_bytes":
            row["median"], row["floor_ratio"] = row["median"] + 10**6, None
        if row["metric"] == "train_tokens_per_s" and row["variant"] == "qk_map_wide":
            row["cost_ratio"] = 9.5
    shape_grid.atomic_write_json(path, part)
    summary = run_tiny_grid(tmp_path)[0]  # the default: the bytes counted in a spawned process
    by_key = {(r["metric"], r["variant"]): r for r in summary}
    assert by_key["train_tokens_per_s", "qk_map_wide"]["cost_ratio"] == 9.5  # the timing was read back, not redone
    for variant, value in fresh.items():
        assert by_key["activation_bytes", variant]["median"] == value  # counted again, without the weights
    wide = by_key["activation_bytes", "qk_map_wide"]
    assert wide["cost_ratio"] == pytest.approx(fresh["qk_map_wide"] / fresh["standard"])
    assert wide["floor_ratio"] == shape_grid.activation_floor_ratio(size, "qk_map_wide", 8, fresh["standard"])
    assert shape_grid.json.loads(path.read_text())["settings"] == shape_grid.measurement_settings(args)


def test_grid_skips_and_names_shapes_gqa_cannot_divide() -> None:
    sizes, skipped = shape_grid.grid_shapes([64], [2, 8], [1, 4], [2])
    assert [(s["num_attention_heads"], s["num_key_value_heads"]) for s in sizes] == [(2, 2), (8, 8), (8, 2)]
    assert len(skipped) == 1 and "h2 GQA 4:1" in skipped[0]


def test_summarize_reads_grid_and_overhead_csvs_with_the_floors_of_each_runs_kernel_cache_and_batch(
    grid, tmp_path, monkeypatch, capsys
) -> None:
    import attention_overhead

    def fake_measure(args):  # the timings; what main writes from them is the code under test
        rows = []
        for variant, train, decode in (("standard", 100.0, 2.0), ("qk_map_wide", 80.0, 2.5)):
            rows.append(dict(variant=variant, seq_len=64, metric="train_tokens_per_s", value=train, repeat=0))
            rows.append(dict(variant=variant, seq_len=32, metric="decode_ms_per_token", value=decode, repeat=0))
        return rows

    monkeypatch.setattr(attention_overhead, "measure", fake_measure)
    overhead = tmp_path / "overhead"
    flags = ["--attn", "flash_attention_2", "--decode-cache", "static", "--batch", "8"]
    assert attention_overhead.main([*flags, "--output-dir", str(overhead)]) == 0
    _, path = grid
    assert shape_grid.main(["--summarize", f"grid={path.parent}", f"gpu={overhead}", f"gone={tmp_path / 'x'}"]) == 0
    out = capsys.readouterr().out
    size = attention_overhead.MODEL_SIZE
    train_floor = shape_grid.floor_ratio(size, "qk_map_wide", "train_tokens_per_s", 64, "flash_attention_2")
    memory = shape_grid.memory_floor_ratio(
        size, "qk_map_wide", "decode_ms_per_token", 32, "flash_attention_2", "static", batch=8
    )
    assert memory != shape_grid.memory_floor_ratio(size, "qk_map_wide", "decode_ms_per_token", 32)
    assert f"| gpu | d64 h8/kv8 L4 | 64 | qk_map_wide | 1.250x [1.25-1.25] vs floor {train_floor:.3f} |" in out
    decode_floor = shape_grid.floor_ratio(size, "qk_map_wide", "decode_ms_per_token", 32, "flash_attention_2")
    decode_cell = f"1.250x [1.25-1.25] vs floor {decode_floor:.3f} / memory {memory:.3f}"
    (decode_row,) = [line for line in out.splitlines() if line.startswith("| gpu | d64 h8/kv8 L4 | 32 | qk_map_wide |")]
    assert f"| {decode_cell} |" in decode_row
    assert "| grid | d16 h4/kv1 L1 | 8 | qk_map_wide |" in out
    assert f"missing: gone (no summary CSV or finished part under {tmp_path / 'x'})" in out


@pytest.mark.usefixtures("one_thread")
def test_summarize_reads_the_finished_parts_of_a_grid_that_stopped_before_its_summary(tmp_path, capsys) -> None:
    summary = run_tiny_grid(tmp_path, "--in-process")[0]  # writes parts/, not the CSV (main does, at the end)
    assert not (tmp_path / "shape_grid_summary.csv").exists()
    assert shape_grid.main(["--summarize", f"stopped={tmp_path}", "--plot", str(tmp_path / "plot.png")]) == 0
    assert (tmp_path / "plot.png").read_bytes().startswith(b"\x89PNG")
    out = capsys.readouterr().out
    (wide_train,) = [r for r in summary if r["metric"] == "train_tokens_per_s" and r["variant"] == "qk_map_wide"]
    assert f"| stopped | d16 h4/kv1 L1 | 8 | qk_map_wide | {shape_grid.format_cell(wide_train)} |" in out
    assert "| qk_map_wide | train step | <= 1.22x | 1 |" in out  # the target table counts the part's case


def test_kv_only_measures_cache_bytes_of_every_variant_without_timing(tmp_path) -> None:
    args = shape_grid.parser().parse_args(
        ["--kv-only", "--head-dims", "16", "--heads", "4", "--kv-ratios", "2", "--layers", "1"]
        + ["--kv-prompt-len", "3", "--kv-new-tokens", "2", "--output-dir", str(tmp_path)]
    )
    summary, raw, _, _ = shape_grid.run_grid(args)
    assert raw == [] and {r["metric"] for r in summary} == {"kv_bytes_per_token_dynamic", "kv_bytes_per_token_static"}
    for row in summary:
        assert row["cost_ratio"] == pytest.approx(row["floor_ratio"])  # measured bytes as the config predicts
    assert {r["variant"] for r in summary} == set(args.variants)
    assert shape_grid.plot(summary, tmp_path / "ratios.png") is None


def test_targets_are_met_at_the_floor_or_missed_as_the_issue_defines_them() -> None:
    def row(shape: str, ratio: float, floor: float | None, metric: str = "train_tokens_per_s") -> dict:
        return {"shape": shape, "seq_len": 512, "variant": "qk_map_wide", "metric": metric, "cost_ratio": ratio,
                "floor_ratio": floor}  # fmt: skip

    target = shape_grid.TARGETS[("qk_map_wide", "train_tokens_per_s")]  # 1.22
    assert shape_grid.target_status(row("a", 1.20, 1.10), target) == "met"
    assert shape_grid.target_status(row("b", 1.40, 1.38), target) == "at floor"  # floor above target, within 3 %
    assert shape_grid.target_status(row("c", 1.43, 1.38), target) == "missed"  # 3.6 % above its floor
    assert shape_grid.target_status(row("d", 1.25, 1.10), target) == "missed"  # floor below target: no excuse
    assert shape_grid.target_status(row("e", 1.25, None), target) == "missed"
    # Decode: the higher of the FLOP and the memory floor binds.
    decode = shape_grid.TARGETS[("qk_map_wide", "decode_ms_per_token")]  # 1.15
    at_memory = {**row("f", 1.20, 1.06, "decode_ms_per_token"), "memory_floor_ratio": 1.17}
    assert shape_grid.target_status(at_memory, decode) == "at floor"
    assert shape_grid.target_status({**at_memory, "memory_floor_ratio": 1.12}, decode) == "missed"
    summary = [row(name, ratio, floor) for name, ratio, floor in [("a", 1.2, 1.1), ("b", 1.4, 1.38), ("c", 1.43, 1.38)]]
    summary.append(row("a", 1.30, None, "activation_bytes"))
    table = shape_grid.target_table(summary)
    assert "| qk_map_wide | train step | <= 1.22x | 3 | 1 | 1 | 1 | c T=512: 1.430x, floor 1.380 |" in table
    assert "| qk_map_wide | saved act. bytes | <= 1.15x | 1 | 0 | 0 | 1 | a T=512: 1.300x |" in table
    assert "qk_map_compact" not in table  # no rows, no line


@pytest.mark.usefixtures("one_thread")
def test_prefill_is_the_median_of_its_timed_calls_and_decode_continues_from_the_last(monkeypatch) -> None:
    import argparse

    import attention_overhead

    durations = iter([0.005, 0.001, 0.003, 0.002])  # three prefills, then the one decode step
    calls = []

    def fake_timed(fn, device):
        fn()
        calls.append(fn.__name__)
        return next(durations)

    monkeypatch.setattr(attention_overhead, "timed", fake_timed)
    args = argparse.Namespace(
        device="cpu", dtype="float32", attn="sdpa", variants=["standard"], seq_lens=[], max_train_len=0, batch=1,
        repeats=1, prefill_len=4, prefill_calls=3, decode_tokens=1,
    )  # fmt: skip
    size = shape_grid.shape_size(head_dim=16, heads=4, kv_ratio=2, layers=1)
    rows = attention_overhead.measure(args, size)
    value = {r["metric"]: r["value"] for r in rows}
    assert calls == ["prefill"] * 3 + ["decode"]
    assert value["prefill_ms"] == pytest.approx(3.0) and value["decode_ms_per_token"] == pytest.approx(2.0)
    tokens = args.prefill_len + args.decode_tokens  # one prefill's cache (not three stacked), one token longer
    per_token = 2 * size["num_key_value_heads"] * size["head_dim"] * 4 * size["num_hidden_layers"]
    assert value["kv_cache_bytes"] == tokens * per_token


@pytest.mark.usefixtures("one_thread")
def test_the_first_repeat_is_timed_and_dropped_so_its_cold_steps_bias_no_ratio(monkeypatch) -> None:
    import argparse

    import attention_overhead

    timed_calls = []

    def fake_timed(fn, device):
        fn()
        timed_calls.append(fn.__name__)
        # the warm-up repeat (the first forward and step of each of the 2 variants) is slow; later ones are not
        return 10.0 if len(timed_calls) <= 4 else 0.5

    monkeypatch.setattr(attention_overhead, "timed", fake_timed)
    args = argparse.Namespace(
        device="cpu", dtype="float32", attn="sdpa", variants=["standard", "qk_map_wide"], seq_lens=[8],
        max_train_len=8, batch=1, repeats=2, prefill_len=4, prefill_calls=1, decode_tokens=1,
    )  # fmt: skip
    rows = attention_overhead.measure(args, shape_grid.shape_size(head_dim=16, heads=4, kv_ratio=2, layers=1))
    assert attention_overhead.WARMUP_REPEATS == 1
    assert timed_calls.count("step") == len(args.variants) * (args.repeats + 1)  # the warm-up repeat ran ...
    timings = [r for r in rows if r["metric"] in ("forward_tokens_per_s", "train_tokens_per_s")]
    assert sorted({r["repeat"] for r in timings}) == [0, 1]  # ... and left no rows
    assert {r["value"] for r in timings} == {8 / 0.5}  # none of its 10-second timings
    summary = {(r["variant"], r["metric"]): r for r in attention_overhead.ratios(rows)}
    assert summary[("qk_map_wide", "train_tokens_per_s")]["cost_ratio"] == pytest.approx(1.0)


def test_parts_that_time_training_record_the_warm_up_and_decode_only_parts_match_older_ones(tmp_path) -> None:
    trained = shape_grid.measurement_settings(tiny_grid_args(tmp_path))
    decode_only = shape_grid.measurement_settings(tiny_grid_args(tmp_path, "--no-train"))
    assert trained["warmup_repeats"] == 1
    assert "warmup_repeats" not in decode_only and "decode_cache" not in decode_only
    static = shape_grid.measurement_settings(tiny_grid_args(tmp_path, "--no-train", "--decode-cache", "static"))
    assert static["decode_cache"] == "static"


def test_parts_with_the_kernel_time_are_kept_apart_from_parts_without(tmp_path) -> None:
    plain = shape_grid.measurement_settings(tiny_grid_args(tmp_path))
    timed = shape_grid.measurement_settings(tiny_grid_args(tmp_path, "--kernel-time"))
    assert "kernel_time" not in plain and timed["kernel_time"] is True  # older parts still match plain runs
    decode_only = shape_grid.measurement_settings(tiny_grid_args(tmp_path, "--kernel-time", "--no-train"))
    assert "kernel_time" not in decode_only  # nothing to replay without the training step


def test_summarize_versus_pairs_two_layouts_per_repeat_from_the_parts(tmp_path, capsys) -> None:
    """``--summarize --versus qk_map_wide``: the recomputing layout against the wide one, repeat by repeat, from the
    raw values the parts keep; standard against the wide layout is the reciprocal of the wide layout's ratio."""
    run_tiny_grid(tmp_path, "--in-process", "--repeats", "2", "--variants", "qk_map_wide", "qk_map_wide_recompute")
    rows = shape_grid.versus_rows("tiny", tmp_path, "qk_map_wide")
    (part,) = (tmp_path / "parts").glob("*.json")
    raw = shape_grid.json.loads(part.read_text())["raw"]

    def values(variant, metric):
        return [r["value"] for r in raw if r["variant"] == variant and r["metric"] == metric]

    train = {r["variant"]: r for r in rows if r["metric"] == "train_tokens_per_s"}
    assert set(train) == {"standard", "qk_map_wide_recompute"}
    wide, fused = values("qk_map_wide", "train_tokens_per_s"), values("qk_map_wide_recompute", "train_tokens_per_s")
    per_repeat = [w / f for w, f in zip(wide, fused, strict=True)]
    assert len(per_repeat) == 2 and train["qk_map_wide_recompute"]["ratio_min"] == min(per_repeat)
    assert train["qk_map_wide_recompute"]["cost_ratio"] == pytest.approx(sum(per_repeat) / 2, rel=1e-12)
    (saved,) = (r for r in rows if r["metric"] == "activation_bytes" and r["variant"] == "qk_map_wide_recompute")
    assert (
        saved["cost_ratio"]
        == values("qk_map_wide_recompute", "activation_bytes")[0] / values("qk_map_wide", "activation_bytes")[0]
        < 1
    )
    assert shape_grid.versus_rows("tiny", tmp_path, "qk_norm") == []  # not measured in this run
    assert shape_grid.main(["--summarize", f"tiny={tmp_path}", "--versus", "qk_map_wide"]) == 0
    printed = capsys.readouterr().out
    assert "ratios against qk_map_wide" in printed and "| tiny | d16 h4/kv1 L1 | 8 | qk_map_wide_recompute |" in printed


@pytest.mark.usefixtures("one_thread")
def test_a_run_against_another_reference_measures_no_standard_and_gives_no_floors_or_targets(tmp_path, capsys) -> None:
    """``--reference qk_map_wide``: two layouts timed against each other without standard (three models at hidden
    2048 do not fit in memory). Ratios are paired per repeat against the reference; floors and targets, which are
    counts against standard, are left out rather than put next to a ratio of another kind."""
    flags = ["--in-process", "--repeats", "2", "--variants", "qk_map_wide_recompute", "--reference", "qk_map_wide"]
    summary, raw, _, _ = run_tiny_grid(tmp_path, *flags)
    assert {r["variant"] for r in raw} == {"qk_map_wide", "qk_map_wide_recompute"}
    (part,) = (tmp_path / "parts").glob("*.json")
    assert shape_grid.json.loads(part.read_text())["settings"]["reference"] == "qk_map_wide"

    def values(variant, metric):
        return [r["value"] for r in raw if r["variant"] == variant and r["metric"] == metric]

    rows = {(r["variant"], r["metric"]): r for r in summary}
    train = rows["qk_map_wide_recompute", "train_tokens_per_s"]
    per_repeat = [
        w / f
        for w, f in zip(
            values("qk_map_wide", "train_tokens_per_s"),
            values("qk_map_wide_recompute", "train_tokens_per_s"),
            strict=True,
        )
    ]
    assert len(per_repeat) == 2 and train["cost_ratio"] == pytest.approx(sum(per_repeat) / 2, rel=1e-12)
    assert rows["qk_map_wide", "train_tokens_per_s"]["cost_ratio"] == 1.0
    saved = rows["qk_map_wide_recompute", "activation_bytes"]
    wide_bytes, recompute_bytes = (
        values("qk_map_wide", "activation_bytes"),
        values("qk_map_wide_recompute", "activation_bytes"),
    )
    assert saved["cost_ratio"] == recompute_bytes[0] / wide_bytes[0] < 1  # z not kept
    assert rows["qk_map_wide_recompute", "kv_bytes_per_token_dynamic"]["cost_ratio"] == 1.0  # the same cache
    assert all(r.get("floor_ratio") is None and r.get("kernel_floor_ratio") is None for r in summary)
    assert all(r["reference"] == "qk_map_wide" for r in summary)

    path = tmp_path / "shape_grid_summary.csv"
    shape_grid.write_csv(path, summary, shape_grid.SUMMARY_FIELDS)
    assert shape_grid.main(["--summarize", f"pair={tmp_path}"]) == 0
    printed = capsys.readouterr().out
    assert f"| pair | d16 h4/kv1 L1 | 8 | qk_map_wide_recompute | {shape_grid.format_cell(train)} |" in printed
    assert "| pair | d16 h4/kv1 L1 | 8 | qk_map_wide |" not in printed  # the reference's own rows: all 1
    assert "vs floor" not in printed and "| qk_map_wide_recompute | train step | <= 1.22x" not in printed
    against_standard, _, _, _ = run_tiny_grid(tmp_path, "--in-process", "--variants", "qk_map_wide")
    assert {r["variant"] for r in against_standard} == {"standard", "qk_map_wide"}  # the other part: measured anew


@pytest.mark.slow  # a spawned part imports torch and the package (~10 s here)
def test_a_part_process_ends_when_its_run_is_killed(tmp_path) -> None:
    """Killing a run (SIGKILL: no cleanup of its own) ends its spawned part too, instead of leaving it measuring."""
    import os
    import signal
    import subprocess
    import time

    (tmp_path / "sleeper.py").write_text(
        "import os, time\n"
        "def record_and_sleep(args, path):\n"
        "    open(path, 'w').write(str(os.getpid()))\n"
        "    time.sleep(120)\n"
    )
    pid_file = tmp_path / "part.pid"
    benchmarks = Path(__file__).resolve().parents[2] / "benchmarks"
    code = (
        f"import sys, argparse; sys.path[:0] = [{str(tmp_path)!r}, {str(benchmarks)!r}]\n"
        "import shape_grid, sleeper\n"
        "shape_grid.run_part(sleeper.record_and_sleep, argparse.Namespace(isolate=True, threads=1), "
        f"{str(pid_file)!r})\n"
    )
    run = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 120
        while not pid_file.exists() or not pid_file.read_text():
            assert run.poll() is None and time.monotonic() < deadline, "the part never started"
            time.sleep(0.2)
        part = int(pid_file.read_text())
        os.kill(run.pid, signal.SIGKILL)
        run.wait()
        deadline = time.monotonic() + 20
        stat = Path(f"/proc/{part}/stat")
        while time.monotonic() < deadline:
            try:  # gone, or a zombie nobody has reaped yet (its parent is dead): ended either way
                if stat.read_text().rsplit(")", 1)[1].split()[0] == "Z":
                    return
            except (FileNotFoundError, ProcessLookupError):
                return
            time.sleep(0.2)
        os.kill(part, signal.SIGKILL)
        raise AssertionError(f"the part (pid {part}) outlived its killed run by 20 s")
    finally:
        if run.poll() is None:
            run.kill()
