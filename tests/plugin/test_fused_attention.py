"""The fused CPU attention for keys wider than values (``qkmap_v1.causal_attention``,
``qkmap_hf/kernels/attention_cpu.cpp``): sdpa's values and gradients without padding the values, and where the model
runs it and where it does not."""

from __future__ import annotations

import copy

import pytest
import torch

from qkmap_hf import QKMapConfig, QKMapForCausalLM, kernels
from qkmap_hf.modeling.attention_qkmap import FUSED_ATTENTION_OPS, FusedCausalAttention
from tests.utils import tiny_config_kwargs

pytestmark = pytest.mark.usefixtures("fused_kernel")


@pytest.mark.parametrize(
    "batch, heads, kv_heads, length, key_width, value_width",
    [
        (1, 2, 2, 37, 16, 8),  # shorter than one block of queries
        (2, 6, 2, 100, 32, 16),  # GQA 3:1, two blocks of 64 queries, the second partial
        (1, 4, 1, 300, 128, 64),  # one key/value head, past one block of 256 keys, partial blocks both ways
        (1, 3, 3, 70, 16, 16),  # keys as wide as values
    ],
)
def test_the_output_and_every_gradient_equal_float64_sdpa(batch, heads, kv_heads, length, key_width, value_width):
    generator = torch.Generator().manual_seed(length)
    got, want = kernels.attention_against_sdpa(
        batch, heads, kv_heads, length, key_width, value_width, generator=generator
    )
    assert [tuple(tensor.shape) for tensor in got] == [tuple(tensor.shape) for tensor in want]
    for name, fused, reference in zip(("output", "query", "key", "value"), got, want, strict=True):
        error = ((fused.double() - reference).abs().max() / reference.abs().max()).item()
        assert error < 2e-6, f"{name}: {error:.2e}"


def test_the_output_is_token_major_and_two_calls_give_the_same_bits(two_threads):
    """The output is ``(batch, T, heads, Dv)`` contiguous (what ``o_proj`` reads, no transpose copy), the gradients
    token-major views; with the same thread count a second call is bit for bit the first (on 2 threads)."""
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(1, 300, 4, 64, generator=generator).transpose(1, 2).requires_grad_()
    key = torch.randn(1, 300, 2, 64, generator=generator).transpose(1, 2).requires_grad_()
    value = torch.randn(1, 300, 2, 32, generator=generator).transpose(1, 2).requires_grad_()
    runs = []
    for _ in range(2):
        output = FusedCausalAttention.apply(query, key, value, 0.125)
        grads = torch.autograd.grad(output, (query, key, value), torch.ones_like(output))
        runs.append((output, *grads))
    assert runs[0][0].shape == (1, 300, 4, 32) and runs[0][0].is_contiguous()
    assert all(grad.transpose(1, 2).is_contiguous() for grad in runs[0][1:])
    assert all(torch.equal(first, second) for first, second in zip(*runs, strict=True))


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(dtype=torch.float64), "float32 CPU tensors only"),
        (dict(kv_heads=3), "with H a multiple of Hkv"),
        (dict(key_width=8), "expected query"),
        (dict(scale=0.0), "the logit scale must be positive"),
    ],
)
def test_bad_inputs_are_refused_naming_the_op(change, message):
    shape = dict(heads=4, kv_heads=2, key_width=16, dtype=torch.float32, scale=0.25) | change
    query = torch.randn(1, shape["heads"], 5, 16, dtype=shape["dtype"])
    key = torch.randn(1, shape["kv_heads"], 5, shape["key_width"], dtype=shape["dtype"])
    value = torch.randn(1, shape["kv_heads"], 5, 8, dtype=shape["dtype"])
    with pytest.raises(RuntimeError, match=f"qkmap_v1.causal_attention: .*{message}"):
        FUSED_ATTENTION_OPS().causal_attention(query, key, value, shape["scale"])


def tiny_model(**overrides) -> QKMapForCausalLM:
    """The tiny wide-layout model (keys 32 wide, values 16; 4 query heads on 2 key/value heads), sdpa."""
    torch.manual_seed(0)
    model = QKMapForCausalLM(QKMapConfig(**tiny_config_kwargs(qk_mode="qk_map", **overrides)))
    model.set_attn_implementation("sdpa")
    model.generation_config.eos_token_id = None
    return model


