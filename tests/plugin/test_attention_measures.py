"""The analyze measures on hand-built attention patterns with known answers, and the probes on tiny models."""

from __future__ import annotations

import pytest
import torch

from qkmap_hf.analysis import AnalysisSettings, analyze_model, first_token_mass
from qkmap_hf.attention_measures import attention_distance, log2_lift, position_only_share, token_mass_change
from qkmap_hf.attention_probes import key_positions, needle_prompt_ids
from qkmap_hf.tasks.needle import make_needle_examples
from qkmap_hf.training.data import byte_level_tokenizer
from qkmap_hf.training.presets import preset_config

T = 16


def from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Causal softmax of ``(T, T)`` or ``(batch, heads, T, T)`` logits."""
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    return (
        logits.masked_fill(~mask, float("-inf")).softmax(-1).reshape(-1, 1, T, T)
        if logits.dim() == 2
        else (logits.masked_fill(~mask, float("-inf")).softmax(-1))
    )


def distance_matrix() -> torch.Tensor:
    return (torch.arange(T)[:, None] - torch.arange(T)[None, :]).float()


def test_attention_distance_known_patterns():
    self_only = torch.eye(T)[None, None]
    on_first = torch.zeros(1, 1, T, T)
    on_first[..., 0] = 1.0
    uniform = from_logits(torch.zeros(T, T))
    assert attention_distance(self_only).mean == 0.0
    assert attention_distance(self_only).bucket_mass[0] == 1.0
    # query t puts all mass at distance t: mean over t = 1..T-1 is T/2
    assert attention_distance(on_first).mean == pytest.approx(T / 2)
    # uniform over 0..t: expected distance t/2, mean over t = 1..T-1 is T/4
    assert attention_distance(uniform).mean == pytest.approx(T / 4)
    assert sum(attention_distance(uniform).bucket_mass) == pytest.approx(1.0)
    two_heads = torch.cat((self_only, on_first), dim=1)
    assert attention_distance(two_heads).per_head == pytest.approx([0.0, T / 2])


def test_position_only_share_known_patterns():
    d = distance_matrix()
    generator = torch.Generator().manual_seed(0)
    pure_position = from_logits(torch.sin(d) - 0.2 * d)
    row_shifted = from_logits(torch.sin(d) - 0.2 * d + 5 * torch.randn(T, 1, generator=generator))  # per-row constants
    content = from_logits(torch.randn(8, 1, 1, T, generator=generator).expand(8, 1, T, T))  # key-only, no position
    assert position_only_share(pure_position).mean == pytest.approx(1.0, abs=1e-9)
    assert position_only_share(row_shifted).mean == pytest.approx(1.0, abs=1e-9)
    assert abs(position_only_share(content).mean) < 0.05
    flat = from_logits(torch.zeros(T, T))
    assert position_only_share(flat).mean == 0.0  # no variance: nothing to explain
    # half position, half independent noise of the same variance: about half
    position = torch.sin(d * 1.3).expand(64, 1, T, T)
    noise = torch.randn(64, 1, T, T, generator=generator) * position[0, 0][torch.ones(T, T).tril().bool()].std()
    assert position_only_share(from_logits(position + noise)).mean == pytest.approx(0.5, abs=0.08)


def test_token_mass_change_and_log2_lift_known_values():
    base = from_logits(torch.zeros(T, T))
    changed = base.clone()
    changed[..., 5:, 3] += 0.1  # every later query gives token 3 ten points more (rows need not sum to 1 here)
    changed[..., 8:, 3] -= 0.3
    gain = token_mass_change(base, changed, 3)
    later = torch.arange(4, T)
    expected = ((later >= 5).float() * 0.1 - (later >= 8).float() * 0.3).mean()
    assert gain.mean == pytest.approx(float(expected))
    assert token_mass_change(base, changed, 3, absolute=True).mean == pytest.approx(
        float(((later >= 5).float() * 0.1 - (later >= 8).float() * 0.3).abs().mean())
    )
    rows = torch.tensor([[0.4, 0.1, 0.1, 0.4], [0.25, 0.25, 0.25, 0.25]])
    target = torch.tensor([True, False, False, False])
    reference = torch.tensor([False, True, True, False])
    assert log2_lift(rows, target, reference).per_head == pytest.approx([2.0, 0.0])


def test_first_token_mass_known_pattern():
    on_first = torch.zeros(1, 2, T, T)
    on_first[:, 0, :, 0] = 1.0
    on_first[:, 1] = torch.eye(T)
    result = first_token_mass([on_first], first_is_bos=False)
    assert result["per_head"] == [[1.0, 0.0]]


def testneedle_prompt_ids_mark_the_value_and_keep_the_answer_position():
    tokenizer = byte_level_tokenizer()
    example = make_needle_examples(300, 1, seed=0, count=lambda s: len(s.encode()), depths=[0.9])[0]
    ids, kinds = needle_prompt_ids(tokenizer, example, max_positions=None)
    value = bytes(i for i, k in zip(ids, kinds, strict=True) if k == "value").decode()
    assert value == example.answer and kinds[-1] == "question"
    short, short_kinds = needle_prompt_ids(tokenizer, example, max_positions=200)
    assert len(short) == 200 and short[-40:] == ids[-40:]  # cut from the start: the question stays
    assert short_kinds.count("value") == 4
    early = make_needle_examples(300, 1, seed=0, count=lambda s: len(s.encode()), depths=[0.0])[0]
    with pytest.raises(ValueError, match="without losing evidence"):
        needle_prompt_ids(tokenizer, early, max_positions=100)
    assert key_positions(256) == sorted(set(key_positions(256))) and max(key_positions(256)) <= 128


@pytest.mark.usefixtures("one_thread")
def test_probes_on_tiny_models():
    """QK-Norm divides a key's scale out (0 up to its epsilon); standard and QK-MAP keys attract more or less."""
    from qkmap_hf.modeling.modeling_qkmap import QKMapForCausalLM

    tokenizer = byte_level_tokenizer()
    settings = AnalysisSettings(scales=(2.0,), max_tokens=48, num_windows=2, context_lengths=(160,), needle_examples=1)
    text = "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer " * 4
    results = {}
    for mode in ("standard", "qk_norm", "qk_map"):
        torch.manual_seed(0)
        config = preset_config("tiny", mode, vocab_size=len(tokenizer), max_position_embeddings=256)
        model = QKMapForCausalLM(config)
        results[mode] = analyze_model(model, tokenizer, text, settings, progress=False)
    qk_norm = results["qk_norm"]["key_scale_sensitivity"]["mean_abs_change"]
    assert qk_norm < 1e-6
    for mode in ("standard", "qk_map"):
        assert results[mode]["key_scale_sensitivity"]["mean_abs_change"] > max(1e-4, 100 * qk_norm)
    assert results["qk_map"]["position_only_share"]["mean"] > 0.9
    contrast = results["qk_map"]["answer_contrast"]["by_length"]["160"]
    assert contrast["examples"] == 1 and len(contrast["per_head_log2_lift"]) == 2
