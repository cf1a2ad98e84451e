"""The feature map's recomputing backward pass: autograd's gradients of the written-out formula, less memory."""

from __future__ import annotations

import pytest
import torch

from qkmap_hf import QKMapConfig, QKMapForCausalLM, qkmap_features
from qkmap_hf.modeling import feature_map_qkmap
from qkmap_hf.modeling.feature_map_qkmap import (
    QKMapFeatureFunction,
    QKMapProjectedQueryKeyFunction,
    QKMapQueryKeyFunction,
    qkmap_projected_query_key_features,
    qkmap_query_key_features,
)
from tests.utils import tiny_config_kwargs, written_out_features


def random_inputs(heads, kv_heads, num_freq, freq_width, m=6, seq=5, batch=2, tables_need_grad=False):
    generator = torch.Generator().manual_seed(heads * 100 + num_freq * 10 + freq_width)

    def rand(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    # z token-major like the model's projections (a transposed view), the others as the module passes them.
    z = rand(batch, seq, heads, m).transpose(1, 2).requires_grad_()
    frequency = (rand(kv_heads, num_freq, freq_width).abs() + 0.3).requires_grad_()
    gain = rand(kv_heads, 2 * num_freq, m).requires_grad_()
    cos, sin = rand(1, seq, m), rand(1, seq, m)
    return z, frequency, gain, cos.requires_grad_(tables_need_grad), sin.requires_grad_(tables_need_grad)


CASES = [  # heads, kv_heads, F, frequency width (m: per channel, 1: per block)
    pytest.param(2, 2, 1, 6, id="mha-F1"),
    pytest.param(4, 2, 2, 6, id="gqa-F2"),
    pytest.param(6, 2, 3, 1, id="gqa-F3-per-block"),
]


@pytest.mark.parametrize("rotate_cos_blocks", [True, False])
@pytest.mark.parametrize("heads,kv_heads,num_freq,freq_width", CASES)
def test_custom_backward_passes_gradcheck_in_float64(heads, kv_heads, num_freq, freq_width, rotate_cos_blocks):
    width = 4 if freq_width > 1 else 1
    inputs = random_inputs(heads, kv_heads, num_freq, width, m=4, seq=3, batch=1, tables_need_grad=heads == 4)
    assert torch.autograd.gradcheck(
        lambda *tensors: QKMapFeatureFunction.apply(*tensors, rotate_cos_blocks, False, False),
        inputs,
        eps=1e-6,
        atol=1e-8,
        fast_mode=True,
    )


@pytest.mark.parametrize("rotate_cos_blocks", [True, False])
@pytest.mark.parametrize("heads,kv_heads,num_freq,freq_width", CASES)
def test_custom_backward_equals_autograd_of_the_written_out_formula(
    heads, kv_heads, num_freq, freq_width, rotate_cos_blocks
):
    inputs = random_inputs(heads, kv_heads, num_freq, freq_width)
    features = qkmap_features(*inputs, rotate_cos_blocks=rotate_cos_blocks)
    assert features.grad_fn.name() == "QKMapFeatureFunctionBackward"
    assert_equals_the_written_out_formula(features, inputs, rotate_cos_blocks)


def assert_equals_the_written_out_formula(features, inputs, rotate_cos_blocks: bool) -> None:
    """``features`` of float64 ``inputs`` against the written-out formula: values to 1e-12, and the gradients for
    ``z``, omega and the gains of a random weighting to 1e-10 relative."""
    expected = written_out_features(*inputs, rotate_cos_blocks=rotate_cos_blocks)
    assert (features - expected).abs().max().item() < 1e-12
    weights = torch.randn(features.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    got = torch.autograd.grad((features * weights).sum(), inputs[:3])
    want = torch.autograd.grad((expected * weights).sum(), inputs[:3])
    for name, a, b in zip(("z", "frequency", "gain"), got, want, strict=True):
        assert a.shape == b.shape, name
        assert (a - b).abs().max().item() < 1e-10 * (1 + b.abs().max().item()), name


@pytest.mark.parametrize("rotate_cos_blocks", [True, False])
@pytest.mark.parametrize("heads,kv_heads,num_freq,freq_width", CASES)
def test_one_rotation_call_for_both_rows_gives_the_bits_of_a_call_per_row(
    monkeypatch, heads, kv_heads, num_freq, freq_width, rotate_cos_blocks
):
    inputs = random_inputs(heads, kv_heads, num_freq, freq_width, tables_need_grad=True)
    weights = torch.randn(
        (2, heads, 5, 2 * num_freq * 6), generator=torch.Generator().manual_seed(5), dtype=torch.float64
    )
    results = {}
    for merged_up_to in (10**9, 0):  # every row merged, then every row on its own
        monkeypatch.setattr(feature_map_qkmap, "MERGED_ROTATION_MAX_ROW_NUMEL", merged_up_to)
        features = qkmap_features(*inputs, rotate_cos_blocks=rotate_cos_blocks)
        results[merged_up_to] = (features, *torch.autograd.grad((features * weights).sum(), inputs))
    for name, merged, per_row in zip(
        ("features", "z", "frequency", "gain", "cos", "sin"), *results.values(), strict=True
    ):
        assert torch.equal(merged, per_row), name


@pytest.mark.parametrize("extra_positions,calls_expected", [(0, 1), (1, 2)])
def test_rows_are_rotated_in_one_call_up_to_the_threshold_and_a_call_per_row_above(
    monkeypatch, extra_positions, calls_expected
):
    heads, m = 2, 8
    seq = feature_map_qkmap.MERGED_ROTATION_MAX_ROW_NUMEL // (heads * m) + extra_positions  # a row: heads x seq x m
    rotated_shapes = []
    rotate = feature_map_qkmap._rotate_into

    def counting_rotate(out, *args):
        rotated_shapes.append(tuple(out.shape))
        rotate(out, *args)

    monkeypatch.setattr(feature_map_qkmap, "_rotate_into", counting_rotate)
    z, frequency, gain, cos, sin = (t.detach() for t in random_inputs(heads, heads, 1, m, m=m, seq=seq, batch=1))
    qkmap_features(z, frequency, gain, cos, sin)
    row = (1, seq, heads, 1, 1, m)  # (batch, seq, kv_heads, groups, F, m)
    assert rotated_shapes == ([(2, *row)] if calls_expected == 1 else [row, row])


@pytest.mark.parametrize("parametrization", ["absolute", "inverse_frequency"])
def test_module_gradients_equal_the_formula_with_inverse_frequency_gains(parametrization):
    """Through QKMapFeatureMap (log-frequencies, gains / omega), float32 against the float64 formula."""
    config = QKMapConfig(
        qk_mode="qk_map", qkmap_num_frequencies=2, qkmap_gain_parametrization=parametrization, **tiny_config_kwargs()
    )
    model = QKMapForCausalLM(config)
    feature_map = model.model.layers[0].self_attn.qk_map
    with torch.no_grad():
        feature_map.query_gain.mul_(1 + 0.5 * torch.randn_like(feature_map.query_gain))
        feature_map.key_gain.mul_(1 + 0.5 * torch.randn_like(feature_map.key_gain))
        feature_map.log_frequency.add_(0.3 * torch.randn_like(feature_map.log_frequency))
    cos, sin = model.model.rotary_emb(torch.empty(0), torch.arange(3, 10).unsqueeze(0))
    m = config.resolved_qkmap_input_dim
    q = torch.randn(2, 7, config.num_attention_heads, m).transpose(1, 2).requires_grad_()
    k = torch.randn(2, 7, config.num_key_value_heads, m).transpose(1, 2).requires_grad_()
    params = [feature_map.log_frequency, feature_map.query_gain, feature_map.key_gain]

    fused_q, fused_k = feature_map(q, k, cos, sin)
    loss = fused_q.square().sum() + (fused_k * fused_k.roll(1, dims=-1)).sum()
    got = torch.autograd.grad(loss, [q, k, *params])

    omega = params[0].double().exp()
    q_gain, k_gain = params[1].double(), params[2].double()
    if parametrization == "inverse_frequency":  # stored gain / omega, the omega of the gain's block
        q_gain, k_gain = q_gain / omega.repeat_interleave(2, dim=1), k_gain / omega.repeat_interleave(2, dim=1)
    tables = cos.double(), sin.double()
    expected_q = written_out_features(q.double(), omega, q_gain, *tables)
    expected_k = written_out_features(k.double(), omega, k_gain, *tables)
    assert (fused_q.double() - expected_q).abs().max().item() < 1e-4
    loss = expected_q.square().sum() + (expected_k * expected_k.roll(1, dims=-1)).sum()
    want = torch.autograd.grad(loss, [q, k, *params])
    for name, a, b in zip(("q", "k", "log_frequency", "query_gain", "key_gain"), got, want, strict=True):
        assert (a.double() - b).abs().max().item() < 1e-4 * (1 + b.abs().max().item()), name


def test_backward_keeps_only_z_and_the_small_tensors():
    """What autograd saves for the map: z (float32), omega, gains, RoPE tables; no phases, cos, sin or features."""
    z, frequency, gain, cos, sin = random_inputs(8, 8, 1, 64, m=64, seq=128, batch=1)
    z, frequency, gain = (t.detach().float().requires_grad_() for t in (z, frequency, gain))
    cos, sin = cos.float(), sin.float()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        qkmap_features(z, frequency, gain, cos, sin)
    nbytes = sum(t.numel() * t.element_size() for t in saved)
    inputs_bytes = sum(t.numel() * t.element_size() for t in (z, frequency, gain, cos, sin))
    assert nbytes == inputs_bytes
    assert any(t.data_ptr() == z.data_ptr() for t in saved)  # z itself, not a copy


def query_key_inputs(heads, kv_heads, num_freq, freq_width, m=4, tables_need_grad=False):
    """Queries and keys of one layer: ``random_inputs`` for each, sharing omega and the tables."""
    query, frequency, query_gain, cos, sin = random_inputs(heads, kv_heads, num_freq, freq_width, m=m, seq=3, batch=1,
                                                           tables_need_grad=tables_need_grad)  # fmt: skip
    key, _, key_gain, _, _ = random_inputs(kv_heads, kv_heads, num_freq + 1, freq_width, m=m, seq=3, batch=1)
    key_gain = key_gain[:, : 2 * num_freq].detach().requires_grad_()
    return query, key, frequency, query_gain, key_gain, cos, sin


@pytest.mark.parametrize("rotate_cos_blocks", [True, False])
@pytest.mark.parametrize("heads,kv_heads,num_freq,freq_width", CASES)
def test_query_key_node_passes_gradcheck_and_equals_two_single_nodes(
    heads, kv_heads, num_freq, freq_width, rotate_cos_blocks
):
    """The one-node map of queries and keys: float64 gradcheck, and the gradients of two separate nodes."""
    inputs = query_key_inputs(heads, kv_heads, num_freq, 4 if freq_width > 1 else 1, tables_need_grad=heads == 4)
    assert torch.autograd.gradcheck(
        lambda *tensors: QKMapQueryKeyFunction.apply(*tensors, rotate_cos_blocks, False, False),
        inputs,
        eps=1e-6,
        atol=1e-8,
        fast_mode=True,
    )
    query, key, frequency, query_gain, key_gain, cos, sin = inputs
    pair = qkmap_query_key_features(*inputs, rotate_cos_blocks=rotate_cos_blocks)
    assert pair[0].grad_fn.name() == "QKMapQueryKeyFunctionBackward"
    single = (
        written_out_features(query, frequency, query_gain, cos, sin, rotate_cos_blocks=rotate_cos_blocks),
        written_out_features(key, frequency, key_gain, cos, sin, rotate_cos_blocks=rotate_cos_blocks),
    )
    weights = [torch.randn(f.shape, generator=torch.Generator().manual_seed(i), dtype=torch.float64)
               for i, f in enumerate(single)]  # fmt: skip
    wanted = [t for t in inputs if t.requires_grad]
    got = torch.autograd.grad(sum((f * w).sum() for f, w in zip(pair, weights, strict=True)), wanted)
    want = torch.autograd.grad(sum((f * w).sum() for f, w in zip(single, weights, strict=True)), wanted)
    for a, b in zip(got, want, strict=True):
        assert (a - b).abs().max().item() < 1e-10 * (1 + b.abs().max().item())


def test_query_key_node_saves_the_shared_tensors_once():
    """One node for queries and keys: z of each, gains of each, omega and the RoPE tables once."""
    query, frequency, query_gain, cos, sin = random_inputs(8, 4, 1, 64, m=64, seq=128, batch=1)
    key, _, key_gain, _, _ = random_inputs(4, 4, 1, 64, m=64, seq=128, batch=1)
    query, key, frequency, query_gain, key_gain = (
        t.detach().float().requires_grad_() for t in (query, key, frequency, query_gain, key_gain)
    )
    inputs = (query, key, frequency, query_gain, key_gain, cos.float(), sin.float())
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        qkmap_query_key_features(*inputs)
    assert sum(t.numel() * t.element_size() for t in saved) == sum(t.numel() * t.element_size() for t in inputs)
    assert len(saved) == len(inputs)


@pytest.mark.parametrize("rotate_cos_blocks", [True, False])
@pytest.mark.parametrize("heads,kv_heads,num_freq,freq_width", CASES)
def test_one_token_without_gradients_maps_queries_and_keys_in_one_call_bit_for_bit(
    heads, kv_heads, num_freq, freq_width, rotate_cos_blocks
):
    """Decoding stacks queries and keys into one call: the same bits as mapping each with qkmap_features."""
    _, _, frequency, query_gain, key_gain, cos, sin = (
        t.detach() for t in query_key_inputs(heads, kv_heads, num_freq, freq_width, m=6)
    )
    generator = torch.Generator().manual_seed(7)
    query = torch.randn(2, 1, heads, 6, generator=generator, dtype=torch.float64).transpose(1, 2)
    key = torch.randn(2, 1, kv_heads, 6, generator=generator, dtype=torch.float64).transpose(1, 2)
    tables = cos[:, -1:], sin[:, -1:]  # the last position
    with torch.no_grad():
        got = qkmap_query_key_features(query, key, frequency, query_gain, key_gain, *tables, rotate_cos_blocks)
    assert torch.equal(got[0], qkmap_features(query, frequency, query_gain, *tables, rotate_cos_blocks))
    assert torch.equal(got[1], qkmap_features(key, frequency, key_gain, *tables, rotate_cos_blocks))
    assert (got[0] - written_out_features(query, frequency, query_gain, *tables, rotate_cos_blocks)).abs().max() < 1e-12


def test_no_graph_and_the_same_values_without_gradients():
    inputs = random_inputs(4, 2, 2, 6)
    with_graph = qkmap_features(*inputs)
    with torch.no_grad():
        without = qkmap_features(*inputs)
    assert without.grad_fn is None and torch.equal(with_graph.detach(), without)


@pytest.mark.slow
def test_compiled_backward_matches_eager():
    torch._dynamo.reset()
    z = torch.randn(2, 8, 4, 16).transpose(1, 2).requires_grad_()
    frequency, gain = (torch.rand(2, 2, 16) + 0.1).requires_grad_(), torch.rand(2, 4, 16).requires_grad_()
    cos, sin = torch.rand(1, 8, 16), torch.rand(1, 8, 16)
    compiled = torch.compile(qkmap_features, fullgraph=True)
    got = torch.autograd.grad(compiled(z, frequency, gain, cos, sin).square().sum(), (z, frequency, gain))
    want = torch.autograd.grad(qkmap_features(z, frequency, gain, cos, sin).square().sum(), (z, frequency, gain))
    for a, b in zip(got, want, strict=True):
        assert (a - b).abs().max().item() < 1e-5 * (1 + b.abs().max().item())


def decoding_feature_map(num_freq=1, groups=2):
    """A feature map of a GQA layer with non-trivial omega and gains, and one token's queries, keys and tables."""
    config = QKMapConfig(
        **tiny_config_kwargs(num_attention_heads=2 * groups, num_key_value_heads=2), qkmap_num_frequencies=num_freq
    )
    feature_map = QKMapForCausalLM(config).model.layers[0].self_attn.qk_map
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for parameter in feature_map.parameters():
            parameter.add_(0.3 * torch.randn(parameter.shape, generator=generator))
    m = config.resolved_qkmap_input_dim
    query = torch.randn(1, 1, 2 * groups, m, generator=generator).transpose(1, 2)
    key = torch.randn(1, 1, 2, m, generator=generator).transpose(1, 2)
    cos, sin = torch.randn(1, 1, m, generator=generator), torch.randn(1, 1, m, generator=generator)
    return feature_map, (query, key, cos, sin)


def uncached_features(feature_map, query, key, cos, sin):
    frequency = feature_map.frequency()
    gains = (feature_map.effective_gain(g, frequency) for g in (feature_map.query_gain, feature_map.key_gain))
    rotate = feature_map.config.qkmap_rotate_cos_blocks
    return qkmap_query_key_features(query, key, frequency, *gains, cos, sin, rotate)


@pytest.mark.parametrize("num_freq,groups", [(1, 2), (2, 1)])
def test_decoding_keeps_the_parameter_rows_between_tokens_and_refreshes_them_on_every_update(num_freq, groups):
    """One-token calls without gradients reuse omega and the gains' stacked rows: the same bits as computing
    them, and new values after an in-place update, a load_state_dict or a dtype change."""
    feature_map, inputs = decoding_feature_map(num_freq, groups)
    with torch.no_grad():
        first = feature_map(*inputs)
        kept = feature_map._decoding_parameters[1]
        assert all(torch.equal(a, b) for a, b in zip(first, uncached_features(feature_map, *inputs), strict=True))
        again = feature_map(*inputs)
        assert feature_map._decoding_parameters[1] is kept  # reused, not recomputed
        assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))

        feature_map.key_gain.mul_(2.0)  # an optimizer step or a user's edit
        updated = feature_map(*inputs)
        assert torch.equal(updated[0], first[0]) and not torch.allclose(updated[1], first[1])
        assert all(torch.equal(a, b) for a, b in zip(updated, uncached_features(feature_map, *inputs), strict=True))

        state = {name: tensor * 0.5 for name, tensor in feature_map.state_dict().items()}
        feature_map.load_state_dict(state)
        loaded = feature_map(*inputs)
        assert all(torch.equal(a, b) for a, b in zip(loaded, uncached_features(feature_map, *inputs), strict=True))

        kept = feature_map._decoding_parameters[1]
        feature_map.double()
        doubled = feature_map(*(t.double() for t in inputs))
        assert feature_map._decoding_parameters[1] is not kept and doubled[0].dtype == torch.float64
        assert all(torch.allclose(a.float(), b, atol=1e-5) for a, b in zip(doubled, loaded, strict=True))