def step(model: QKMapForCausalLM, ids: torch.Tensor, **inputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    output = model(ids, labels=ids, **inputs)
    output.loss.backward()
    return output.logits.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def without_fused_attention(model: QKMapForCausalLM) -> QKMapForCausalLM:
    other = copy.deepcopy(model)
    other.config.qkmap_fused_attention = False
    return other


def test_a_wide_model_trains_through_it_with_sdpas_logits_and_gradients(fused_attention_calls):
    model = tiny_model().train()
    assert model.config.query_key_dim == 2 * model.config.head_dim
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(1))
    padded = step(without_fused_attention(model), ids)
    assert fused_attention_calls == []
    fused = step(model, ids)
    layers = model.config.num_hidden_layers
    assert fused_attention_calls == ["causal_attention"] * layers + ["causal_attention_backward"] * layers
    assert (fused[0] - padded[0]).abs().max().item() < 1e-5
    assert fused[1].keys() == padded[1].keys()
    for name, grad in fused[1].items():
        reference = padded[1][name]
        assert (grad - reference).abs().max().item() <= 1e-4 * reference.abs().max().item() + 1e-9, name


def test_generate_prefills_through_it_and_decodes_the_same_tokens(fused_attention_calls):
    """Prefill (as many queries as keys, no mask) runs the kernel, forward only; each decoded token takes the
    one-query path. Greedy tokens equal sdpa's with padded values."""
    model = tiny_model().eval()
    prompt = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(2))
    reference = without_fused_attention(model).generate(prompt, max_new_tokens=6, do_sample=False)
    assert fused_attention_calls == []
    tokens = model.generate(prompt, max_new_tokens=6, do_sample=False)
    assert fused_attention_calls == ["causal_attention"] * model.config.num_hidden_layers
    assert torch.equal(tokens, reference)


@pytest.mark.parametrize(
    "case",
    ["compact layout", "field off", "padding mask", "bfloat16", "dropout", "one token", "eager"],
)
def test_elsewhere_sdpa_with_padded_values_runs_with_the_same_logits(case, fused_attention_calls):
    """Where the kernel does not take the call, the model runs as before: no kernel call, and (float32) the logits
    of the same model with the field off."""
    overrides = {
        "compact layout": dict(qkmap_input_dim=8),
        "field off": dict(qkmap_fused_attention=False),
        "dropout": dict(attention_dropout=0.5),
    }.get(case, {})
    model = tiny_model(**overrides).train(case == "dropout")
    ids = torch.randint(0, 256, (2, 1 if case == "one token" else 10), generator=torch.Generator().manual_seed(3))
    inputs = {}
    if case == "padding mask":
        inputs["attention_mask"] = torch.ones_like(ids)
        inputs["attention_mask"][0, :3] = 0
    if case == "bfloat16":
        model = model.to(torch.bfloat16)
    if case == "eager":
        model.set_attn_implementation("eager")
    torch.manual_seed(4)  # dropout draws the same masks in both runs
    logits = model(ids, **inputs).logits
    assert fused_attention_calls == []
    if case != "bfloat16":
        torch.manual_seed(4)
        reference = without_fused_attention(model)(ids, **inputs).logits
        assert (logits - reference).abs().max().item() < 1e-6


def test_the_kernel_benchmark_times_every_path_against_standard_sdpa(tmp_path, one_thread, fused_attention_calls):
    """benchmarks/attention_kernel.py on a tiny grid: per shape, length and direction, each path's time and its ratio
    to standard's sdpa (1 against itself), and the wide layout's fused time against the kernel at standard's widths.
    """
    import csv
    import sys

    sys.path.insert(0, str(kernels.SOURCES[0].parents[2] / "benchmarks"))
    import attention_kernel

    args = ["--head-dims", "16", "--heads", "4", "--kv-ratios", "4", "--seq-lens", "70", "--repeats", "2"]
    assert attention_kernel.main([*args, "--calls", "1", "--output-dir", str(tmp_path)]) == 0
    rows = list(csv.DictReader((tmp_path / "attention_kernel.csv").open()))
    paths = [*attention_kernel.PATHS, "wide_fused / standard_fused"]
    assert [(r["shape"], r["direction"], r["path"]) for r in rows] == [
        ("d16 h4/kv1", direction, path) for direction in ("forward", "train") for path in paths
    ]
    for row in rows:
        ratio = float(row["ratio"])
        assert float(row["ms"]) > 0 and float(row["ratio_min"]) <= ratio <= float(row["ratio_max"])
        if row["path"] == "standard_sdpa":
            assert ratio == 1.0
    # the fused paths ran the kernel: warm-up and 2 repeats of 1 call, two paths, forward and train (+ its backward)
    assert fused_attention_calls.count("causal_attention") == 2 * 2 * 3
    assert fused_attention_calls.count("causal_attention_backward") == 2 * 3
    assert (tmp_path / "attention_kernel.md").read_text().count("\n") == 2 + len(rows)
