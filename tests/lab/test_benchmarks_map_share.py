"""benchmarks/map_share.py: the training step with the feature map replaced (the layout's kernel, padding and
projections alone), the map's own sin/cos work, and the paired summary of the two."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import map_share  # noqa: E402
import shape_grid  # noqa: E402
from attention_overhead import build  # noqa: E402

SIZE = shape_grid.shape_size(16, 4, 2, 2)  # 4 query heads on 2 key/value heads, 2 layers
T = 8


class TrigOps(TorchDispatchMode):
    """Input element counts of every aten ``cos``/``sin`` op that runs (out=, in place or plain)."""

    def __init__(self) -> None:
        super().__init__()
        self.numels: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.name().split("::")[-1].split(".")[0].rstrip("_") in ("cos", "sin"):
            self.numels.append(args[0].numel())
        return func(*args, **(kwargs or {}))


def step_loss(model, ids) -> tuple[float, torch.Tensor | None]:
    """Loss of one training step and the first layer's ``q_proj`` weight gradient."""
    loss = model(ids, labels=ids).loss
    loss.backward()
    grad = model.model.layers[0].self_attn.q_proj.weight.grad
    model.zero_grad(set_to_none=True)
    return loss.item(), grad


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("variant", ["qk_map_wide", "qk_map_compact", "qk_map_wide_recompute"])
def test_the_replaced_map_keeps_the_layout_width_and_gradients_and_is_undone_after(variant) -> None:
    """Inside ``map_replaced`` every layer's queries and keys are ``z`` repeated to the map's width 2Fm (the kernel
    sees the layout's width), the loss differs from the map's, ``q_proj`` still gets a gradient; after it, the
    real map is back (the same loss as before, bit for bit)."""
    model = build(variant, "cpu", torch.float32, "sdpa", SIZE)
    ids = torch.randint(0, SIZE["vocab_size"], (1, T), generator=torch.Generator().manual_seed(0))
    real_loss, _ = step_loss(model, ids)
    attention = model.model.layers[0].self_attn
    with map_share.map_replaced(model) as replaced:
        query = torch.randn(1, SIZE["num_attention_heads"], T, model.config.resolved_qkmap_input_dim)
        key = torch.randn(1, SIZE["num_key_value_heads"], T, model.config.resolved_qkmap_input_dim)
        features = attention.qk_map(query, key, None, None)
        widths = [f.shape[-1] for f in features]
        assert torch.equal(features[0][..., : query.shape[-1]], query)
        replaced_loss, grad = step_loss(model, ids)
    assert replaced == SIZE["num_hidden_layers"]
    assert widths == [model.config.query_key_dim] * 2
    assert replaced_loss != real_loss
    assert grad is not None and grad.abs().sum() > 0
    assert step_loss(model, ids)[0] == real_loss
    assert "forward" not in vars(attention.qk_map) and "project" not in vars(attention.qk_map)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("variant", ["qk_map_wide", "qk_map_compact"])
def test_the_trig_arm_makes_the_cos_and_sin_calls_of_a_real_training_step(variant) -> None:
    """``TrigWork`` dispatches exactly the cos and sin ops a training step of the layout runs on its phases (same
    count, same sizes), leaving out only the RoPE tables' (T x m elements)."""
    model = build(variant, "cpu", torch.float32, "sdpa", SIZE)
    ids = torch.randint(0, SIZE["vocab_size"], (1, T))
    with TrigOps() as real:
        step_loss(model, ids)
    table_numel = T * model.config.resolved_qkmap_input_dim
    phases = Counter(n for n in real.numels if n > table_numel)
    work = map_share.TrigWork(model.config, 1, T)
    with TrigOps() as replayed:
        work()
    assert Counter(replayed.numels) == phases
    assert sum(phases.values()) == 2 * 2 * 2 * SIZE["num_hidden_layers"]  # cos+sin, q+k, forward+recomputed


