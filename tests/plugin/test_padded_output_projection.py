"""``PaddedOutputProjection``: ``o_proj`` of the kernel's padded output keeps a view of it, not a copy."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from qkmap_hf import QKMapConfig, QKMapForCausalLM
from qkmap_hf.modeling.attention_qkmap import PaddedOutputProjection
from tests.utils import TINY, assert_same_loss_and_gradients, tiny_config_kwargs

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from attention_overhead import saved_activation_bytes  # noqa: E402

NODE = "PaddedOutputProjectionBackward"
TINY_HEAD_DIM = TINY["hidden_size"] // TINY["num_attention_heads"]


def tiny_model(**overrides) -> QKMapForCausalLM:
    """A tiny QK-MAP model (the wide layout unless overridden) with biases, moved off its init, in training mode; sdpa
    with padded values (the fused CPU attention, which pads nothing, off unless overridden)."""
    torch.manual_seed(0)
    fields = dict(qk_mode="qk_map", attention_bias=True, qkmap_fused_attention=False) | overrides
    model = QKMapForCausalLM(QKMapConfig(**tiny_config_kwargs(**fields))).train()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    return model


def with_plain_output_projection(model: QKMapForCausalLM) -> QKMapForCausalLM:
    """A copy of ``model`` whose ``o_proj`` layers have a no-op hook: they run as modules (the plain path)."""
    plain = QKMapForCausalLM(model.config).train()
    plain.load_state_dict(model.state_dict())
    for layer in plain.model.layers:
        layer.self_attn.o_proj.register_forward_pre_hook(lambda module, args: None)
    return plain


def ids(seq: int = 12, batch: int = 2) -> torch.Tensor:
    return torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(1))


def output_node(model, tokens: torch.Tensor) -> str:
    """The autograd node that made layer 0's attention output (``o_proj``'s result)."""
    captured = {}
    attention = model.model.layers[0].self_attn
    handle = attention.register_forward_hook(lambda module, args, output: captured.update(node=output[0].grad_fn))
    try:
        model(tokens, labels=tokens)
    finally:
        handle.remove()
    return captured["node"].name()


def test_same_loss_bit_for_bit_and_the_same_gradients():
    model = tiny_model()
    plain = with_plain_output_projection(model)
    tokens = ids()
    assert output_node(model, tokens) == NODE
    assert output_node(plain, tokens) != NODE
    names = assert_same_loss_and_gradients(plain, model, tokens, tolerance=1e-6)
    assert sum("o_proj" in name for name in names) == 2 * model.config.num_hidden_layers  # weight and bias


def test_keeps_one_activation_of_the_layer_width_less_per_layer():
    """Distinct storages: the copy of the heads' outputs is gone, per layer and token ``heads * head_dim`` floats
    (the kernel's padded output, which it keeps, is what the node keeps a view of). Every save: the same bytes, a
    view of the same size in place of the copy."""
    model = tiny_model()
    plain = with_plain_output_projection(model)
    tokens = ids(seq=16)
    (plain_saved, plain_distinct), (saved, distinct) = (saved_activation_bytes(m, tokens) for m in (plain, model))
    config = model.config
    assert plain_saved == saved
    copy_bytes = 4 * tokens.numel() * config.num_attention_heads * config.head_dim
    assert plain_distinct - distinct == config.num_hidden_layers * copy_bytes


@pytest.mark.parametrize(
    ("fields", "implementation"),
    [
        (dict(qkmap_input_dim=TINY_HEAD_DIM // 2), "sdpa"),  # the compact layout: values are not padded
        ({}, "eager"),  # not padded either
        (dict(attention_dropout=0.1), "sdpa"),  # sdpa's math path keeps no output to share
    ],
    ids=["compact", "eager", "dropout"],
)
def test_the_plain_path_where_no_padded_output_is_kept(fields, implementation):
    model = tiny_model(**fields)
    model.set_attn_implementation(implementation)
    assert output_node(model, ids()) != NODE


def test_adapters_frozen_kernels_autocast_and_inference_keep_the_plain_path():
    from peft import LoraConfig, get_peft_model

    tokens = ids()
    adapted = get_peft_model(tiny_model(), LoraConfig(target_modules=["o_proj"], r=2))
    assert output_node(adapted.base_model.model, tokens) != NODE
    adapted(tokens, labels=tokens).loss.backward()
    lora_b = [p for n, p in adapted.named_parameters() if "lora_B" in n]
    assert lora_b and all(p.grad is not None and p.grad.abs().sum() > 0 for p in lora_b)

    frozen = tiny_model()  # only o_proj trains: sdpa keeps no output, so the copy is what o_proj needs
    for name, parameter in frozen.named_parameters():
        parameter.requires_grad_("o_proj" in name)
    assert output_node(frozen, tokens) != NODE
    frozen(tokens, labels=tokens).loss.backward()
    assert frozen.model.layers[0].self_attn.o_proj.weight.grad.abs().sum() > 0

    model = tiny_model()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert output_node(model, tokens) != NODE
    with torch.no_grad():
        assert torch.equal(model(tokens).logits, with_plain_output_projection(model)(tokens).logits)


def test_gradcheck_in_float64_on_a_strided_view():
    generator = torch.Generator().manual_seed(0)
    padded = torch.randn(2, 5, 3, 8, dtype=torch.float64, generator=generator, requires_grad=True)
    weight = torch.randn(6, 12, dtype=torch.float64, generator=generator, requires_grad=True)
    bias = torch.randn(6, dtype=torch.float64, generator=generator, requires_grad=True)

    def projected(padded, weight, bias):
        return PaddedOutputProjection.apply(padded[..., :4], weight, bias)

    assert torch.autograd.gradcheck(projected, (padded, weight, bias))
    assert torch.autograd.gradcheck(lambda p, w: PaddedOutputProjection.apply(p[..., :4], w, None), (padded, weight))
