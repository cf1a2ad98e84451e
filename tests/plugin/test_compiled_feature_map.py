"""``qkmap_compile_feature_map``: the feature map as ``torch.compile``-fused expressions, checked against the written-out
formula and the eager map, and its fall-back to the eager map where compiling fails."""

from __future__ import annotations

import warnings

import pytest
import torch

from qkmap_hf import QKMapConfig, QKMapForCausalLM, qkmap_features
from qkmap_hf.modeling import feature_map_qkmap
from qkmap_hf.modeling.feature_map_qkmap import (
    CompiledExpression,
    qkmap_projected_query_key_features,
    qkmap_query_key_features,
)
from tests.compiled import COMPILED
from tests.plugin.test_feature_map import assert_equals_the_written_out_formula, projection_inputs, random_inputs
from tests.utils import tiny_config_kwargs


@pytest.mark.slow  # each case compiles a forward and a backward graph (seconds each on 2 cores)
@pytest.mark.parametrize(
    "heads,kv_heads,num_freq,freq_width,rotate_cos_blocks",
    [
        pytest.param(4, 2, 2, 6, True, id="gqa-F2-rotated"),
        pytest.param(6, 2, 3, 1, False, id="gqa-F3-per-block-unrotated"),
    ],
)
def test_compiled_map_equals_the_written_out_formula_and_its_gradients_in_float64(
    compiled_calls, heads, kv_heads, num_freq, freq_width, rotate_cos_blocks
):
    inputs = random_inputs(heads, kv_heads, num_freq, freq_width)
    features = qkmap_features(*inputs, rotate_cos_blocks=rotate_cos_blocks, compiled=True)
    assert_equals_the_written_out_formula(features, inputs, rotate_cos_blocks)
    assert compiled_calls == ["_expression_features", "_expression_gradients"]


@pytest.mark.slow
def test_compiled_query_key_and_projected_nodes_equal_the_eager_ones_in_float64(compiled_calls):
    """Both nodes the model trains with, queries and keys in one compiled region each way: the eager nodes' values and
    every gradient (layer input, weights, biases, omega, gains) up to float rounding."""
    inputs = projection_inputs(4, 2, 2, 4, bias=True)
    wanted = [t for t in inputs if t is not None and t.requires_grad]
    results = {}
    for compiled in (False, True):
        features = qkmap_projected_query_key_features(*inputs, compiled=compiled)
        hidden, query_weight, query_bias, key_weight, key_bias, *shared = inputs
        query = torch.nn.functional.linear(hidden, query_weight, query_bias).view(2, 3, 4, 4).transpose(1, 2)
        key = torch.nn.functional.linear(hidden, key_weight, key_bias).view(2, 3, 2, 4).transpose(1, 2)
        plain = qkmap_query_key_features(query, key, *shared, compiled=compiled)
        loss = sum((f * (i + 1)).square().sum() for i, f in enumerate((*features, *plain)))
        results[compiled] = (*features, *plain, *torch.autograd.grad(loss, wanted))
    for eager, fused in zip(results[False], results[True], strict=True):
        assert (eager - fused).abs().max().item() < 1e-10 * (1 + eager.abs().max().item())
    assert compiled_calls == ["_expression_query_key_features"] * 2 + ["_expression_query_key_gradients"] * 2