def test_decoding_rows_are_not_kept_when_gradients_are_needed():
    """With gradients on, one token goes through the autograd node: the parameters get their gradients."""
    feature_map, inputs = decoding_feature_map()
    query_features, key_features = feature_map(*inputs)
    (query_features.sum() + key_features.sum()).backward()
    assert feature_map._decoding_parameters is None
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in feature_map.parameters())


def projection_inputs(heads, kv_heads, num_freq, freq_width, m=4, bias=True, seq=3, batch=2, hidden_size=5):
    """A layer input and query/key projections for ``QKMapProjectedQueryKeyFunction``, float64."""
    _, _, frequency, query_gain, key_gain, cos, sin = query_key_inputs(heads, kv_heads, num_freq, freq_width, m=m)
    cos, sin = (torch.randn(1, seq, m, generator=torch.Generator().manual_seed(s), dtype=torch.float64) for s in (5, 6))
    generator = torch.Generator().manual_seed(heads + 17 * kv_heads)

    def rand(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64).requires_grad_()

    hidden = rand(batch, seq, hidden_size)
    query_weight, key_weight = rand(heads * m, hidden_size), rand(kv_heads * m, hidden_size)
    query_bias, key_bias = (rand(heads * m), rand(kv_heads * m)) if bias else (None, None)
    return hidden, query_weight, query_bias, key_weight, key_bias, frequency, query_gain, key_gain, cos, sin


