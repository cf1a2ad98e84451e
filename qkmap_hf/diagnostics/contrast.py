"""Needle contrasts: the one loop that turns needle prompts into per-head ``log2`` lifts of attention.

Two contrasts of ``qkmap analyze`` run through it, each a ``ContrastKind``:

- ``evidence``: from the question tokens to the evidence sentence (the value included), attention per evidence
  token over attention per distractor token, averaged over the question rows;
- ``answer``: from the answer position (the last prompt token, which predicts the answer) to the value's tokens.
  Unlike the question, the value digits share no words with anything before them, so lexical overlap cannot
  produce this contrast.

Token 0 is left out of the distractors so that the attention sink does not dilute the reference. The lift itself
is ``attention_measures.log2_lift``, which the MQAR evidence contrast (the lab's task probes) uses too. The
prompts (``(ids, kinds)`` per context length) are the probe inputs: ``attention_probes.needle_prompts`` builds
them from the synthetic task, so this unit needs nothing of it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..attention_measures import log2_lift
from .base import Headline, average, mean2, row_means
from .hooks import AttentionLayer, attention_weights, forward_without_cache

Prompt = tuple[list[int], list[str]]


@dataclass(frozen=True)
class ContrastKind:
    """Which rows look, at which tokens, and how the JSON names the target's mass."""

    key: str  # the entry in analysis.json
    metric: str
    mass: str  # per_head_{mass}_mass, mean_{mass}_mass
    targets: tuple[str, ...]  # token kinds the rows should prefer
    from_question: bool  # rows: the question tokens (True) or the last position

    def query_rows(self, kinds: list[str]) -> torch.Tensor:
        if self.from_question:
            return torch.tensor([k == "question" for k in kinds]).nonzero().flatten()
        return torch.tensor([len(kinds) - 1])


EVIDENCE = ContrastKind(
    "evidence_contrast",
    "log2(attention per evidence token / attention per distractor token), from question tokens",
    "evidence",
    ("evidence", "value"),
    True,
)
ANSWER = ContrastKind(
    "answer_contrast",
    "log2(attention per value token / attention per distractor token) from the answer position",
    "value",
    ("value",),
    False,
)
KINDS = {kind.key: kind for kind in (EVIDENCE, ANSWER)}


@dataclass
class ContrastAtLength:
    """One context length: per-layer, per-head lift and target mass, averaged over its examples."""

    tokens_mean: int
    examples: int
    per_head_log2_lift: list[list[float]]
    per_head_mass: list[list[float]]

    @property
    def mean_log2_lift(self) -> float:
        return mean2(self.per_head_log2_lift)

    @property
    def max_head_log2_lift(self) -> float:
        return max(max(r) for r in self.per_head_log2_lift)

    @property
    def mean_mass(self) -> float:
        return mean2(self.per_head_mass)

    def to_dict(self, mass: str) -> dict[str, Any]:
        return {
            "tokens_mean": self.tokens_mean,
            "examples": self.examples,
            "per_head_log2_lift": self.per_head_log2_lift,
            f"per_head_{mass}_mass": self.per_head_mass,
            "layer_mean_log2_lift": row_means(self.per_head_log2_lift),
            "mean_log2_lift": self.mean_log2_lift,
            "max_head_log2_lift": self.max_head_log2_lift,
            f"mean_{mass}_mass": self.mean_mass,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any], mass: str) -> ContrastAtLength:
        return cls(data["tokens_mean"], data["examples"], data["per_head_log2_lift"], data[f"per_head_{mass}_mass"])


