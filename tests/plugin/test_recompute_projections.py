"""``qkmap_recompute_projections``: the projections and the feature map in one node that keeps the layer input."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from qkmap_hf import QKMapConfig, QKMapForCausalLM
from qkmap_hf.phases import PhaseRecorder
from tests.utils import TINY, assert_same_loss_and_gradients, tiny_config_kwargs

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from attention_overhead import saved_activation_bytes  # noqa: E402

FUSED_NODE = "QKMapProjectedQueryKeyFunctionBackward"
TINY_HEAD_DIM = TINY["hidden_size"] // TINY["num_attention_heads"]


def pair(recompute: bool = True, **overrides) -> tuple[QKMapForCausalLM, QKMapForCausalLM]:
    """The same tiny QK-MAP model without and with the recomputing node (equal weights, moved off their init)."""
    fields = dict(qk_mode="qk_map", attention_bias=True, **overrides)
    torch.manual_seed(0)
    plain = QKMapForCausalLM(QKMapConfig(**tiny_config_kwargs(**fields, qkmap_recompute_projections=False)))
    with torch.no_grad():
        for parameter in plain.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    fused = QKMapForCausalLM(QKMapConfig(**tiny_config_kwargs(**fields, qkmap_recompute_projections=recompute)))
    fused.load_state_dict(plain.state_dict())
    return plain, fused


def ids(seq: int = 12, batch: int = 2) -> torch.Tensor:
    return torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(1))


def mapped_query_node(model: QKMapForCausalLM, tokens: torch.Tensor) -> str:
    """The autograd node that made layer 0's queries as the kernel sees them."""
    captured = {}
    attention = model.model.layers[0].self_attn
    original = attention.qk_map.forward, attention.qk_map.project

    def keep(result):
        if result is not None:
            captured["node"] = result[0].grad_fn.name()
        return result

    attention.qk_map.forward = lambda *a: keep(original[0](*a))
    attention.qk_map.project = lambda *a: keep(original[1](*a))
    try:
        model(tokens, labels=tokens)
    finally:
        del attention.qk_map.forward, attention.qk_map.project
    return captured["node"]


def assert_fused_matches_plain(plain: QKMapForCausalLM, fused: QKMapForCausalLM, tokens: torch.Tensor) -> None:
    """The loss bit for bit, every gradient up to the order of float sums, the node's parameters among them."""
    names = assert_same_loss_and_gradients(plain, fused, tokens, tolerance=1e-5)
    touched = [name for name in names if "q_proj" in name or "k_proj" in name or "qk_map" in name]
    assert len(touched) == 7 * plain.config.num_hidden_layers  # q/k weights and biases, omega, two gains per layer


@pytest.mark.parametrize("overrides", [{}, dict(qkmap_num_frequencies=2, qkmap_input_dim=8)], ids=["wide", "F2-m8"])
def test_same_loss_bit_for_bit_and_the_same_gradients(overrides):
    plain, fused = pair(**overrides)
    tokens = ids()
    assert mapped_query_node(fused, tokens) == FUSED_NODE
    assert mapped_query_node(plain, tokens) == "QKMapQueryKeyFunctionBackward"
    assert_fused_matches_plain(plain, fused, tokens)


def test_keeps_fewer_bytes_by_the_layer_input_and_the_projections():
    """Every save: the plain path keeps the layer input twice (q_proj, k_proj) and z of queries and keys; the node
    keeps the layer input once. Distinct storages: z of queries and keys is gone (the input is v_proj's too)."""
    plain, fused = pair()
    tokens = ids(seq=16)
    (plain_saved, plain_distinct), (fused_saved, fused_distinct) = (
        saved_activation_bytes(m, tokens) for m in (plain, fused)
    )
    config, positions = plain.config, tokens.numel()
    z_elements = positions * (config.num_attention_heads + config.num_key_value_heads) * config.resolved_qkmap_input_dim
    per_layer = 4 * (positions * config.hidden_size + z_elements)
    assert plain_saved - fused_saved == config.num_hidden_layers * per_layer
    assert plain_distinct - fused_distinct == config.num_hidden_layers * 4 * z_elements


