"""Shared test helpers: tiny configs and a clean interpreter in which qkmap_hf cannot be imported."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from qkmap_hf.cleanroom import run_without_qkmap_hf

TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


def tiny_config_kwargs(**overrides) -> dict:
    return {**TINY, **overrides}


def kl_per_token(reference_logits: torch.Tensor, other_logits: torch.Tensor) -> torch.Tensor:
    """KL(reference || other) per position, in float64 nats."""
    p = reference_logits.double().log_softmax(-1)
    q = other_logits.double().log_softmax(-1)
    return (p.exp() * (p - q)).sum(-1)


def run_clean_python(code: str, cwd: Path, env: dict | None = None, timeout: float = 300) -> dict:
    """Run ``code`` in a fresh interpreter where ``import qkmap_hf`` fails; return the JSON it prints last.

    The code must print one JSON object as its last stdout line.
    """
    result = run_without_qkmap_hf(code, cwd=cwd, env=env, timeout=timeout)
    if result.returncode != 0:
        raise AssertionError(f"clean interpreter failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def written_out_features(z, frequency, gain, cos, sin, rotate_cos_blocks=True):
    """docs/method.md's phi one block at a time: gain * cos/sin(omega z), then Llama's RoPE on the block."""
    heads, kv_heads, num_freq = z.shape[1], frequency.shape[0], frequency.shape[1]
    out = []
    for head in range(heads):
        kv = head // (heads // kv_heads)  # GQA: a query head uses its key head's frequencies and gains
        blocks = []
        for f in range(num_freq):
            phase = z[:, head] * frequency[kv, f]  # (batch, seq, m); a per-block omega broadcasts
            for row, trig in ((2 * f, torch.cos), (2 * f + 1, torch.sin)):
                block = gain[kv, row] * trig(phase)
                if row % 2 == 1 or rotate_cos_blocks:
                    block = apply_rotary_pos_emb(block[:, None], block[:, None], cos, sin)[0][:, 0]
                blocks.append(block)
        out.append(torch.cat(blocks, dim=-1))
    return torch.stack(out, dim=1)


def load_float32(path: Path):
    """A saved causal LM in float32, eval mode (the heal tests compare logits and gains of such folders)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def tiny_llama_converted_exactly(root: Path, *, initializer_range: float, num_frequencies: int = 1) -> dict[str, Path]:
    """A tiny random Llama with a byte-level tokenizer in ``root/src`` (seed 0) and its exact conversion in
    ``root/conv``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import qkmap_hf
    from qkmap_hf.training.data import byte_level_tokenizer

    tokenizer = byte_level_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(**tiny_config_kwargs(vocab_size=len(tokenizer), initializer_range=initializer_range))
    LlamaForCausalLM(config).save_pretrained(root / "src")
    tokenizer.save_pretrained(root / "src")
    qkmap_hf.convert_checkpoint(root / "src", root / "conv", init="exact", num_frequencies=num_frequencies,
                                progress=False)  # fmt: skip
    return {"src": root / "src", "conv": root / "conv"}


def assert_same_loss_and_gradients(reference, other, tokens: torch.Tensor, tolerance: float) -> list[str]:
    """One training step of each model (equal weights): the loss bit for bit, every parameter's gradient within
    ``tolerance`` relative to its largest entry. Returns the parameter names compared, for the caller to check
    that the ones its path touches are among them."""
    losses = []
    for model in (reference, other):
        loss = model(tokens, labels=tokens).loss
        loss.backward()
        losses.append(loss)
    assert torch.equal(losses[0], losses[1])
    names = []
    for (name, a), b in zip(reference.named_parameters(), other.parameters(), strict=True):
        assert (a.grad - b.grad).abs().max() <= tolerance * (1 + a.grad.abs().max()), name
        names.append(name)
    return names
