"""Named model sizes for training from scratch, from CPU seconds up to the paper's 190M/1B/7B shapes.

A preset fixes the architecture (width, depth, heads, MLP) and suggests a block size, batch size and
learning rate; the attention mode (``qk_mode``) and the vocabulary (from the tokenizer) are chosen at
build time, so ``standard``, ``qk_norm`` and ``qk_map`` models of one preset have the same shapes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from ..modeling.configuration_qkmap import QK_MODES, QKMapConfig


@dataclass(frozen=True)
class SizePreset:
    """Architecture of a Llama-style decoder plus suggested training settings for it."""

    name: str
    description: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int  # nominal: replaced by the tokenizer's size when a model is built for training
    block_size: int
    batch_size: int
    learning_rate: float
    tie_word_embeddings: bool = True

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


PRESETS: dict[str, SizePreset] = {
    preset.name: preset
    for preset in (
        SizePreset(
            name="tiny",
            description="2 layers x 64 wide, 4 heads x 16 (GQA 4/2): seconds on a CPU, for tests and smoke runs",
            hidden_size=64,
            intermediate_size=176,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=257,
            block_size=64,
            batch_size=8,
            learning_rate=3e-3,
        ),
        SizePreset(
            name="mini-cpu",
            description="4 layers x 128 wide, 4 heads x 32: about a minute per 200 steps on 2 CPU cores",
            hidden_size=128,
            intermediate_size=352,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=4,
            vocab_size=257,
            block_size=128,
            batch_size=16,
            learning_rate=2e-3,
        ),
        SizePreset(
            name="claims-cpu",
            description="2 layers x 128 wide, 2 heads x 64, T=512, batch 4: head_dim 64 and needle lengths 256/512 "
            "on a CPU (~0.2-0.3 s per step on one core), for benchmarks/paper_claims.sh",
            hidden_size=128,
            intermediate_size=352,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            vocab_size=257,
            block_size=512,
            batch_size=4,
            learning_rate=2e-3,
        ),
        SizePreset(
            name="small-cpu",
            description="4 layers x 256 wide, 4 heads x 64: the shape of the byte-level prototype (T=256, batch 16)",
            hidden_size=256,
            intermediate_size=688,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=4,
            vocab_size=257,
            block_size=256,
            batch_size=16,
            learning_rate=2e-3,
        ),
        SizePreset(
            name="190m",
            description="16 layers x 768 wide, 12 heads x 64, MLP 2048, 50k vocab, untied: ~190M parameters",
            hidden_size=768,
            intermediate_size=2048,
            num_hidden_layers=16,
            num_attention_heads=12,
            num_key_value_heads=12,
            vocab_size=50304,
            block_size=1024,
            batch_size=32,
            learning_rate=6e-4,
            tie_word_embeddings=False,
        ),
        SizePreset(
            name="1b",
            description="16 layers x 2048 wide, 32 heads x 64 (GQA 32/8), MLP 8192, 50k vocab, tied: ~1.1B parameters",
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            vocab_size=50304,
            block_size=2048,
            batch_size=16,
            learning_rate=4e-4,
        ),
        SizePreset(
            name="7b",
            description="32 layers x 4096 wide, 32 heads x 128, MLP 11008, 32k vocab, untied (Llama-2 7B): ~6.7B",
            hidden_size=4096,
            intermediate_size=11008,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=32,
            vocab_size=32000,
            block_size=4096,
            batch_size=4,
            learning_rate=3e-4,
            tie_word_embeddings=False,
        ),
    )
}


def get_preset(name: str) -> SizePreset:
    """The preset called ``name``; the error lists the valid names."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown size preset {name!r}; choose one of: {', '.join(PRESETS)}.") from None


def preset_config(
    preset: str | SizePreset,
    qk_mode: str = "qk_map",
    *,
    vocab_size: int | None = None,
    max_position_embeddings: int | None = None,
    **overrides,
) -> QKMapConfig:
    """A ``QKMapConfig`` with the preset's shapes, ``qk_mode`` and any config field in ``overrides``.

    ``vocab_size`` replaces the preset's nominal vocabulary (use ``len(tokenizer)``);
    ``max_position_embeddings`` defaults to the preset's block size.
    """
    preset = get_preset(preset) if isinstance(preset, str) else preset
    if qk_mode not in QK_MODES:
        raise ValueError(f"qk_mode={qk_mode!r} is invalid; allowed values: {', '.join(QK_MODES)}.")
    fields = {
        k: v
        for k, v in asdict(preset).items()
        if k not in ("name", "description", "block_size", "batch_size", "learning_rate")
    }
    fields["vocab_size"] = vocab_size or preset.vocab_size
    fields["max_position_embeddings"] = max_position_embeddings or preset.block_size
    fields["head_dim"] = preset.head_dim
    fields.update(overrides)
    return QKMapConfig(qk_mode=qk_mode, **fields)


def count_parameters(config: QKMapConfig) -> int:
    """Number of distinct parameters (tied weights once) of ``QKMapForCausalLM(config)``, built on the meta device."""
    from ..modeling.modeling_qkmap import QKMapForCausalLM

    with torch.device("meta"):
        model = QKMapForCausalLM(config)
    return sum(p.numel() for p in model.parameters())  # parameters() yields a tied tensor once


__all__ = ["PRESETS", "SizePreset", "count_parameters", "get_preset", "preset_config"]
