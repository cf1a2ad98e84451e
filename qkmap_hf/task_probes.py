"""Claims 2 and 4 on models trained on a synthetic task (``qkmap analyze --task mqar``; docs/synthetic-tasks.md).

On MQAR sequences of the report split (``qkmap_hf.training.synthetic``), from each query position (the asked key
in the query region, which predicts the value):

- **evidence contrast** (claim 4): ``log2`` of the attention per token of the asked pair (its key and value in the
  context) over the attention per token of the distractor pairs, per layer and head (``attention_measures.log2_lift``,
  the one formula, which ``qkmap analyze``'s needle contrasts in ``diagnostics.contrast`` use too); the mean over
  heads and the best head per layer;
- **evidence key scale** (claim 2): the asked key's ``k_proj`` output, at its context position only, scaled by
  each factor; reported are the attention mass the query puts on that key (mean over heads) before and after, and
  the share of answers that change and the accuracy after. QK-Norm divides a key's scale out; standard attention
  multiplies that key's logits; QK-MAP moves its phases.

Accuracy is the argmax at the query position against the asked value, as ``eval_accuracy`` in training.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from .attention_measures import log2_lift
from .diagnostics.hooks import attention_layers, attention_weights, use_eager_attention
from .training.synthetic import MQARTask, TaskDataset

DEFAULT_KEY_SCALES = (0.5, 2.0)


def mqar_layout(task: MQARTask, ids: np.ndarray) -> list[tuple[int, int, list[int]]]:
    """Per query: ``(query position, asked key's context position, distractor keys' context positions)``."""
    context = len(ids) - 2 * task.queries
    key_positions = {
        int(ids[i]): i for i in range(context) if task.filler_vocab <= ids[i] < task.filler_vocab + task.key_vocab
    }
    layout = []
    for position in range(context, len(ids), 2):
        asked = key_positions[int(ids[position])]
        layout.append((position, asked, [p for p in key_positions.values() if p != asked]))
    return layout


def _batch(task: MQARTask, length: int, examples: int, seed: int) -> tuple[torch.Tensor, list]:
    data = TaskDataset(task, length, examples, seed, "report")
    sequences = [data.example(i) for i in range(examples)]
    ids = torch.from_numpy(np.stack([s[0] for s in sequences]).astype(np.int64))
    return ids, [mqar_layout(task, s[0]) for s in sequences]


@torch.no_grad()
def _forward(model, ids: torch.Tensor, layers, scale: tuple[list[int], float] | None = None):
    """Logits and every layer's attention weights; ``scale = (positions per sequence, factor)`` scales those keys."""
    weights: list[torch.Tensor | None] = [None] * len(layers)
    handles = []
    for index, layer in enumerate(layers):

        def keep(_module, _inputs, output, index=index, layer=layer):
            weights[index] = attention_weights(output, layer).cpu()

        handles.append(layer.attention.register_forward_hook(keep))
        if scale is not None:
            positions, factor = scale

            def scale_key(_module, _inputs, output, positions=positions, factor=factor):
                output = output.clone()
                rows = torch.arange(output.shape[0])
                output[rows, positions] = output[rows, positions] * factor
                return output

            handles.append(layer.k_proj.register_forward_hook(scale_key))
    try:
        device = next(model.parameters()).device
        logits = model(input_ids=ids.to(device), use_cache=False).logits.float().cpu()
    finally:
        for handle in handles:
            handle.remove()
    return logits, weights


@torch.no_grad()
def mqar_probes(
    model,
    task: MQARTask,
    length: int,
    examples: int = 32,
    seed: int = 0,
    key_scales: Sequence[float] = DEFAULT_KEY_SCALES,
) -> dict[str, Any]:
    """The evidence contrast and evidence key scale of a model on ``examples`` report-split MQAR sequences."""
    if task.num_pairs < 2:
        raise ValueError("mqar probes need num_pairs >= 2: the contrast compares the asked pair with distractors.")
    use_eager_attention(model)
    model.eval()
    layers = attention_layers(model)
    ids, layouts = _batch(task, length, examples, seed)
    logits, weights = _forward(model, ids, layers)
    lifts = []  # (queries, layers, heads)
    correct = []
    for b, layout in enumerate(layouts):
        for query, asked, distractors in layout:
            target = torch.zeros(length, dtype=torch.bool)
            target[[asked, asked + 1]] = True
            reference = torch.zeros(length, dtype=torch.bool)
            reference[[p for d in distractors for p in (d, d + 1)]] = True
            lifts.append([log2_lift(w[b, :, query], target, reference).per_head for w in weights])
            correct.append(int(logits[b, query].argmax()) == int(ids[b, query + 1]))
    lift = torch.tensor(lifts, dtype=torch.float64).mean(0)  # (layers, heads)
    first = [layout[0] for layout in layouts]  # one query per sequence for the key-scale test
    base_mass = _mass_on_key(weights, first)
    base_answers = torch.tensor([int(logits[b, q].argmax()) for b, (q, _, _) in enumerate(first)])
    answers = torch.tensor([int(ids[b, q + 1]) for b, (q, _, _) in enumerate(first)])
    scaled = {}
    for factor in key_scales:
        scaled_logits, scaled_weights = _forward(model, ids, layers, ([a for _, a, _ in first], factor))
        new_answers = torch.tensor([int(scaled_logits[b, q].argmax()) for b, (q, _, _) in enumerate(first)])
        mass = _mass_on_key(scaled_weights, first)
        scaled[f"{factor:g}"] = {
            "layer_key_mass": mass,
            "layer_key_mass_change": [m - b for m, b in zip(mass, base_mass, strict=True)],
            "answers_changed": float((new_answers != base_answers).float().mean()),
            "accuracy": float((new_answers == answers).float().mean()),
        }
    return {
        "task": task.name,
        "length": length,
        "examples": examples,
        "accuracy": float(np.mean(correct)),
        "evidence_contrast": {
            "metric": "log2(attention per token of the asked pair / per token of distractor pairs) from the query",
            "per_head_log2_lift": lift.tolist(),
            "layer_mean_log2_lift": lift.mean(-1).tolist(),
            "layer_best_head_log2_lift": lift.max(-1).values.tolist(),
            "mean_log2_lift": float(lift.mean()),
            "best_head_log2_lift": float(lift.max()),
        },
        "evidence_key_scale": {
            "metric": "the asked key's k_proj output scaled at its position: mass the query puts on it, answers",
            "layer_key_mass": base_mass,
            "accuracy_first_query": float((base_answers == answers).float().mean()),
            "by_factor": scaled,
        },
    }


def _mass_on_key(weights: list[torch.Tensor], queries: list[tuple[int, int, list[int]]]) -> list[float]:
    """Per layer, the mean over sequences and heads of the attention the query puts on the asked key."""
    return [float(torch.stack([w[b, :, q, a].mean() for b, (q, a, _) in enumerate(queries)]).mean()) for w in weights]


__all__ = ["DEFAULT_KEY_SCALES", "mqar_layout", "mqar_probes"]
