"""Synthetic tasks where position carries no information (``qkmap compare --task``; qkmap_lab/notes/synthetic-tasks.md).

On natural text at small scale a recency prior explains QK-MAP's whole measured gain, so text cannot tell magnitude
encoding apart from position. In these tasks the evidence sits at a uniform random depth: a gain must come from
what the queries and keys encode.

- ``mqar``: multi-query associative recall (Arora et al. 2023, "Zoology"). ``num_pairs`` key-value pairs are
  scattered, each at a uniform random depth, over filler tokens; the last ``2 * num_queries`` tokens ask for keys
  (``key value``, the value being the answer). Keys of a sequence are distinct; so are the asked keys unless
  ``num_queries > num_pairs``, which asks keys with replacement (with every pair asked once, the last answer can be
  had by elimination, without matching a key: qkmap_lab/notes/synthetic-tasks.md). ``copy_warmup=N`` makes the first ``N``
  training sequences ``copy`` sequences, a curriculum: the induction head that dense copying forms within ~1000
  steps answers MQAR, while MQAR's one or two labels per sequence did not form it here in 20,000 steps.
- ``copy``: a random chunk repeated after a random gap, every repeated token after the first a label: dense
  content-based copying (induction), the curriculum of ``mqar:copy_warmup``.
- ``salience``: every item token has a hidden priority (a fixed random ranking of the ``levels`` items, the same in
  every split: it is the task); the answer after the query token is the highest-priority item seen. The answer's
  level is uniform over the top three quarters of the ranking and its position uniform over the context, so that
  neither recency nor a coarse reading of the priority (aliased phases) solves it.

A task is ``NAME[:field=value,...]`` (e.g. ``mqar:num_pairs=4``). Sequences are generated on the fly: the example
``i`` of a split is a pure function of ``(seed, split, i)``, and the training, tuning and report splits draw from
disjoint seed streams. Only answer positions carry labels (``-100`` elsewhere), so the loss and
``eval_accuracy`` (argmax at the answer positions) are about the task alone. Token ids fit the byte-level
vocabulary (257) that the size presets train with.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, ClassVar

import numpy as np
import torch
from torch.utils.data import Dataset

IGNORE_INDEX = -100
SPLITS = {"train": 0, "tune": 1, "report": 2}


class SyntheticTask:
    """What every task has: ``check(length)``, ``sequence(rng, length)``; ``training_sequence`` is ``sequence``
    unless the task has a curriculum (the training split's sequence ``index`` may then differ)."""

    @property
    def curriculum(self) -> bool:
        """Whether ``training_sequence`` depends on ``index`` (the training split must then be read in order)."""
        return False

    def training_sequence(self, rng: np.random.Generator, length: int, index: int) -> tuple[np.ndarray, np.ndarray]:
        return self.sequence(rng, length)


@dataclass(frozen=True)
class MQARTask(SyntheticTask):
    """Multi-query associative recall; ids: filler ``[0, 64)``, keys ``[64, 128)``, values ``[128, 192)``."""

    name: ClassVar[str] = "mqar"
    num_pairs: int = 2
    num_queries: int | None = None  # default: every pair is asked for; more than num_pairs: with replacement
    key_vocab: int = 64
    value_vocab: int = 64
    filler_vocab: int = 64
    copy_warmup: int | None = None  # training sequences of dense copying (``copy``) before MQAR's; None: none

    @property
    def queries(self) -> int:
        return self.num_pairs if self.num_queries is None else self.num_queries

    def check(self, length: int) -> None:
        if not (self.queries >= 1 and 1 <= self.num_pairs <= self.key_vocab):
            raise ValueError(
                f"task mqar: need num_queries >= 1 ({self.queries}) and 1 <= num_pairs ({self.num_pairs}) <= "
                f"key_vocab ({self.key_vocab})."
            )
        if (length - 2 * self.queries) // 2 < self.num_pairs:
            raise ValueError(f"task mqar: block {length} cannot hold {self.num_pairs} pairs and their queries.")
        if self.filler_vocab + self.key_vocab + self.value_vocab > 256:
            raise ValueError("task mqar: filler_vocab + key_vocab + value_vocab must be at most 256 (byte ids).")
        if self.copy_warmup is not None:
            if self.copy_warmup < 0:
                raise ValueError(f"task mqar: copy_warmup={self.copy_warmup} must be >= 0 (training sequences).")
            self.warmup_task().check(length)

    def warmup_task(self) -> CopyTask:
        """The ``copy`` task of the curriculum, over every id MQAR uses."""
        return CopyTask(vocab=self.filler_vocab + self.key_vocab + self.value_vocab)

    @property
    def curriculum(self) -> bool:
        return bool(self.copy_warmup)

    def training_sequence(self, rng: np.random.Generator, length: int, index: int) -> tuple[np.ndarray, np.ndarray]:
        """Training sequence ``index``: a ``copy`` sequence while ``index < copy_warmup``, else an MQAR one."""
        if self.copy_warmup is not None and index < self.copy_warmup:
            return self.warmup_task().sequence(rng, length)
        return self.sequence(rng, length)

    def sequence(self, rng: np.random.Generator, length: int) -> tuple[np.ndarray, np.ndarray]:
        key_base, value_base = self.filler_vocab, self.filler_vocab + self.key_vocab
        ids = rng.integers(0, self.filler_vocab, size=length)
        labels = np.full(length, IGNORE_INDEX)
        keys = rng.choice(self.key_vocab, size=self.num_pairs, replace=False) + key_base
        values = rng.integers(0, self.value_vocab, size=self.num_pairs) + value_base
        context = length - 2 * self.queries
        slots = np.sort(rng.choice(context // 2, size=self.num_pairs, replace=False))
        # A uniform depth per pair: its slot is uniform, and an odd context leaves the last token to filler.
        ids[2 * slots], ids[2 * slots + 1] = keys, values
        asked = rng.choice(self.num_pairs, size=self.queries, replace=self.queries > self.num_pairs)
        query_positions = context + 2 * np.arange(self.queries)
        ids[query_positions], ids[query_positions + 1] = keys[asked], values[asked]
        labels[query_positions + 1] = values[asked]
        return ids, labels


@dataclass(frozen=True)
class CopyTask(SyntheticTask):
    """Dense content-based copying: a random ``chunk`` of ids in ``[0, vocab)`` repeated after a random gap, among
    random ids; every repeated token after the first is a label (the first cannot be predicted)."""

    name: ClassVar[str] = "copy"
    chunk: int = 16
    vocab: int = 192

    def check(self, length: int) -> None:
        if not (self.chunk >= 2 and 2 <= self.vocab <= 256):
            raise ValueError(f"task copy: need chunk >= 2 ({self.chunk}) and 2 <= vocab ({self.vocab}) <= 256.")
        if length < 2 * self.chunk:
            raise ValueError(f"task copy: block {length} cannot hold a chunk of {self.chunk} twice.")

    def sequence(self, rng: np.random.Generator, length: int) -> tuple[np.ndarray, np.ndarray]:
        ids = rng.integers(0, self.vocab, size=length)
        labels = np.full(length, IGNORE_INDEX)
        gap = int(rng.integers(0, length - 2 * self.chunk + 1))
        start = int(rng.integers(0, length - 2 * self.chunk - gap + 1))
        repeat = start + self.chunk + gap
        ids[repeat : repeat + self.chunk] = ids[start : start + self.chunk]
        labels[repeat + 1 : repeat + self.chunk] = ids[repeat + 1 : repeat + self.chunk]
        return ids, labels


@dataclass(frozen=True)
class SalienceTask(SyntheticTask):
    """Highest-priority item; ids: items ``[0, levels)``, the query token ``levels``."""

    name: ClassVar[str] = "salience"
    levels: int = 128
    ranking_seed: int = 0  # the task's fixed priority ranking, the same for every split

    def check(self, length: int) -> None:
        if not 4 <= self.levels <= 255:
            raise ValueError(f"task salience: levels={self.levels} must lie in [4, 255] (byte ids, plus the query).")
        if length < 3:
            raise ValueError(f"task salience: block {length} needs at least one item, the query and the answer.")

    def priority(self) -> np.ndarray:
        """``priority[item]``: the item's rank (0 lowest), a fixed permutation."""
        return np.random.default_rng(self.ranking_seed).permutation(self.levels)

    def sequence(self, rng: np.random.Generator, length: int) -> tuple[np.ndarray, np.ndarray]:
        priority = self.priority()
        item_of_rank = np.argsort(priority)
        context = length - 2
        top = int(rng.integers(self.levels // 4, self.levels))  # the answer's rank
        ranks = rng.integers(0, top, size=context)
        ranks[rng.integers(0, context)] = top
        ids = np.empty(length, dtype=np.int64)
        ids[:context] = item_of_rank[ranks]
        answer = item_of_rank[top]
        ids[context], ids[context + 1] = self.levels, answer
        labels = np.full(length, IGNORE_INDEX)
        labels[context + 1] = answer
        return ids, labels


TASKS: dict[str, type] = {task.name: task for task in (MQARTask, SalienceTask, CopyTask)}


def parse_task(spec: str):
    """``NAME[:field=value,...]`` -> a task object; the error lists the tasks or the task's fields."""
    from qkmap_hf.flags import parse_overrides

    name, _, options = spec.partition(":")
    if name not in TASKS:
        raise ValueError(f"--task {spec!r}: unknown task {name!r}; choose one of: {', '.join(TASKS)}.")
    cls = TASKS[name]
    values = parse_overrides([item for item in options.split(",") if item.strip()]) if options else {}
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"--task {spec!r}: {', '.join(unknown)} not a field of {name} ({', '.join(sorted(known))}).")
    return cls(**values)


def task_spec(task) -> str:
    """The canonical ``NAME:field=value,...`` of a task (every set field, so a record says exactly what ran; a field
    left at None is left out, so that ``parse_task`` reads the spec back to the same task)."""
    return f"{task.name}:" + ",".join(f"{k}={v}" for k, v in asdict(task).items() if v is not None)


class TaskDataset(Dataset):
    """``count`` sequences of ``task`` for one split, generated on demand from ``(seed, split, index)``."""

    def __init__(self, task, length: int, count: int, seed: int, split: str):
        task.check(length)
        self.task, self.length, self.count, self.seed, self.split = task, length, count, seed, split

    def __len__(self) -> int:
        return self.count

    def example(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        if not 0 <= index < self.count:
            raise IndexError(index)
        rng = np.random.default_rng([self.seed, SPLITS[self.split], index])
        if self.split == "train":
            return self.task.training_sequence(rng, self.length, index)
        return self.task.sequence(rng, self.length)

    @property
    def ordered(self) -> bool:
        """Whether the Trainer must read it in order (``QKMapTrainer``): a training split with a curriculum. Other
        splits need no shuffling either (every example is an independent draw) but keep the default sampler."""
        return self.split == "train" and self.task.curriculum

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids, labels = self.example(index)
        return {
            "input_ids": torch.from_numpy(ids.astype(np.int64)),
            "labels": torch.from_numpy(labels.astype(np.int64)),
        }


def heldout_dataset(task, length: int, blocks_per_split: int, seed: int):
    """The held-out set as one ``PackedDataset``: the tuning split's blocks, then the report split's (halves, as
    ``sweep.split_heldout`` cuts them), each from its own seed stream."""
    from qkmap_hf.training.data import PackedDataset

    parts = [TaskDataset(task, length, blocks_per_split, seed, split) for split in ("tune", "report")]
    examples = [part.example(i) for part in parts for i in range(len(part))]
    ids = torch.from_numpy(np.stack([e[0] for e in examples]).astype(np.int64))
    labels = torch.from_numpy(np.stack([e[1] for e in examples]).astype(np.int64))
    return PackedDataset(ids, labels)


def task_datasets(task, length: int, train_examples: int, heldout_blocks: int, seed: int = 0):
    """``(train, held-out, stats)`` for ``qkmap compare``: the held-out split holds ``heldout_blocks`` sequences."""
    from qkmap_hf.training.data import DataStats

    train = TaskDataset(task, length, train_examples, seed, "train")
    heldout = heldout_dataset(task, length, max(1, heldout_blocks // 2), seed)
    stats = DataStats(
        sources=[f"task {task_spec(task)}"], text_field="", block_size=length, tokens=train_examples * length,
        train_blocks=train_examples, eval_blocks=len(heldout), split_seed=seed, eval_fraction=0.0,
        tokenizer="byte-level ids", extra={"task": task_spec(task)},
    )  # fmt: skip
    return train, heldout, stats


def answer_argmax(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``preprocess_logits_for_metrics``: keep only the argmax (the Trainer would otherwise gather every logit)."""
    return logits.argmax(dim=-1)


def answer_accuracy(eval_prediction) -> dict[str, Any]:
    """``compute_metrics``: accuracy of the next-token argmax at the answer positions (labels != -100)."""
    predictions, labels = eval_prediction.predictions, eval_prediction.label_ids
    predictions, labels = np.asarray(predictions)[:, :-1], np.asarray(labels)[:, 1:]  # position t predicts t + 1
    answered = labels != IGNORE_INDEX
    return {"accuracy": float((predictions[answered] == labels[answered]).mean()) if answered.any() else 0.0}


__all__ = [
    "IGNORE_INDEX",
    "CopyTask",
    "MQARTask",
    "SalienceTask",
    "TASKS",
    "TaskDataset",
    "answer_accuracy",
    "answer_argmax",
    "heldout_dataset",
    "parse_task",
    "task_datasets",
    "task_spec",
]
