"""The probe inputs of the needle contrasts: the synthetic long-context task's prompts as token ids and kinds.

The measures themselves are units of ``qkmap_hf.diagnostics`` (``diagnostics.contrast`` turns these prompts into
log2 lifts); this module stays above them because it builds its prompts from ``qkmap_hf.tasks.needle``. The
attention plumbing of the probes (``AttentionLayer``, ``attention_layers``, ``attention_weights``...) lives in
``diagnostics.hooks`` and is named here too, where older code imports it from.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

from .diagnostics.hooks import (
    AttentionLayer,
    attention_layers,
    attention_weights,
    forward_without_cache,
    prepended_bos_id,
    use_eager_attention,
)
from .diagnostics.key_scale import KEY_SCALE_FACTOR, KEY_SCALE_TOKENS, key_positions


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


__all__ = [
    "KEY_SCALE_FACTOR",
    "KEY_SCALE_TOKENS",
    "AttentionLayer",
    "attention_layers",
    "attention_weights",
    "forward_without_cache",
    "key_positions",
    "needle_prompt_ids",
    "needle_prompts",
    "prepended_bos_id",
    "use_eager_attention",
]