@pytest.mark.parametrize("rotate_cos_blocks", [True, False])
@pytest.mark.parametrize("heads,kv_heads,num_freq,freq_width", CASES)
def test_projected_node_passes_gradcheck_and_equals_projections_then_the_map(
    heads, kv_heads, num_freq, freq_width, rotate_cos_blocks
):
    """Projections recomputed in the backward pass: float64 gradcheck, the unfused path's values bit for bit and its
    gradients for every input (layer input, weights, biases, omega, gains) up to float rounding."""
    inputs = projection_inputs(heads, kv_heads, num_freq, 4 if freq_width > 1 else 1, bias=heads != 4)
    assert torch.autograd.gradcheck(
        lambda *tensors: QKMapProjectedQueryKeyFunction.apply(*tensors, 4, rotate_cos_blocks, False, False),
        inputs,
        eps=1e-6,
        atol=1e-8,
        fast_mode=True,
    )
    hidden, query_weight, query_bias, key_weight, key_bias, frequency, query_gain, key_gain, cos, sin = inputs
    fused = qkmap_projected_query_key_features(*inputs, rotate_cos_blocks=rotate_cos_blocks)
    assert fused[0].grad_fn.name() == "QKMapProjectedQueryKeyFunctionBackward"
    query = torch.nn.functional.linear(hidden, query_weight, query_bias).view(2, 3, heads, 4).transpose(1, 2)
    key = torch.nn.functional.linear(hidden, key_weight, key_bias).view(2, 3, kv_heads, 4).transpose(1, 2)
    plain = qkmap_query_key_features(query, key, frequency, query_gain, key_gain, cos, sin, rotate_cos_blocks)
    assert all(torch.equal(a, b) for a, b in zip(fused, plain, strict=True))
    weights = [torch.randn(f.shape, generator=torch.Generator().manual_seed(i), dtype=torch.float64)
               for i, f in enumerate(plain)]  # fmt: skip
    wanted = [t for t in inputs if t is not None and t.requires_grad]
    got = torch.autograd.grad(sum((f * w).sum() for f, w in zip(fused, weights, strict=True)), wanted)
    want = torch.autograd.grad(sum((f * w).sum() for f, w in zip(plain, weights, strict=True)), wanted)
    assert len(got) == (10 if heads != 4 else 8) - 2  # the tables need no gradient
    for a, b in zip(got, want, strict=True):
        assert (a - b).abs().max().item() < 1e-10 * (1 + b.abs().max().item())


