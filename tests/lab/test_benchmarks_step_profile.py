"""benchmarks/step_profile.py: one shape's training step per variant, with page faults and an averaged profile."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import step_profile  # noqa: E402


def test_step_profile_times_every_variant_against_the_first_and_diffs_their_ops(fused_kernel, one_thread):
    shape = ["--head-dim", "16", "--heads", "4", "--kv-ratio", "2", "--layers", "1", "--seq-len", "16"]
    flags = ["--repeats", "2", "--forward-first", "--saved-bytes-first", "--profile", "--profile-rows", "5"]
    args = step_profile.parser().parse_args([*shape, *flags])
    results = step_profile.measure(args)
    assert list(results) == list(step_profile.DEFAULT_VARIANTS)
    for result in results.values():
        assert len(result["seconds"]) == len(result["faults"]) == 2 and min(result["seconds"]) > 0
    # the fused map's ops run in the QK-MAP layouts' steps and never in standard's; the fused attention in the wide's
    assert "qkmap_v1::features" not in results["standard"]["ops"]
    assert results["qk_map_wide_recompute_kernels"]["ops"]["qkmap_v1::feature_gradients"] > 0
    assert results["qk_map_wide_recompute_kernels"]["ops"]["qkmap_v1::causal_attention_backward"] > 0
    assert "qkmap_v1::causal_attention" not in results["qk_map_compact_kernels"]["ops"]

    lines = step_profile.report(args, results).splitlines()
    assert lines[0].startswith("d16 h4/kv2 L1 T=16") and "saved_bytes_first=True" in lines[0]
    assert [line.split(" | ")[0].strip("| ") for line in lines[3:6]] == list(step_profile.DEFAULT_VARIANTS)
    assert "| 1.000x [1.000-1.000] |" in lines[3]  # the first variant against itself
    assert len([line for line in lines[6:] if line.startswith("| `")]) == 5
