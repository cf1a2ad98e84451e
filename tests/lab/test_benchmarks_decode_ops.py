"""benchmarks/decode_op_count.py: the ops one decoded token dispatches (issue 23, docs/performance.md)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from decode_op_count import decode_ops, rows_recomputed, training_ops  # noqa: E402


def test_decode_op_count_sees_the_kept_rows_skip_omega_and_the_gains():
    """benchmarks/decode_op_count.py: a decoded token with the kept rows dispatches no ``exp`` (omega) and fewer
    ``cat``s than with the rows recomputed, and standard attention none of the feature map's trig."""
    compact = {"qk_mode": "qk_map", "qkmap_input_dim": 8}
    kept = decode_ops(16, 4, 2, **compact)
    with rows_recomputed():
        fresh = decode_ops(16, 4, 2, **compact)
    assert kept["exp"] == 0 and fresh["exp"] == 2  # one omega per layer, 2 layers
    # GQA: repeat_interleave of omega and the query gains (expand + clone) once, not per token; two cats fewer per layer
    assert (fresh["clone"], kept["clone"]) == (4, 0) and fresh["cat"] - kept["cat"] == 4
    assert sum(fresh.values()) > sum(kept.values())
    assert decode_ops(16, 4, 2, qk_mode="standard")["sin"] == 1  # the rotary table only


def test_compact_decode_dispatches_no_more_ops_than_standard_attention():
    """docs/performance.md, "Decode again": one decoded token of the compact layout (GQA 4:2) dispatches no more aten
    ops than standard attention's (its map replaces RoPE at about RoPE's op count); the wide layout's extra ops are
    its own attention call (bmm, softmax) and a bounded few, not a per-head or per-block count."""
    standard = sum(decode_ops(16, 4, 2, qk_mode="standard").values())
    compact = sum(decode_ops(16, 4, 2, qk_mode="qk_map", qkmap_input_dim=8).values())
    wide = sum(decode_ops(16, 4, 2, qk_mode="qk_map").values())
    assert compact <= standard
    assert wide - standard <= 10 * 2  # at most 10 more per layer (2 layers)


def test_a_training_steps_extra_ops_are_a_cost_per_layer_that_does_not_grow_with_the_sequence():
    """docs/performance.md, "Is it the kernel?": the eager feature map adds a fixed number of dispatched ops per layer
    to a training step, the same at 8 and 32 tokens and the same for every layer added; the trig runs once forward
    and once recomputed in the backward pass for queries and keys (``cos`` and ``sin_`` 4 times per layer each)."""
    compact = {"qk_mode": "qk_map", "qkmap_input_dim": 8, "qkmap_fused_feature_map": False}
    extra = {}
    for layers, seq_len in ((1, 8), (1, 32), (2, 8), (3, 8)):
        standard = training_ops(16, 4, 2, layers, seq_len, qk_mode="standard")
        mapped = training_ops(16, 4, 2, layers, seq_len, **compact)
        extra[(layers, seq_len)] = sum(mapped.values()) - sum(standard.values())
        assert (mapped["sin_"], mapped["cos"] - standard["cos"]) == (4 * layers, 4 * layers)
    assert extra[(1, 8)] == extra[(1, 32)]
    per_layer = extra[(2, 8)] - extra[(1, 8)]
    assert per_layer > 0 and extra[(3, 8)] - extra[(2, 8)] == per_layer


def test_the_fused_map_is_two_ops_each_way_per_layer_and_no_trig(fused_kernel):
    """With the fused CPU kernel (the default), a training step's map is one ``features`` call for queries and one
    for keys forward and one ``feature_gradients`` each backward per layer, no ``sin``/``cos`` beyond the rotary
    table's: the compact layout then dispatches fewer ops than standard attention."""
    for layers in (1, 2):
        standard = training_ops(16, 4, 2, layers, 8, qk_mode="standard")
        fused = training_ops(16, 4, 2, layers, 8, qk_mode="qk_map", qkmap_input_dim=8)
        assert (fused["features"], fused["feature_gradients"]) == (2 * layers, 2 * layers)
        assert (fused["sin"], fused["cos"], fused["sin_"]) == (standard["sin"], standard["cos"], 0)
        assert sum(fused.values()) < sum(standard.values())