@dataclass
class NeedleContrast:
    """A contrast per context length (keyed by the requested length), and the lengths or prompts skipped."""

    kind: ContrastKind
    by_length: dict[str, ContrastAtLength] = field(default_factory=dict)
    skipped: list[dict] = field(default_factory=list)

    @property
    def KEY(self) -> str:  # noqa: N802 - the same name as the other results' class constant
        return self.kind.key

    @property
    def lengths(self) -> list[int]:
        return [int(k) for k in self.by_length]

    def at(self, length: int) -> ContrastAtLength | None:
        return self.by_length.get(str(length))

    @property
    def headline(self) -> Headline:
        longest = self.by_length[str(max(self.lengths))] if self.by_length else None
        return Headline(f"{self.kind.mass} log2 lift at the longest length",
                        longest.mean_log2_lift if longest else None, "log2")  # fmt: skip

    def to_dict(self) -> dict[str, Any]:
        return {
            "metric": self.kind.metric,
            "lengths": self.lengths,
            "by_length": {k: v.to_dict(self.kind.mass) for k, v in self.by_length.items()},
            "skipped": self.skipped,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any], kind: ContrastKind = EVIDENCE) -> NeedleContrast:
        by_length = {k: ContrastAtLength.from_dict(v, kind.mass) for k, v in data["by_length"].items()}
        return cls(kind, by_length, list(data.get("skipped", [])))

    def plot(self, path: Path, label: str) -> Path | None:
        from .plots import heatmaps

        if not self.by_length:
            return None
        panels = [(f"{v.tokens_mean} tokens", v.per_head_log2_lift) for v in self.by_length.values()]
        title = f"{label}: log2 {self.kind.mass}/distractor attention per token"
        return heatmaps(path, title, panels, diverging=True)


def evidence_from_dict(data: dict[str, Any]) -> NeedleContrast:
    return NeedleContrast.from_dict(data, EVIDENCE)


def answer_from_dict(data: dict[str, Any]) -> NeedleContrast:
    return NeedleContrast.from_dict(data, ANSWER)


def _keep_rows(layer: AttentionLayer, queries: torch.Tensor, rows: list) -> Callable:
    """Hook: keep only the query rows of one layer, ``(heads, queries, keys)``, on the CPU."""

    def hook(_module, _inputs, output) -> None:
        weights = attention_weights(output, layer)[0]
        rows[layer.index] = weights[:, queries.to(weights.device)].cpu()

    return hook


@torch.no_grad()
def prompt_contrast(
    model: nn.Module, layers: list[AttentionLayer], ids: list[int], kinds: list[str], kind: ContrastKind
) -> tuple[list[list[float]], list[list[float]]]:
    """One prompt: per layer, per head ``log2_lift`` of the kind's targets over distractors, and the target mass."""
    target = torch.tensor([k in kind.targets for k in kinds])
    distractor = torch.tensor([k == "distractor" for k in kinds])
    distractor[0] = False  # the sink must not dilute the reference
    queries = kind.query_rows(kinds)
    rows: list[torch.Tensor | None] = [None] * len(layers)
    handles = [layer.attention.register_forward_hook(_keep_rows(layer, queries, rows)) for layer in layers]
    try:
        forward_without_cache(model, torch.tensor([ids], device=next(model.parameters()).device))
    finally:
        for handle in handles:
            handle.remove()
    lifts = [log2_lift(r, target, distractor).per_head for r in rows]  # type: ignore[arg-type]
    masses = [r[..., target].sum(-1).double().mean(-1).tolist() for r in rows]  # type: ignore[index]
    return lifts, masses


def measure(
    model: nn.Module,
    layers: list[AttentionLayer],
    prompts: Iterable[tuple[int, Iterable[Prompt]]],
    kind: ContrastKind = EVIDENCE,
    progress: Callable[[int], Any] = lambda _n: None,
    skipped: list[dict] | None = None,
) -> NeedleContrast:
    """The contrast over ``(length, prompts)`` pairs; ``skipped`` is the list the prompt source reports into."""
    result = NeedleContrast(kind, skipped=skipped if skipped is not None else [])
    for length, examples in prompts:
        lifts, masses, sizes = [], [], []
        for ids, kinds in examples:
            lift, mass = prompt_contrast(model, layers, ids, kinds, kind)
            lifts.append(lift)
            masses.append(mass)
            sizes.append(len(ids))
            progress(1)
        if sizes:
            result.by_length[str(length)] = ContrastAtLength(
                round(sum(sizes) / len(sizes)), len(sizes), average(lifts), average(masses)
            )
    return result


__all__ = [
    "ANSWER",
    "EVIDENCE",
    "KINDS",
    "ContrastAtLength",
    "ContrastKind",
    "NeedleContrast",
    "answer_from_dict",
    "evidence_from_dict",
    "measure",
    "prompt_contrast",
]