def test_adapters_hooks_and_the_input_norm_keep_the_plain_path():
    """A peft LoRA on q_proj/k_proj, a forward hook, the phase recorder's hook, qkmap_input_norm and inference all
    keep the projections as modules: the adapters still get their gradients."""
    from peft import LoraConfig, get_peft_model

    _, fused = pair()
    tokens = ids()
    adapted = get_peft_model(fused, LoraConfig(target_modules=["q_proj", "k_proj"], r=2))
    assert mapped_query_node(adapted.base_model.model, tokens) == "QKMapQueryKeyFunctionBackward"
    adapted(tokens, labels=tokens).loss.backward()
    lora_b = [p for n, p in adapted.named_parameters() if "lora_B" in n]
    assert lora_b and all(p.grad is not None and p.grad.abs().sum() > 0 for p in lora_b)

    _, hooked = pair()
    hooked.model.layers[0].self_attn.k_proj.register_forward_hook(lambda module, args, output: None)
    assert mapped_query_node(hooked, tokens) == "QKMapQueryKeyFunctionBackward"

    _, recorded = pair()  # the phase recorder reads z with a pre-hook on the feature map: it sees every layer's z
    with PhaseRecorder(recorded) as recorder:
        assert mapped_query_node(recorded, tokens) == "QKMapQueryKeyFunctionBackward"
    assert len(recorder.summary()["layers"]) == recorded.config.num_hidden_layers

    _, normed = pair(qkmap_input_norm=True)
    assert mapped_query_node(normed, tokens) == "QKMapQueryKeyFunctionBackward"

    plain, fused = pair()
    with torch.no_grad():
        assert torch.equal(plain(tokens).logits, fused(tokens).logits)


def test_the_flag_is_a_boolean_or_none_and_survives_save_and_load(tmp_path):
    with pytest.raises(ValueError, match="qkmap_recompute_projections='yes' is invalid; use true, false or null"):
        QKMapConfig(**tiny_config_kwargs(qkmap_recompute_projections="yes"))
    for value in (True, False, None):
        model = QKMapForCausalLM(QKMapConfig(**tiny_config_kwargs(qkmap_recompute_projections=value)))
        model.save_pretrained(tmp_path / str(value))
        assert QKMapConfig.from_pretrained(tmp_path / str(value)).qkmap_recompute_projections is value


@pytest.mark.parametrize(
    ("fields", "recomputes"),
    [
        ({}, True),  # the wide layout: keys 2m = 2 head_dim wide
        (dict(qkmap_num_frequencies=2, qkmap_input_dim=8), True),
        (dict(qkmap_input_dim=TINY_HEAD_DIM // 2), False),  # the compact layout: keys head_dim wide
        (dict(qkmap_recompute_projections=False), False),
        (dict(qkmap_input_dim=TINY_HEAD_DIM // 2, qkmap_recompute_projections=True), True),
        (dict(qk_mode="qk_norm"), False),
        (dict(qk_mode="standard", qk_position_prior="constant"), False),  # wider keys, but no feature map
    ],
)
def test_by_default_the_wide_layout_recomputes_and_the_compact_one_keeps_z(fields, recomputes):
    config = QKMapConfig(**tiny_config_kwargs(**{"qk_mode": "qk_map", **fields}))
    assert config.resolved_qkmap_recompute_projections is recomputes
    if config.qk_mode == "qk_map":
        expected = FUSED_NODE if recomputes else "QKMapQueryKeyFunctionBackward"
        assert mapped_query_node(QKMapForCausalLM(config).train(), ids()) == expected


def test_gradient_checkpointing_keeps_the_plain_path_with_the_same_loss_and_gradients():
    """A checkpointed layer keeps only its input, so the node would only add matmuls: it steps aside while
    checkpointing is on and comes back when it is off."""
    plain, fused = pair()
    tokens = ids()
    # transformers 5.x renamed it activation checkpointing; the old name is the one every 5.x has
    enable = getattr(fused, "activation_checkpointing_enable", fused.gradient_checkpointing_enable)
    enable({"use_reentrant": False})
    fused.train()
    assert fused.model.layers[0].self_attn.qk_map.gradient_checkpointing
    assert mapped_query_node(fused, tokens) == "QKMapQueryKeyFunctionBackward"
    assert_fused_matches_plain(plain, fused, tokens)
    getattr(fused, "activation_checkpointing_disable", fused.gradient_checkpointing_disable)()
    assert mapped_query_node(fused, tokens) == FUSED_NODE


@pytest.mark.slow  # compiles a training step (~20 s)
def test_compiled_training_step_with_recomputed_projections_matches_eager():
    plain, fused = pair()
    tokens = ids()
    compiled = torch.compile(fused)
    compiled(tokens, labels=tokens).loss.backward()
    plain(tokens, labels=tokens).loss.backward()
    for (name, a), b in zip(plain.named_parameters(), fused.parameters(), strict=True):
        assert (a.grad - b.grad).abs().max() <= 1e-4 * (1 + a.grad.abs().max()), name
