"""Claims 2 and 4 on models trained on a synthetic task (``qkmap analyze --task mqar|salience``;
qkmap_lab/notes/synthetic-tasks.md).

On report-split sequences of the task (``qkmap_lab.synthetic``), from each answering position (MQAR: the
asked key in the query region; salience: the query token), whose next-token prediction is the answer:

- **evidence contrast** (claim 4): ``log2`` of the attention per token of the evidence (MQAR: the asked pair's key
  and value in the context, and any earlier query of the same key with its answer; salience: the highest-priority
  item) over the attention per token of the distractors (MQAR: the other pairs; salience: every other item), per
  layer and head (``attention_measures.log2_lift``, the one formula, which ``qkmap analyze``'s needle contrasts in
  ``diagnostics.contrast`` use too); the mean over heads and the best head per layer;
- **evidence key scale** (claim 2): the evidence key's ``k_proj`` output (MQAR: the asked key; salience: the
  answer item), at its context position only, scaled by each factor; reported are the attention mass the
  answering position puts on that key (mean over heads) before and after, and the share of answers that change
  and the accuracy after. QK-Norm divides a key's scale out; standard attention multiplies that key's logits;
  QK-MAP moves its phases.

Accuracy is the argmax at the answering position against the answer, as ``eval_accuracy`` in training.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from qkmap_hf.attention_measures import log2_lift
from qkmap_hf.diagnostics.hooks import attention_layers, attention_weights, use_eager_attention
from qkmap_hf.task_sources import DEFAULT_KEY_SCALES, DEFAULT_PROBE_EXAMPLES
from qkmap_lab.synthetic import MQARTask, SalienceTask, TaskDataset

PROBED_TASKS = (MQARTask.name, SalienceTask.name)


@dataclass(frozen=True)
class EvidenceLayout:
    """One answer of a sequence: where it is predicted, where its evidence and the distractors sit."""

    position: int  # the token whose next-token prediction is the answer
    evidence: tuple[int, ...]  # context positions of the evidence (the target of the contrast)
    distractors: tuple[int, ...]  # context positions of the distractors (its reference)
    key: int  # the evidence key whose scale the key-scale probe changes


def evidence_layouts(task, ids: np.ndarray) -> list[EvidenceLayout]:
    """The answers of one task sequence; MQAR has one per query, salience one."""
    if isinstance(task, MQARTask):
        context = len(ids) - 2 * task.queries
        key_positions = {
            int(ids[i]): i for i in range(context) if task.filler_vocab <= ids[i] < task.filler_vocab + task.key_vocab
        }
        layouts = []
        for position in range(context, len(ids), 2):
            asked = key_positions[int(ids[position])]
            # A key asked again (queries drawn with replacement) also has its earlier query-region pair as evidence:
            # an induction head may copy the value from there.
            repeats = tuple(p for q in range(context, position, 2) if ids[q] == ids[position] for p in (q, q + 1))
            others = tuple(p for k in key_positions.values() if k != asked for p in (k, k + 1))
            layouts.append(EvidenceLayout(position, (asked, asked + 1, *repeats), others, asked))
        return layouts
    if isinstance(task, SalienceTask):
        context = len(ids) - 2
        top = int(np.flatnonzero(ids[:context] == ids[context + 1])[0])  # the answer's rank occurs once
        return [EvidenceLayout(context, (top,), tuple(p for p in range(context) if p != top), top)]
    raise ValueError(f"task {task.name}: no evidence layout; the probes know {', '.join(PROBED_TASKS)}.")


def _batch(task, length: int, examples: int, seed: int) -> tuple[torch.Tensor, list[list[EvidenceLayout]]]:
    data = TaskDataset(task, length, examples, seed, "report")
    sequences = [data.example(i) for i in range(examples)]
    ids = torch.from_numpy(np.stack([s[0] for s in sequences]).astype(np.int64))
    return ids, [evidence_layouts(task, s[0]) for s in sequences]


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


def _answers_correct(logits: torch.Tensor, ids: torch.Tensor, layouts: list[list[EvidenceLayout]]) -> list[bool]:
    """Per answer: is the argmax at its answering position the answer token (as ``eval_accuracy`` in training)?"""
    return [
        int(logits[b, a.position].argmax()) == int(ids[b, a.position + 1]) for b, answers in enumerate(layouts)
        for a in answers
    ]  # fmt: skip


@torch.no_grad()
def task_accuracy(model, task, length: int, examples: int = 128, seed: int = 0, batch_size: int = 32) -> float:
    """Answer accuracy on ``examples`` report-split sequences of ``task`` at ``length`` (any length and instance,
    not only the one the model trained on: accuracy against the number of pairs and the length)."""
    model.eval()
    device = next(model.parameters()).device
    ids, layouts = _batch(task, length, examples, seed)
    correct: list[bool] = []
    for start in range(0, examples, batch_size):
        chunk = ids[start : start + batch_size]
        logits = model(input_ids=chunk.to(device), use_cache=False).logits.float().cpu()
        correct += _answers_correct(logits, chunk, layouts[start : start + batch_size])
    return float(np.mean(correct))


@torch.no_grad()
def task_probes(
    model,
    task,
    length: int,
    examples: int = DEFAULT_PROBE_EXAMPLES,
    seed: int = 0,
    key_scales: Sequence[float] = DEFAULT_KEY_SCALES,
) -> dict[str, Any]:
    """The evidence contrast and evidence key scale of a model on ``examples`` report-split task sequences."""
    if isinstance(task, MQARTask) and task.num_pairs < 2:
        raise ValueError("mqar probes need num_pairs >= 2: the contrast compares the asked pair with distractors.")
    use_eager_attention(model)
    model.eval()
    layers = attention_layers(model)
    ids, layouts = _batch(task, length, examples, seed)
    logits, weights = _forward(model, ids, layers)
    lifts = []  # (answers, layers, heads)
    for b, answers in enumerate(layouts):
        for answer in answers:
            target = torch.zeros(length, dtype=torch.bool)
            target[list(answer.evidence)] = True
            reference = torch.zeros(length, dtype=torch.bool)
            reference[list(answer.distractors)] = True
            lifts.append([log2_lift(w[b, :, answer.position], target, reference).per_head for w in weights])
    correct = _answers_correct(logits, ids, layouts)
    lift = torch.tensor(lifts, dtype=torch.float64).mean(0)  # (layers, heads)
    first = [answers[0] for answers in layouts]  # one answer per sequence for the key-scale test
    base_mass = _mass_on_key(weights, first)
    base_answers = torch.tensor([int(logits[b, a.position].argmax()) for b, a in enumerate(first)])
    truth = torch.tensor([int(ids[b, a.position + 1]) for b, a in enumerate(first)])
    scaled = {}
    for factor in key_scales:
        scaled_logits, scaled_weights = _forward(model, ids, layers, ([a.key for a in first], factor))
        new_answers = torch.tensor([int(scaled_logits[b, a.position].argmax()) for b, a in enumerate(first)])
        mass = _mass_on_key(scaled_weights, first)
        scaled[f"{factor:g}"] = {
            "layer_key_mass": mass,
            "layer_key_mass_change": [m - b for m, b in zip(mass, base_mass, strict=True)],
            "answers_changed": float((new_answers != base_answers).float().mean()),
            "accuracy": float((new_answers == truth).float().mean()),
        }
    return {
        "task": task.name,
        "length": length,
        "examples": examples,
        "accuracy": float(np.mean(correct)),
        "evidence_contrast": {
            "metric": "log2(attention per token of the evidence / per token of the distractors) from the answering "
            "position",
            "per_head_log2_lift": lift.tolist(),
            "layer_mean_log2_lift": lift.mean(-1).tolist(),
            "layer_best_head_log2_lift": lift.max(-1).values.tolist(),
            "mean_log2_lift": float(lift.mean()),
            "best_head_log2_lift": float(lift.max()),
        },
        "evidence_key_scale": {
            "metric": "the evidence key's k_proj output scaled at its position: mass the answering position puts "
            "on it, answers",
            "layer_key_mass": base_mass,
            "accuracy_first_query": float((base_answers == truth).float().mean()),
            "by_factor": scaled,
        },
    }


def _mass_on_key(weights: list[torch.Tensor], answers: list[EvidenceLayout]) -> list[float]:
    """Per layer, the mean over sequences and heads of the attention the answering position puts on the key."""
    return [
        float(torch.stack([w[b, :, a.position, a.key].mean() for b, a in enumerate(answers)]).mean()) for w in weights
    ]


__all__ = [
    "DEFAULT_KEY_SCALES",
    "PROBED_TASKS",
    "EvidenceLayout",
    "evidence_layouts",
    "task_accuracy",
    "task_probes",
]
