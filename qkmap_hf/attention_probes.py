"""Model probes for the paper's claims 2-4, built on the pure measures of ``qkmap_hf/attention_measures.py``.

``qkmap analyze`` (``qkmap_hf/analysis.py``) calls these after its unscaled pass, which left every attention
module's inputs in ``layer.extra["inputs"]`` and its weights in ``baseline``:

- ``pattern_measures``: first-token mass is in ``analysis.first_token_mass``; here mean attention distance with
  its distribution and the position-only share of logit variance, per layer and head.
- ``key_scale_sensitivity``: the token-specific test of "a key's norm decides how strongly that token attracts
  queries". One token's key projection (``k_proj`` output at that position only) is scaled by ``factor`` and the
  layer re-run on the same inputs; the attention mass that token gains from later queries is averaged over
  tokens, windows and heads. QK-Norm divides the scale out (0 up to its epsilon); standard attention scales the
  logits of that key; QK-MAP moves its phases. Reported signed and absolute (a key can lose mass too).
- ``answer_value_contrast``: from the answer position (the last prompt token, which predicts the answer) to the
  tokens of the needle's value, attention per value token over attention per distractor token (log2), at each
  context length that fits the model. Unlike the question-to-evidence contrast, the value digits share no
  words with the question, so lexical overlap cannot produce the contrast.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .attention_measures import attention_distance, log2_lift, position_only_share, token_mass_change

KEY_SCALE_FACTOR = 2.0
KEY_SCALE_TOKENS = 16


@dataclass
class AttentionLayer:
    """One attention module with its q/k projections (and QK-MAP feature map), as the probes see it."""

    index: int
    attention: nn.Module
    q_proj: nn.Module
    k_proj: nn.Module
    feature_map: nn.Module | None = None
    extra: dict = field(default_factory=dict)


def attention_layers(model: nn.Module) -> list[AttentionLayer]:
    """Attention modules with separate ``q_proj``/``k_proj`` (Llama family, QK-MAP), in layer order."""
    layers = []
    for module in model.modules():
        q_proj, k_proj = getattr(module, "q_proj", None), getattr(module, "k_proj", None)
        if isinstance(q_proj, nn.Module) and isinstance(k_proj, nn.Module):
            feature_map = getattr(module, "qk_map", None)
            if feature_map is not None and not callable(getattr(feature_map, "frequency", None)):
                feature_map = None
            layers.append(AttentionLayer(len(layers), module, q_proj, k_proj, feature_map))
    if not layers:
        raise ValueError(
            f"{type(model).__name__} has no attention modules with separate q_proj and k_proj; the analysis supports "
            "Llama-family and QK-MAP models (fused-QKV architectures such as GPT-2 are not supported)."
        )
    return layers


def use_eager_attention(model: nn.Module) -> None:
    """Attention weights only come out of the eager kernel."""
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "_attn_implementation", "eager") != "eager":
        if hasattr(model, "set_attn_implementation"):
            model.set_attn_implementation("eager")
        else:  # pragma: no cover - older transformers
            config._attn_implementation = "eager"


def attention_weights(output: Any, layer: AttentionLayer) -> torch.Tensor:
    """The attention probabilities an eager attention module returned, in float32."""
    weights = output[1] if isinstance(output, tuple) and len(output) > 1 else None
    if weights is None:
        raise RuntimeError(
            f"Attention layer {layer.index} ({type(layer.attention).__name__}) returned no attention weights; load the "
            "model with attn_implementation='eager'."
        )
    return weights.float()


@torch.no_grad()
def forward_without_cache(model: nn.Module, input_ids: torch.Tensor) -> None:
    """One forward pass whose hooks collect what a probe needs (no cache, no gradients)."""
    model(input_ids=input_ids, use_cache=False)


def prepended_bos_id(tokenizer) -> int | None:
    """The BOS id if the tokenizer puts one in front of text by itself (then the analysis does too)."""
    bos = tokenizer.bos_token_id
    return bos if bos is not None and tokenizer("a").input_ids[:1] == [bos] else None


def pattern_measures(baseline: list[torch.Tensor]) -> dict[str, Any]:
    """Mean attention distance (with its bucket distribution) and position-only share, per layer and head."""
    distances = [attention_distance(w) for w in baseline]
    shares = [position_only_share(w) for w in baseline]
    return {
        "attention_distance": {
            "metric": "mean t - s under the attention of query t (tokens), queries >= 1",
            "per_head": [d.per_head for d in distances],
            "layer_mean": [d.mean for d in distances],
            "mean": sum(d.mean for d in distances) / len(distances),
            "bucket_edges": distances[0].bucket_edges,
            "bucket_mass": [d.bucket_mass for d in distances],
        },
        "position_only_share": {
            "metric": "share of within-row logit variance explained by t - s alone (eta squared)",
            "per_head": [s.per_head for s in shares],
            "layer_mean": [s.mean for s in shares],
            "mean": sum(s.mean for s in shares) / len(shares),
        },
    }


def key_positions(length: int, count: int = KEY_SCALE_TOKENS) -> list[int]:
    """``count`` key positions spread over ``[1, length/2]``: each has at least half the window of later queries."""
    high = max(1, length // 2)
    return sorted({1 + round(i * (high - 1) / max(1, count - 1)) for i in range(count)})


@torch.no_grad()
def key_scale_sensitivity(
    layers: Sequence, baseline: list[torch.Tensor], progress: Callable[[int], Any], factor: float = KEY_SCALE_FACTOR
) -> dict[str, Any]:
    """Attention mass one token gains when only its key projection is scaled by ``factor`` (see module doc)."""
    positions = key_positions(baseline[0].shape[-1])
    signed, absolute = [], []
    for layer in layers:
        args, kwargs = layer.extra["inputs"]
        layer_signed, layer_abs = [], []
        for token in positions:

            def scale_one(_module, _inputs, output, token=token):
                output = output.clone()
                output[:, token] = output[:, token] * factor
                return output

            handle = layer.k_proj.register_forward_hook(scale_one)
            try:
                changed = attention_weights(layer.attention(*args, **kwargs), layer)
            finally:
                handle.remove()
            base = baseline[layer.index]
            layer_signed.append(token_mass_change(base, changed, token).per_head)
            layer_abs.append(token_mass_change(base, changed, token, absolute=True).per_head)
        signed.append(torch.tensor(layer_signed).mean(0).tolist())
        absolute.append(torch.tensor(layer_abs).mean(0).tolist())
        progress(1)

    def mean(rows: list[list[float]]) -> float:
        return sum(sum(r) for r in rows) / sum(len(r) for r in rows)

    return {
        "metric": f"attention mass a token gains from later queries when its k_proj output is scaled x{factor:g}",
        "factor": factor,
        "positions": positions,
        "per_head_gain": signed,
        "per_head_abs_change": absolute,
        "layer_mean_gain": [sum(r) / len(r) for r in signed],
        "layer_mean_abs_change": [sum(r) / len(r) for r in absolute],
        "mean_gain": mean(signed),
        "mean_abs_change": mean(absolute),
    }


def needle_prompt_ids(tokenizer, example, max_positions: int | None) -> tuple[list[int], list[str]]:
    """Token ids and kinds (bos/distractor/evidence/value/question); the value digits split out of the evidence.

    A prompt longer than ``max_positions`` loses distractor tokens from its start, so the answer position and
    the evidence always stay in.
    """
    head, _, tail = example.evidence.partition(example.answer)
    segments = [(k, t) for k, t in example.segments if k != "evidence"]
    at = [k for k, _ in example.segments].index("evidence")
    segments[at:at] = [("evidence", head), ("value", example.answer), ("evidence", tail)]
    ids: list[int] = []
    kinds: list[str] = []
    for kind, text in segments:
        piece = tokenizer(text, add_special_tokens=False).input_ids
        ids += piece
        kinds += [kind] * len(piece)
    bos = prepended_bos_id(tokenizer)
    limit = None if max_positions is None else max_positions - (bos is not None)
    if limit is not None and len(ids) > limit:
        cut = len(ids) - limit
        if any(k != "distractor" for k in kinds[:cut]):
            raise ValueError(f"a needle prompt of {len(ids)} tokens cannot be cut to {limit} without losing evidence.")
        ids, kinds = ids[cut:], kinds[cut:]
    if bos is not None:
        ids, kinds = [bos, *ids], ["bos", *kinds]
    return ids, kinds


def _keep_answer_row(layer, index: int, rows: list) -> Callable:
    """Hook: keep the attention row of the last position (the answer position), ``(heads, keys)``."""

    def hook(_module, _inputs, output) -> None:
        rows[index] = attention_weights(output, layer)[0, :, -1]

    return hook


def needle_prompts(
    tokenizer,
    lengths: Sequence[int],
    examples: int,
    seed: int,
    max_positions: int | None,
    skipped: list[dict],
    progress: Callable[[int], Any],
) -> Iterator[tuple[int, Iterator[tuple[list[int], list[str]]]]]:
    """Per context length, the ``(ids, kinds)`` of its needle prompts (``needle_prompt_ids``) that fit the model.

    A length over ``max_positions``, or a prompt whose evidence sits too early to be cut to it, is appended to
    ``skipped`` with the reason, and ``progress`` advances past it; the caller advances it for the prompts it runs.
    """
    from .tasks.needle import make_needle_examples

    def count(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False).input_ids)

    def fitting(length: int) -> Iterator[tuple[list[int], list[str]]]:
        for example in make_needle_examples(length, examples, seed=seed, count=count, depths=depths):
            try:
                prompt = needle_prompt_ids(tokenizer, example, max_positions)
            except ValueError as error:  # the evidence sits too early to cut the prompt to the model's length
                skipped.append({"length": length, "depth": example.depth, "reason": str(error)})
                progress(1)
                continue
            yield prompt

    depths = [(i + 0.5) / examples for i in range(examples)]
    for length in lengths:
        if max_positions is not None and length > max_positions:
            skipped.append({"length": length, "reason": f"exceeds max_position_embeddings={max_positions}"})
            progress(examples)
            continue
        yield length, fitting(length)


@torch.no_grad()
def answer_value_contrast(
    model,
    layers: Sequence,
    tokenizer,
    lengths: Sequence[int],
    examples: int,
    seed: int,
    max_positions: int | None,
    progress: Callable[[int], Any],
) -> dict[str, Any]:
    """Log2 lift of the needle's value tokens over distractor tokens, from the answer position, per length."""
    by_length: dict[str, Any] = {}
    skipped: list[dict] = []
    for length, prompts in needle_prompts(tokenizer, lengths, examples, seed, max_positions, skipped, progress):
        lifts, masses, sizes = [], [], []
        for ids, kinds in prompts:
            value = torch.tensor([k == "value" for k in kinds])
            distractor = torch.tensor([k == "distractor" for k in kinds])
            distractor[0] = False  # the sink (analysis 2) must not dilute the reference
            rows: list[torch.Tensor | None] = [None] * len(layers)
            handles = [
                layer.attention.register_forward_hook(_keep_answer_row(layer, n, rows))
                for n, layer in enumerate(layers)
            ]
            try:
                forward_without_cache(model, torch.tensor([ids], device=next(model.parameters()).device))
            finally:
                for handle in handles:
                    handle.remove()
            lifts.append([log2_lift(r.cpu(), value, distractor).per_head for r in rows])
            masses.append([r[:, value].sum(-1).cpu().tolist() for r in rows])
            sizes.append(len(ids))
            progress(1)
        if not sizes:
            continue
        lift = torch.tensor(lifts, dtype=torch.float64).mean(0)
        mass = torch.tensor(masses, dtype=torch.float64).mean(0)
        by_length[str(length)] = {
            "tokens_mean": round(sum(sizes) / len(sizes)),
            "examples": len(sizes),
            "per_head_log2_lift": lift.tolist(),
            "per_head_value_mass": mass.tolist(),
            "layer_mean_log2_lift": lift.mean(-1).tolist(),
            "mean_log2_lift": float(lift.mean()),
            "max_head_log2_lift": float(lift.max()),
            "mean_value_mass": float(mass.mean()),
        }
    return {
        "metric": "log2(attention per value token / attention per distractor token) from the answer position",
        "lengths": [int(k) for k in by_length],
        "by_length": by_length,
        "skipped": skipped,
    }


__all__ = [
    "answer_value_contrast",
    "key_positions",
    "key_scale_sensitivity",
    "needle_prompt_ids",
    "needle_prompts",
    "pattern_measures",
]