def test_projected_node_gives_only_the_gradients_asked_for():
    """Frozen query projection and layer input: no query gradients, and the key side's equal the unfused path's."""
    inputs = list(projection_inputs(4, 2, 1, 4))
    for index in (0, 1, 2):  # hidden, query weight, query bias
        inputs[index] = inputs[index].detach()
    fused = qkmap_projected_query_key_features(*inputs)
    key_weight = inputs[3]
    (got,) = torch.autograd.grad(fused[0].sum() + fused[1].square().sum(), [key_weight])
    key = torch.nn.functional.linear(inputs[0], key_weight, inputs[4]).view(2, 3, 2, 4).transpose(1, 2)
    query = torch.nn.functional.linear(inputs[0], inputs[1], inputs[2]).view(2, 3, 4, 4).transpose(1, 2)
    plain = qkmap_query_key_features(query, key, *inputs[5:])
    (want,) = torch.autograd.grad(plain[0].sum() + plain[1].square().sum(), [key_weight])
    assert (got - want).abs().max().item() < 1e-10 * (1 + want.abs().max().item())


def test_projected_node_keeps_the_layer_input_instead_of_the_projections():
    """Saved: the layer input and the small tensors; not the projected queries and keys the plain node keeps."""
    inputs = [t.detach().float().requires_grad_(t.requires_grad) if t is not None else None
              for t in projection_inputs(8, 2, 1, 64, m=64, seq=128, batch=1, hidden_size=96)]  # fmt: skip
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        qkmap_projected_query_key_features(*inputs)
    assert len(saved) == len(inputs)
    assert sum(t.numel() * t.element_size() for t in saved) == sum(
        t.numel() * t.element_size() for t in inputs if t is not None
    )
    assert any(t.data_ptr() == inputs[0].data_ptr() for t in saved)  # the layer input itself, not a copy