def test_the_summary_pairs_each_repeat_with_standard() -> None:
    """Ratios are per repeat against that repeat's standard step; the map's cost is the mean paired difference of
    the layout's and the no-map ratios, with a t interval that contains it."""
    standard = [0.10, 0.20, 0.10]
    layout, no_map, trig = [0.13, 0.28, 0.12], [0.11, 0.22, 0.105], [0.01, 0.02, 0.01]
    raw = []
    for arm, times in (("standard", standard), ("qk_map_wide", layout), ("qk_map_wide, no map", no_map),
                       ("qk_map_wide, sin/cos", trig)):  # fmt: skip
        raw += [{"arm": arm, "repeat": i, "seconds": t} for i, t in reversed(list(enumerate(times)))]
    (row,) = map_share.summarize(SIZE, T, ["qk_map_wide"], raw)
    step = [a / s for a, s in zip(layout, standard, strict=True)]
    bare = [a / s for a, s in zip(no_map, standard, strict=True)]
    assert row["step_ratio"] == pytest.approx(sorted(step)[1])
    assert (row["step_min"], row["step_max"]) == pytest.approx((min(step), max(step)))
    assert row["map_cost"] == pytest.approx(sum(a - b for a, b in zip(step, bare, strict=True)) / 3)
    assert row["map_cost_low"] < row["map_cost"] < row["map_cost_high"]
    assert row["trig_share"] == pytest.approx(0.1)
    assert row["target"] == 1.22
    assert row["floor_ratio"] == shape_grid.floor_ratio(SIZE, "qk_map_wide", "train_tokens_per_s", T)
    assert f"| {row['map_cost']:+.3f} [{row['map_cost_low']:.3f}, {row['map_cost_high']:.3f}] |" in map_share.markdown(
        [row]
    )


@pytest.mark.parametrize("suffix", ["_compiled", "_fused"])
def test_a_compiled_or_fused_layout_is_paired_with_its_eager_one_and_reads_its_no_map_arms(suffix) -> None:
    """``qk_map_wide_compiled`` (or ``_fused``) next to ``qk_map_wide``: no no-map or sin/cos arms of its own (the same
    model without its map, the same trig), and what it saves is the mean paired ``(eager - it) / standard``."""
    standard = [0.10, 0.20, 0.10]
    eager, faster, no_map, trig = [0.13, 0.28, 0.12], [0.12, 0.24, 0.115], [0.11, 0.22, 0.105], [0.01, 0.02, 0.01]
    other = f"qk_map_wide{suffix}"
    raw = []
    for arm, times in (("standard", standard), ("qk_map_wide", eager), (other, faster),
                       ("qk_map_wide, no map", no_map), ("qk_map_wide, sin/cos", trig)):  # fmt: skip
        raw += [{"arm": arm, "repeat": i, "seconds": t} for i, t in enumerate(times)]
    variants = ["qk_map_wide", other]
    assert [map_share.map_arms_variant(v, variants) for v in variants] == ["qk_map_wide", "qk_map_wide"]
    assert map_share.map_arms_variant(other, [other]) == other
    eager_row, faster_row = map_share.summarize(SIZE, T, variants, raw)
    assert eager_row["eager_saving"] is None and eager_row["eager_variant"] is None
    assert faster_row["eager_variant"] == "qk_map_wide"
    assert faster_row["no_map_ratio"] == eager_row["no_map_ratio"]
    saving = [(a - b) / s for a, b, s in zip(eager, faster, standard, strict=True)]
    assert faster_row["eager_saving"] == pytest.approx(sum(saving) / 3)
    assert faster_row["eager_saving_low"] < faster_row["eager_saving"] < faster_row["eager_saving_high"]
    assert faster_row["target"] == 1.22
    table = map_share.markdown([eager_row, faster_row])
    assert table.splitlines()[2].endswith("| 1.22 |  |")
    assert table.splitlines()[3].endswith(
        f"| {faster_row['eager_saving']:+.3f} [{faster_row['eager_saving_low']:.3f}, "
        f"{faster_row['eager_saving_high']:.3f}] |"
    )


@pytest.mark.slow  # three small models timed in seven arms (~5 s)
@pytest.mark.usefixtures("one_thread")
def test_a_run_writes_its_table_csvs_and_plot_and_resumes_from_its_parts(tmp_path, capsys) -> None:
    argv = ["--head-dims", "16", "--heads", "2", "--kv-ratios", "1", "--layers", "1", "--seq-lens", "16",
            "--repeats", "2", "--threads", "1", "--in-process", "--output-dir", str(tmp_path)]  # fmt: skip
    assert map_share.main(argv) == 0
    first = capsys.readouterr()
    for name in ("map_share_summary.csv", "map_share_raw.csv", "map_share_table.md", "map_share.png"):
        assert (tmp_path / name).stat().st_size > 0
    rows = (tmp_path / "map_share_raw.csv").read_text().splitlines()
    assert len(rows) == 1 + 2 * 7  # header, 2 repeats x (standard + 3 arms for each of 2 layouts)
    assert first.out.count("| d16 h2/kv2 L1 T = 16 |") == 2
    assert map_share.main(argv) == 0
    second = capsys.readouterr()
    assert "done earlier" in second.err
    assert second.out.splitlines()[-2:] == first.out.splitlines()[-2:]
