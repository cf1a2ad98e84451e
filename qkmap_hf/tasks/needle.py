"""Synthetic long-context evidence retrieval: a fact hidden in real distractor text, then a question about it.

The paper's third analysis measures attention contrast on the evidence in this setting. One generator serves
both the lm-eval tasks (lengths in words, tokenizer-free, so the data is the same for every model) and
``qkmap analyze`` (lengths in tokens of the model's tokenizer, through ``count``), and it returns the prompt in
segments so the analysis knows exactly which tokens are evidence, distractor and question.

Distractor text: speech lines of *Julius Caesar* (``data/haystack.txt``). Fact: "The secret number of the
<adjective> <noun> is <4 digits>." Question: "What is the secret number of the <adjective> <noun>?", answered by
choosing among the true number and three others that do not occur in the prompt.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache

from . import data_file

ADJECTIVES = (
    "amber", "ancient", "bitter", "brazen", "crimson", "distant", "gentle", "golden", "hollow", "iron",
    "ivory", "lonely", "marble", "northern", "quiet", "scarlet", "silent", "silver", "velvet", "wooden",
)  # fmt: skip
NOUNS = (
    "anchor", "banner", "bridge", "candle", "castle", "chalice", "compass", "crown", "door", "falcon",
    "garden", "harbor", "lantern", "mirror", "orchard", "raven", "river", "sword", "tower", "window",
)  # fmt: skip
QUESTION = "Question: What is the secret number of the {key}?\nAnswer:"
EVIDENCE = "The secret number of the {key} is {value}.\n"


def word_count(text: str) -> int:
    """Length unit of the lm-eval tasks: whitespace-separated words."""
    return len(text.split())


@lru_cache(maxsize=1)
def haystack_lines() -> tuple[str, ...]:
    """The distractor lines (real text), in play order."""
    lines = data_file("haystack.txt").read_text(encoding="utf-8").splitlines()
    return tuple(line for line in lines if line.strip())


@dataclass(frozen=True)
class NeedleExample:
    """One prompt in four segments: distractors, the evidence sentence, more distractors, the question."""

    prefix: str
    evidence: str
    suffix: str
    question: str
    key: str
    answer: str
    choices: tuple[str, ...]
    label: int
    depth: float
    length: int  # prompt length in the units of the `count` it was made with

    @property
    def prompt(self) -> str:
        return self.prefix + self.evidence + self.suffix + self.question

    @property
    def segments(self) -> list[tuple[str, str]]:
        """``(kind, text)`` with kind in distractor/evidence/question; concatenated they give ``prompt``."""
        parts = [("distractor", self.prefix), ("evidence", self.evidence), ("distractor", self.suffix)]
        return [(kind, text) for kind, text in parts if text] + [("question", self.question)]

    def to_doc(self) -> dict:
        """The lm-eval document (multiple choice over ``choices``, target index ``label``)."""
        return {
            "prompt": self.prompt,
            "choices": list(self.choices),
            "label": self.label,
            "answer": self.answer,
            "depth": self.depth,
            "length": self.length,
        }


def make_needle_example(
    length: int,
    rng: random.Random,
    *,
    depth: float | None = None,
    count: Callable[[str], int] = word_count,
    key: str | None = None,
    haystack: Sequence[str] | None = None,
) -> NeedleExample:
    """One example whose prompt measures about ``length`` units of ``count`` (at least the fact and question).

    ``depth`` in [0, 1] places the evidence among the distractor lines (default: uniform in [0.1, 0.9]).
    """
    if length <= 0:
        raise ValueError(f"needle length={length} must be positive.")
    lines = haystack if haystack is not None else haystack_lines()
    key = key or f"{rng.choice(ADJECTIVES)} {rng.choice(NOUNS)}"
    value = rng.randrange(1000, 10000)
    others: set[int] = set()
    while len(others) < 3:
        candidate = rng.randrange(1000, 10000)
        if candidate != value:
            others.add(candidate)
    evidence = EVIDENCE.format(key=key, value=value)
    question = QUESTION.format(key=key)
    budget = length - count(evidence) - count(question)
    chosen: list[str] = []
    used = 0
    start = rng.randrange(len(lines))
    while used < budget:
        line = lines[(start + len(chosen)) % len(lines)] + "\n"
        chosen.append(line)
        used += count(line)
        if len(chosen) > 10 * len(lines):
            raise ValueError(f"count() returns no length for the distractor text; cannot reach length={length}.")
    depth = rng.uniform(0.1, 0.9) if depth is None else min(max(depth, 0.0), 1.0)
    split = round(depth * len(chosen))
    prefix, suffix = "".join(chosen[:split]), "".join(chosen[split:])
    choices = [str(v) for v in sorted(others)]
    label = rng.randrange(4)
    choices.insert(label, str(value))
    prompt_length = count(prefix) + count(evidence) + count(suffix) + count(question)
    return NeedleExample(
        prefix=prefix,
        evidence=evidence,
        suffix=suffix,
        question=question,
        key=key,
        answer=str(value),
        choices=tuple(choices),
        label=label,
        depth=split / len(chosen) if chosen else 0.0,
        length=prompt_length,
    )


def make_needle_examples(
    length: int,
    num_examples: int,
    *,
    seed: int = 0,
    count: Callable[[str], int] = word_count,
    depths: Sequence[float] | None = None,
) -> list[NeedleExample]:
    """``num_examples`` examples of about ``length`` units, reproducible from ``seed`` (and ``length``).

    ``depths`` cycles through fixed evidence depths (the analysis uses evenly spaced ones); default random.
    """
    rng = random.Random(f"qkmap-needle-{seed}-{length}")
    return [
        make_needle_example(length, rng, count=count, depth=None if depths is None else depths[i % len(depths)])
        for i in range(num_examples)
    ]


__all__ = ["NeedleExample", "haystack_lines", "make_needle_example", "make_needle_examples", "word_count"]