def test_a_training_step_binds_no_autograd_function_arguments_through_inspect(monkeypatch, fused_kernel):
    """``Function.apply`` binds a ``setup_context`` Function's arguments with ``inspect.signature`` on every call (~50 us,
    paid per layer and training step); the map's nodes, the fused attention and the padded output projection (sdpa
    with padded values, where the fused attention is off) take ``ctx`` in forward."""
    import torch.autograd.function as autograd_function

    real, bound = autograd_function.inspect, []

    class RecordingInspect:
        def __getattr__(self, name):
            return getattr(real, name)

        @staticmethod
        def signature(func, *args, **kwargs):
            bound.append(func.__qualname__.split(".")[-2])  # the Function's class
            return real.signature(func, *args, **kwargs)

    monkeypatch.setattr(autograd_function, "inspect", RecordingInspect())

    class WithSetupContext(torch.autograd.Function):  # the check can fail: such a Function is recorded
        @staticmethod
        def forward(x):
            return x * 2

        @staticmethod
        def setup_context(ctx, inputs, output):
            pass

        @staticmethod
        def backward(ctx, grad):
            return grad * 2

    WithSetupContext.apply(torch.ones(1, requires_grad=True))
    assert bound == ["WithSetupContext"]
    bound.clear()

    nodes = set()
    for fields in (
        {},
        {"qkmap_recompute_projections": False},
        {"qkmap_input_dim": 4},
        {"qkmap_fused_attention": False},
    ):
        torch.manual_seed(0)
        model = QKMapForCausalLM(QKMapConfig(**tiny_config_kwargs(qk_mode="qk_map", **fields))).train()
        model.set_attn_implementation("sdpa")
        tokens = torch.randint(0, model.config.vocab_size, (1, 6))
        loss = model(input_ids=tokens, labels=tokens).loss
        pending = [loss.grad_fn]
        while pending:
            node = pending.pop()
            nodes.add(type(node).__name__)
            pending.extend(next_node for next_node, _ in node.next_functions if next_node is not None)
        loss.backward()
    features = qkmap_features(*random_inputs(4, 2, 2, 6))
    nodes.add(type(features.grad_fn).__name__)
    features.sum().backward()
    expected = {
        "QKMapFeatureFunctionBackward",
        "QKMapProjectedQueryKeyFunctionBackward",
        "QKMapQueryKeyFunctionBackward",
        "FusedCausalAttentionBackward",
        "PaddedOutputProjectionBackward",
    }
    assert expected <= nodes
    assert bound == []
