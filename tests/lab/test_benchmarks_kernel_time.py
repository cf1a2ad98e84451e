"""benchmarks/kernel_time.py: the attention kernel's calls of a training step, recorded and replayed alone, and the
training floor built from their measured time (shape_grid.py --kernel-time)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import shape_grid  # noqa: E402
from attention_overhead import build  # noqa: E402
from kernel_time import KernelReplay, record_training_calls  # noqa: E402


class KernelOps(TorchDispatchMode):
    """The aten attention-kernel ops that run (forward and backward), with the shapes of their tensor inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, tuple]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "scaled_dot_product" in func.name() or "causal_attention" in func.name():
            shapes = tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor))
            self.ops.append((func.name(), shapes))
        return func(*args, **(kwargs or {}))


@pytest.mark.usefixtures("one_thread", "fused_kernel")
@pytest.mark.parametrize("variant", ["standard", "qk_map_compact", "qk_map_wide", "qk_map_wide_kernels"])
def test_the_replay_runs_the_kernel_ops_of_a_training_step_with_their_shapes(variant) -> None:
    """d16, 4 query heads on 2 key/value heads, 2 layers, T = 8: the replay dispatches the same kernel ops, forward
    and backward, on the same shapes as the model's own step (the wide layout's values padded to the key width by
    sdpa, at their own width by the fused attention, ``qk_map_wide_kernels``)."""
    size, T = shape_grid.shape_size(16, 4, 2, 2), 8
    model = build(variant, "cpu", torch.float32, "sdpa", size)
    ids = torch.randint(0, size["vocab_size"], (1, T))
    calls = record_training_calls(model, ids)
    assert len(calls) == 2  # one per layer
    config = model.config
    width = config.query_key_dim if variant != "standard" else config.head_dim
    assert calls[0].query.size == (1, 4, T, width) and calls[0].key.size == (1, 2, T, width)
    assert calls[0].value.size[-1] == shape_grid.value_width(config, "sdpa", T)
    assert calls[0].value.size[-1] == (config.head_dim if variant != "qk_map_wide" else config.query_key_dim)
    assert {call.kernel for call in calls} == {"fused" if variant.endswith("_kernels") else "sdpa"}
    assert all(p.grad is None for p in model.parameters())  # the recording step leaves no gradients behind
    with KernelOps() as in_step:
        model(ids, labels=ids).loss.backward()
    with KernelOps() as in_replay:
        KernelReplay(calls)()
    assert in_step.ops and sorted(in_replay.ops) == sorted(in_step.ops)
    assert any("backward" in name for name, _ in in_replay.ops)
    assert any("causal_attention" in name for name, _ in in_replay.ops) == variant.endswith("_kernels")


def test_eager_attention_records_no_kernel_call() -> None:
    size = shape_grid.shape_size(16, 4, 2, 1)
    model = build("qk_map_wide", "cpu", torch.float32, "eager", size)
    ids = torch.randint(0, size["vocab_size"], (1, 8))
    assert record_training_calls(model, ids) == []


def raw_rows(variant: str, standard_step_ms: float, standard_kernel_ms: float, variant_kernel_ms: float) -> list[dict]:
    """One repeat's raw rows at T = 1000: standard's training step (as tokens/s) and both kernels' times."""
    return [
        dict(
            variant="standard",
            seq_len=1000,
            metric="train_tokens_per_s",
            value=1000 / (standard_step_ms / 1e3),
            repeat=0,
        ),
        dict(variant="standard", seq_len=1000, metric="attention_kernel_ms", value=standard_kernel_ms, repeat=0),
        dict(variant=variant, seq_len=1000, metric="attention_kernel_ms", value=variant_kernel_ms, repeat=0),
    ]


def test_the_kernel_floor_swaps_standards_kernel_time_for_the_variants() -> None:
    """Standard's step 100 ms with a 20 ms kernel; the wide layout's kernel takes 35 ms and its other matmuls are
    standard's: 115 ms, a floor of 1.15. The recomputing layout runs more of the other matmuls: its floor also
    scales standard's 80 ms outside the kernel by their FLOP ratio."""
    size = shape_grid.shape_size(64, 8, 1, 2)
    wide = shape_grid.kernel_floor_ratio(size, "qk_map_wide", 1000, raw_rows("qk_map_wide", 100, 20, 35))
    assert wide == pytest.approx(1.15, rel=1e-12)
    kernel_standard, other_standard = shape_grid.matmul_flop_parts(
        shape_grid.variant_config("standard", size), 1000, "train"
    )
    kernel_recompute, other_recompute = shape_grid.matmul_flop_parts(
        shape_grid.variant_config("qk_map_wide_recompute", size), 1000, "train"
    )
    assert other_recompute > other_standard and kernel_recompute == 2 * kernel_standard  # keys 2x, values padded
    recompute = shape_grid.kernel_floor_ratio(
        size, "qk_map_wide_recompute", 1000, raw_rows("qk_map_wide_recompute", 100, 20, 35)
    )
    assert recompute == pytest.approx((80 * other_recompute / other_standard + 35) / 100, rel=1e-12)
    # and the kernel column's own floor is the kernel FLOP ratio
    assert shape_grid.floor_ratio(size, "qk_map_wide", "attention_kernel_ms", 1000) == pytest.approx(2.0)
    # without the kernel's rows (a run without --kernel-time) there is no such floor
    assert shape_grid.kernel_floor_ratio(size, "qk_map_wide", 1000, raw_rows("qk_map_wide", 100, 20, 35)[:1]) is None