@pytest.mark.slow
def test_a_model_with_the_compiled_map_trains_and_decodes_like_the_eager_one(compiled_calls):
    """float32 training step of the wide layout (its default recomputing node; the compact layout's node is the
    query/key one, checked above) and greedy decoding: the loss and every gradient of the eager map up to float
    rounding; decoding's one-token steps keep the eager path. The fused CPU kernel is off in both: on a CPU it comes
    before the compiled map."""
    config = QKMapConfig(qk_mode="qk_map", qkmap_fused_feature_map=False, **tiny_config_kwargs())
    eager = QKMapForCausalLM(config).eval()
    compiled_config = QKMapConfig(
        qk_mode="qk_map", qkmap_compile_feature_map=True, qkmap_fused_feature_map=False, **tiny_config_kwargs()
    )
    compiled = QKMapForCausalLM(compiled_config).eval()
    compiled.load_state_dict(eager.state_dict())
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    losses = []
    for model in (eager, compiled):
        loss = model(ids, labels=ids).loss
        loss.backward()
        losses.append(loss.item())
    assert losses[1] == pytest.approx(losses[0], rel=1e-6)
    for (name, a), b in zip(eager.named_parameters(), compiled.parameters(), strict=True):
        assert (a.grad - b.grad).abs().max().item() <= 1e-5 * (1 + a.grad.abs().max().item()), name
    assert "_expression_query_key_gradients" in compiled_calls
    compiled_calls.clear()
    with torch.no_grad():
        generated = [model.generate(ids[:1, :8], max_new_tokens=6, do_sample=False) for model in (eager, compiled)]
    assert torch.equal(generated[0], generated[1])
    # the 8-token prefill, once per layer; the 5 one-token steps stay eager
    assert compiled_calls == ["_expression_query_key_features"] * config.num_hidden_layers


def test_a_failed_compile_warns_once_and_the_eager_map_runs_from_then_on(monkeypatch):
    """No C++ compiler, an unsupported backend: the first call warns, naming the error; that call and every later one
    gives the eager map's values bit for bit, without compiling again."""
    attempts = []

    def failing_compile(function, **kwargs):
        def run(*args):
            attempts.append(function.__name__)
            raise RuntimeError("InductorError: no working C++ compiler found\ndetails")

        return run

    monkeypatch.setattr(torch, "compile", failing_compile)
    for name in COMPILED:
        monkeypatch.setattr(feature_map_qkmap, name, CompiledExpression(getattr(feature_map_qkmap, name).expression))
    inputs = random_inputs(4, 2, 2, 6)
    eager = qkmap_features(*inputs)
    eager_grads = torch.autograd.grad(eager.sum(), inputs[:3])
    with pytest.warns(RuntimeWarning, match=r"_expression_features failed \(RuntimeError: InductorError: no working"):
        first = qkmap_features(*inputs, compiled=True)
    assert feature_map_qkmap.COMPILED_FEATURES.failure == "RuntimeError: InductorError: no working C++ compiler found"
    assert torch.equal(first, eager)
    with pytest.warns(RuntimeWarning, match="_expression_gradients failed"):
        grads = torch.autograd.grad(first.sum(), inputs[:3])
    assert all(torch.equal(a, b) for a, b in zip(grads, eager_grads, strict=True))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second warning (or compile) would fail here
        again = qkmap_features(*inputs, compiled=True)
    assert torch.equal(again, eager)
    assert attempts == ["_expression_features", "_expression_gradients"]


def test_the_field_defaults_off_round_trips_and_rejects_non_booleans(tmp_path):
    assert QKMapConfig(**tiny_config_kwargs()).qkmap_compile_feature_map is False
    QKMapConfig(qkmap_compile_feature_map=True, **tiny_config_kwargs()).save_pretrained(tmp_path)
    assert QKMapConfig.from_pretrained(tmp_path).qkmap_compile_feature_map is True
    with pytest.raises(ValueError, match="qkmap_compile_feature_map"):
        QKMapConfig(qkmap_compile_feature_map="yes", **tiny_config_kwargs())


def test_the_benchmark_variants_compile_the_map_of_each_layout_and_answer_to_its_targets():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from attention_overhead import VARIANTS, variant_fields
    from shape_grid import TARGETS, shape_size

    size = shape_size(128, 2, 1, 2)
    for layout in ("qk_map_wide", "qk_map_wide_recompute", "qk_map_compact"):
        fields = variant_fields(f"{layout}_compiled", size)
        assert fields == {**variant_fields(layout, size), "qkmap_compile_feature_map": True}
        assert TARGETS[(f"{layout}_compiled", "train_tokens_per_s")] == TARGETS[(layout, "train_tokens_per_s")]
    assert variant_fields("qk_map_compact_compiled", size)["qkmap_input_dim"] == 64
    assert "standard_compiled" not in VARIANTS
